"use strict";
// kvdiff HTML report. Builds the page from the JSON in #kvdiff-data with textContent only.
// Errors (script, promise, CSP) are recorded in the html element's data-errors attribute.
(function () {
  const errors = [];
  function note(message) {
    errors.push(String(message));
    document.documentElement.setAttribute("data-errors", errors.join(" | "));
  }
  window.addEventListener("error", (e) => note(e.message || "error"));
  window.addEventListener("unhandledrejection", (e) => note(e.reason));
  document.addEventListener("securitypolicyviolation", (e) =>
    note("CSP violation: " + e.violatedDirective + " " + e.blockedURI));

  const TIER_GLYPH = { bitwise: "·", noise: "░", divergent: "█", incomparable: "/" };
  const STOPS = [[0, [49, 54, 149]], [0.35, [116, 173, 209]], [0.55, [254, 224, 144]],
                 [0.75, [244, 109, 67]], [1, [165, 0, 38]]];
  const LOG_MIN = -8, LOG_MAX = 0, BITWISE = "#dcdcdc", INCOMPARABLE = "#f1f1f1";
  const FINAL_LABELS = { final_norm: "norm", logits: "logit" };

  const data = JSON.parse(document.getElementById("kvdiff-data").textContent);
  const R = data.report;
  const prompt = (R.prompt && R.prompt.tokens) || [];
  const refTokens = (R.reference && R.reference.tokens) || [];
  const candTokens = (R.candidate && R.candidate.tokens) || [];
  const chunks = R.chunks || [];
  const flip = R.first_token_divergence || null;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  // Non-finite floats arrive as the strings "Infinity", "-Infinity" and "NaN".
  function num(x) { return x === "Infinity" || x === "-Infinity" || x === "NaN" ? Number(x) : x; }
  function fmt(x) {
    if (x === null || x === undefined) return "–";
    const v = num(x);
    if (typeof v === "object") return JSON.stringify(v);
    if (typeof v !== "number") return String(v);
    return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(3)));
  }
  function span(p) { return Array.isArray(p) ? p[0] + "–" + p[1] : fmt(p); }
  function visible(token) { return String(token).replace(/\n/g, "↵").replace(/\t/g, "→"); }
  function chunkIndexAt(pos) {
    return chunks.findIndex((c) => c.positions && c.positions[0] <= pos && pos <= c.positions[1]);
  }
  function chunkAt(pos) {
    const i = chunkIndexAt(pos);
    return i >= 0 ? String(chunks[i].name) : (pos >= prompt.length ? "generated" : "?");
  }
  function tokenAt(pos) {
    if (pos < prompt.length) return prompt[pos];
    const step = pos - prompt.length;
    return step < refTokens.length ? refTokens[step] : "";
  }
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

  function verdict() {
    const head = document.getElementById("verdict");
    head.className = R.tokens_identical ? "identical" : "divergent";
    head.append(el("h1", "", String(R.verdict).toUpperCase() + (R.tokens_identical
      ? " — tokens identical" : flip ? " — tokens differ from step " + flip.step : " — tokens differ")));
    const cand = R.candidate || {};
    const meta = (R.metadata && R.metadata.reference) || {};
    head.append(el("p", "", "candidate strategy " + fmt(cand.strategy) + ", numerics " +
      fmt(cand.numerics) + (meta.model_name ? " · model " + meta.model_name : "")));
    const bit = R.first_bit_difference;
    head.append(el("p", "", bit ? "first bit difference: " + bit.tensor + " at layer " + bit.layer +
      ", position " + bit.position : "bitwise identical through every probe"));
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

  const canvas = document.getElementById("heatmap");
  const tooltip = document.getElementById("tooltip");
  let layout = null;

  function drawHeatmap(point) {
    const g = R.heatmaps[point], positions = g.positions || [], rows = heatRows(point);
    const wrap = document.getElementById("heatmap-wrap");
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
    // chunk boundaries and names
    ctx.textAlign = "left";
    let prev = null;
    positions.forEach((p, c) => {
      const name = chunkAt(p);
      if (name === prev) return;
      prev = name;
      const x = labelW + c * cellW - 0.5;
      ctx.strokeStyle = "#1d1f23"; ctx.lineWidth = 1.5; ctx.beginPath();
      ctx.moveTo(x, 4); ctx.lineTo(x, height); ctx.stroke(); ctx.lineWidth = 1;
      ctx.fillStyle = "#1d1f23"; ctx.fillText(name + " @" + p, x + 3, 12);
    });
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

  canvas.addEventListener("mousemove", (e) => {
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
      "tier   " + (tier ? tier + " " + (TIER_GLYPH[tier] || "") : "not captured"),
      "rel    " + fmt(row.rel[c]),
      "max_abs " + fmt(row.max_abs[c]),
    ].join("\n");
    tooltip.hidden = false;
    const wrap = document.getElementById("heatmap-wrap");
    tooltip.style.left = (e.clientX - wrap.getBoundingClientRect().left + wrap.scrollLeft + 14) + "px";
    tooltip.style.top = (e.clientY - wrap.getBoundingClientRect().top + 14) + "px";
  });
  canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });

  function legend() {
    const box = document.getElementById("legend");
    const item = (colour, label) => {
      const wrap = el("span"), sw = el("span", "swatch");
      sw.style.background = colour;
      wrap.append(sw, label);
      box.append(wrap);
    };
    item(BITWISE, "bitwise (rel 0)");
    for (let e = LOG_MIN; e <= LOG_MAX; e += 2) item(ramp(Math.pow(10, e)), "1e" + e);
    item(INCOMPARABLE, "incomparable");
  }

  function pointSelector() {
    const select = document.getElementById("point");
    for (const p of data.points) select.append(el("option", "", p));
    select.value = data.default_point;
    select.addEventListener("change", () => drawHeatmap(select.value));
  }

  function strip(label, tokens, step) {
    const row = el("div", "strip");
    row.append(el("span", "label", label));
    tokens.forEach((t, i) => {
      const cls = "tok" + (step === null ? "" : i === step ? " flip" : i > step ? " after" : "");
      const node = el("span", cls, visible(t));
      node.title = "step " + i + " · position " + (prompt.length + i);
      row.append(node);
    });
    return row;
  }

  function generated() {
    const box = document.getElementById("generated"), step = flip ? flip.step : null;
    box.append(strip("reference", refTokens, step));
    box.append(strip("candidate", candTokens, step));
    if (flip) box.append(el("p", "none", "first token flip at step " + flip.step + ": " +
      JSON.stringify(String(flip.reference_token)) + " → " + JSON.stringify(String(flip.candidate_token)) +
      " (top-1 margins " + fmt(flip.reference_margin) + " / " + fmt(flip.candidate_margin) + ")"));
  }

  function table(id, head, rows) {
    const t = document.getElementById(id), tr = el("tr");
    head.forEach((h) => tr.append(el("th", "", h)));
    t.append(tr);
    rows.forEach((cells) => {
      const row = el("tr");
      cells.forEach((c, i) => row.append(el("td", i > 0 ? "mono" : "", c)));
      t.append(row);
    });
  }

  function firsts() {
    const rows = [["first bit difference", R.first_bit_difference], ["first tolerance breach", R.first_divergence]]
      .map(([label, ev]) => ev ? [label, ev.tensor, ev.layer, ev.position + " " + JSON.stringify(String(tokenAt(ev.position))),
        ev.chunk, ev.tier || "", fmt(ev.max_abs), fmt(ev.rel)] : [label, "none", "", "", "", "", "", ""]);
    table("firsts", ["event", "tensor", "layer", "position", "chunk", "tier", "max_abs", "rel"], rows);
  }

  function diagnoses() {
    const box = document.getElementById("diagnoses"), list = R.diagnoses || [];
    if (!list.length) box.append(el("p", "none", "no diagnosis"));
    for (const d of list) {
      const card = el("div", "diag");
      card.append(el("h3", "", d.kind));
      card.append(el("p", "meta", "chunk " + fmt(d.chunk) + " · positions " + span(d.positions)));
      card.append(el("p", "", d.evidence));
      const extra = Object.keys(d).filter((k) => !["kind", "chunk", "positions", "evidence"].includes(k));
      if (extra.length) card.append(el("p", "meta", extra.map((k) => k + " = " + span(d[k])).join(" · ")));
      box.append(card);
    }
  }

  function timeline() {
    const box = document.getElementById("timeline");
    chunks.forEach((c, i) => {
      const seg = el("div", "seg c" + (i % 6)), pos = c.positions || [0, 0];
      seg.style.flexGrow = String(pos[1] - pos[0] + 1);
      seg.append(el("b", "", c.name));
      seg.append(el("span", "", span(pos) + " · " + c.cache + " · " + String(c.hash || "").slice(0, 8)));
      const enc = c.encoded_positions, moved = enc && (enc[0] !== pos[0] || enc[1] !== pos[1]);
      seg.append(el("div", moved ? "bad" : "", "encoded at " + span(enc)));
      box.append(seg);
    });
    if (refTokens.length) {
      const seg = el("div", "seg cgen");
      seg.style.flexGrow = String(refTokens.length);
      seg.append(el("b", "", "generated"), el("span", "", prompt.length + "–" + (prompt.length + refTokens.length - 1)));
      box.append(seg);
    }
    const strip = document.getElementById("prompt");
    prompt.forEach((t, p) => {
      const i = chunkIndexAt(p), node = el("span", "tok " + (i >= 0 ? "c" + (i % 6) : "cgen"), visible(t));
      node.title = "position " + p + " · chunk " + chunkAt(p);
      strip.append(node);
    });
  }

  function metadata() {
    const meta = R.metadata || {}, ref = meta.reference || {}, cand = meta.candidate || {};
    const keys = [...new Set([...Object.keys(ref), ...Object.keys(cand)])];
    table("metadata", ["", "reference", "candidate"], keys.map((k) => [k, fmt(ref[k]), fmt(cand[k])]));
  }

  try {
    verdict();
    if (data.default_point) {
      pointSelector();
      legend();
      drawHeatmap(data.default_point);
      document.body.setAttribute("data-nonblank-pixels", String(nonBlankPixels()));
    } else {
      document.getElementById("heatmap-wrap").replaceChildren(el("p", "none", "no heatmap in this report"));
    }
    generated();
    firsts();
    diagnoses();
    timeline();
    metadata();
    document.body.setAttribute("data-ready", "1");
  } catch (e) {
    note(e && e.message ? e.message : e);
    throw e;
  }
})();
