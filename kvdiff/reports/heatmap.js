"use strict";
// The report's interactive heatmap: one probe point's rel per layer (rows) and position
// (columns) on a canvas, chunk boundaries as vertical rules, a tooltip on hover.
// kvdiffHeatmap(page) takes the page's helpers and elements and returns {draw, nonBlankPixels}.
function kvdiffHeatmap(page) {
  const { report: R, el, fmt, num, chunkAt, tokenAt, canvas, tooltip, wrap, legendBox } = page;
  let layout = null;

  const TIER_GLYPH = { bitwise: "·", noise: "░", different: "▒", divergent: "█", incomparable: "/" };
  const STOPS = [[0, [49, 54, 149]], [0.35, [116, 173, 209]], [0.55, [254, 224, 144]],
                 [0.75, [244, 109, 67]], [1, [165, 0, 38]]];
  const LOG_MIN = -8, LOG_MAX = 0, BITWISE = "#dcdcdc", INCOMPARABLE = "#f1f1f1";
  const FINAL_LABELS = { final_norm: "norm", logits: "logit" };
  function ramp(rel) {
    const v = num(rel);
    if (!(v > 0)) return BITWISE;
    const lg = Math.min(Math.max(Math.log10(v), LOG_MIN), LOG_MAX);
    const t = (lg - LOG_MIN) / (LOG_MAX - LOG_MIN);
    for (let i = 1; i < STOPS.length; i++) {
      if (t <= STOPS[i][0]) {
        const [t0, c0] = STOPS[i - 1], [t1, c1] = STOPS[i], f = (t - t0) / (t1 - t0);
        return "rgb(" + c0.map((a, k) => Math.round(a + (c1[k] - a) * f)).join(",") + ")";
      }
    }
    return "rgb(165,0,38)";
  }

  function heatRows(point) {
    const g = R.heatmaps[point];
    const rows = (g.layers || []).map((layer, i) => ({
      label: "L" + layer, layer: layer, rel: g.rel[i], max_abs: (g.max_abs || [])[i] || [], tiers: g.tiers[i] }));
    const finals = R.final || {};
    for (const name of Object.keys(finals)) {
      const f = finals[name], where = new Map((f.positions || []).map((p, i) => [p, i]));
      const pick = (arr) => g.positions.map((p) => (where.has(p) && arr ? arr[where.get(p)] : null));
      rows.push({ label: FINAL_LABELS[name] || name, layer: name, rel: pick(f.rel),
                  max_abs: pick(f.max_abs), tiers: pick(f.tiers) });
    }
    return rows;
  }


  function drawHeatmap(point) {
    const g = R.heatmaps[point], positions = g.positions || [], rows = heatRows(point);
    const labelW = 48, top = 34, cellH = rows.length > 60 ? 8 : 14;
    const cellW = Math.max(3, Math.min(28, Math.floor((wrap.clientWidth - 16 - labelW) / Math.max(1, positions.length))));
    const width = labelW + positions.length * cellW + 2, height = top + rows.length * cellH + 2;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = width * dpr; canvas.height = height * dpr;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, width, height);
    ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    let drawn = 0;
    rows.forEach((row, r) => {
      const y = top + r * cellH;
      ctx.fillStyle = "#6b7078"; ctx.textAlign = "right";
      ctx.fillText(row.label, labelW - 6, y + cellH / 2);
      positions.forEach((_, c) => {
        const tier = row.tiers[c], x = labelW + c * cellW;
        if (tier === null || tier === undefined) return;
        drawn++;
        ctx.fillStyle = tier === "incomparable" ? INCOMPARABLE : ramp(row.rel[c]);
        ctx.fillRect(x, y, cellW - (cellW > 4 ? 1 : 0), cellH - 1);
        if (tier === "incomparable") {
          ctx.strokeStyle = "#b9b9b9"; ctx.beginPath();
          ctx.moveTo(x, y + cellH - 1); ctx.lineTo(x + cellW - 1, y); ctx.stroke();
        }
      });
    });
    // chunk boundaries and names; a name goes in the first of two lanes where it overlaps none,
    // else it is left out (hovering a cell names its chunk)
    ctx.textAlign = "left";
    let prev = null;
    const laneEnds = [-Infinity, -Infinity], labels = [];
    positions.forEach((p, c) => {
      const name = chunkAt(p);
      if (name === prev) return;
      prev = name;
      const x = labelW + c * cellW - 0.5;
      ctx.strokeStyle = "#1d1f23"; ctx.lineWidth = 1.5; ctx.beginPath();
      ctx.moveTo(x, 4); ctx.lineTo(x, height); ctx.stroke(); ctx.lineWidth = 1;
      const text = name + " @" + p, x0 = x + 3, x1 = x0 + ctx.measureText(text).width;
      const lane = laneEnds.findIndex((end) => x0 >= end + 6);
      labels.push({ text, lane, x0: Math.round(x0), x1: Math.round(x1) });
      if (lane < 0) return;
      laneEnds[lane] = x1;
      ctx.fillStyle = "#1d1f23"; ctx.fillText(text, x0, 10 + lane * 13);
    });
    document.body.setAttribute("data-chunk-labels", JSON.stringify(labels));
    for (const [key, dash] of [["first_divergence", []], ["first_bit_difference", [3, 2]]]) {
      const ev = R[key];
      if (!ev || ev.tensor !== point) continue;
      const c = positions.indexOf(ev.position), r = rows.findIndex((row) => row.layer === ev.layer);
      if (c < 0 || r < 0) continue;
      ctx.setLineDash(dash); ctx.strokeStyle = "#000000"; ctx.lineWidth = 2;
      ctx.strokeRect(labelW + c * cellW - 1, top + r * cellH - 1, cellW + 1, cellH + 1);
      ctx.setLineDash([]); ctx.lineWidth = 1;
    }
    layout = { point, positions, rows, labelW, top, cellW, cellH };
    document.body.setAttribute("data-point", point);
    document.body.setAttribute("data-cells-drawn", String(drawn));
  }

  function nonBlankPixels() {
    const ctx = canvas.getContext("2d");
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let count = 0;
    for (let i = 0; i < px.length; i += 4) if (px[i] !== 255 || px[i + 1] !== 255 || px[i + 2] !== 255) count++;
    return count;
  }

  function hover(e) {
    if (!layout) return;
    const box = canvas.getBoundingClientRect();
    const c = Math.floor((e.clientX - box.left - layout.labelW) / layout.cellW);
    const r = Math.floor((e.clientY - box.top - layout.top) / layout.cellH);
    const row = layout.rows[r];
    if (!row || c < 0 || c >= layout.positions.length) { tooltip.hidden = true; return; }
    const pos = layout.positions[c], tier = row.tiers[c];
    tooltip.textContent = [
      (typeof row.layer === "number" ? "layer " + row.layer : row.layer) + " · position " + pos,
      "token  " + JSON.stringify(String(tokenAt(pos))),
      "chunk  " + chunkAt(pos),
      "tier   " + (tier ? tier + " " + (TIER_GLYPH[tier] || "") : "not recorded (K/V read from the cache)"),
      "rel_diff " + fmt(row.rel[c]) + "  (‖a−b‖² / (‖a‖²+‖b‖²))",
      "largest |difference| " + fmt(row.max_abs[c]),
    ].join("\n");
    tooltip.hidden = false;
    tooltip.style.left = (e.clientX - wrap.getBoundingClientRect().left + wrap.scrollLeft + 14) + "px";
    tooltip.style.top = (e.clientY - wrap.getBoundingClientRect().top + 14) + "px";
  }

  function legend() {
    const box = legendBox;
    const item = (colour, label) => {
      const wrap = el("span"), sw = el("span", "swatch");
      sw.style.background = colour;
      wrap.append(sw, label);
      box.append(wrap);
    };
    item(BITWISE, "bitwise (rel 0)");
    for (let e = LOG_MIN; e <= LOG_MAX; e += 2) item(ramp(Math.pow(10, e)), "1e" + e);
    item(INCOMPARABLE, "incomparable");
    const blank = Object.values(R.heatmaps || {}).some((g) => (g.tiers || []).some((row) => row.includes(null)));
    if (blank) item("#ffffff", "not recorded (K/V read from the cache)");
    const different = Object.values(R.heatmaps || {}).some((g) => (g.tiers || []).some((row) => row.includes("different")));
    if (different) item(ramp(Math.pow(10, LOG_MIN)), "▒ bits differ outside the zoom window (colour: a lower bound)");
  }

  canvas.addEventListener("mousemove", hover);
  canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
  legend();
  return { draw: drawHeatmap, nonBlankPixels };
}
