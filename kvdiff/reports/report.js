// kvdiff HTML report. Builds the page from the JSON in #kvdiff-data with textContent only.
// Runs from <head>, so that errors (script, promise, CSP) anywhere in the page are recorded in
// the html element's data-errors attribute; the page itself is built on DOMContentLoaded.
(function () {
  "use strict";
  const errors = [];
  function note(message) {
    errors.push(String(message));
    document.documentElement.setAttribute("data-errors", errors.join(" | "));
  }
  window.addEventListener("error", (e) => note(e.message || "error"));
  window.addEventListener("unhandledrejection", (e) => note(e.reason));
  document.addEventListener("securitypolicyviolation", (e) =>
    note("CSP violation: " + e.violatedDirective + " " + e.blockedURI));

  let data, R, prompt, refTokens, candTokens, chunks, flip, heatmap;

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
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) < 1e-3 ? v.toExponential(2) : String(Number(v.toPrecision(3)));
  }
  function span(p) { return Array.isArray(p) ? p[0] + "–" + p[1] : fmt(p); }
  function visible(token) { return String(token).replace(/\n/g, "↵").replace(/\t/g, "→"); }
  function chunkIndexAt(pos) {
    return chunks.findIndex((c) => c.positions && c.positions[0] <= pos && pos <= c.positions[1]);
  }
  function chunkAt(pos) {
    const i = chunkIndexAt(pos);
    return i >= 0 ? String(chunks[i].name) : pos >= prompt.length ? "generated" : chunks.length ? "?" : "prompt";
  }
  function tokenAt(pos) {
    if (pos < prompt.length) return prompt[pos];
    const step = pos - prompt.length;
    return step < refTokens.length ? refTokens[step] : "";
  }
  function verdict() {
    const head = document.getElementById("verdict");
    head.className = R.tokens_identical ? "identical" : "divergent";
    const inputs = Number.isInteger(R.first_input_difference) ? R.first_input_difference : null;
    head.append(el("h1", "", String(R.verdict).toUpperCase() + (R.tokens_identical
      ? " — tokens identical" : inputs !== null ? " — inputs differ from position " + inputs
      : flip ? " — tokens differ from step " + flip.step : " — tokens differ")));
    const op = R.first_operation;
    if (op) head.append(el("p", "answer", (op.tier === "divergent" ? "first breaks: " : "bits first differ in: ") +
      op.operation + " at layer " + fmt(op.layer) + ", position " + op.position + " " +
      JSON.stringify(String(tokenAt(op.position))) + " (chunk " + chunkAt(op.position) + ")" +
      (op.proved ? " — inputs match" : " — not proved")));
    const top = Number.isInteger(R.top_diagnosis) && (R.diagnoses || [])[R.top_diagnosis];
    if (top) head.append(el("p", "answer", "diagnosis: " + top.kind + (top.chunk == null ? "" : ", chunk " + top.chunk) +
      ", positions " + span(top.positions) + (top.offset != null ? ", offset " + fmt(top.offset) : "")));
    const cand = R.candidate || {};
    const meta = (R.metadata && R.metadata.reference) || {};
    head.append(el("p", "", "candidate strategy " + fmt(cand.strategy) + ", numerics " +
      fmt(cand.numerics) + (meta.model_name ? " · model " + meta.model_name : "")));
    if (inputs !== null) {
      head.append(el("p", "", "the traces are of different prompts: positions from " + inputs +
        " on are not compared"));
    }
    const differs = Array.isArray(R.recorded_with_different) ? R.recorded_with_different.map(String) : [];
    if (differs.length) {
      head.append(el("p", "", "recorded with different " + differs.join(" and ") + ": differences may come from them"));
    }
    const bit = R.first_bit_difference;
    head.append(el("p", "", bit ? "first bit difference: " + bit.tensor + " at layer " + bit.layer +
      ", position " + bit.position : "bitwise identical through every probe" +
      (inputs !== null ? " before position " + inputs : "")));
    const against = R.engine_vs_reference;
    if (against && against.first_divergence) head.append(el("p", "answer",
      "the engine's cold run against kvdiff's reference: " + breaks(against)));
  }

  function pointSelector() {
    const select = document.getElementById("point");
    for (const p of data.points) select.append(el("option", "", p));
    select.value = data.default_point;
    select.addEventListener("change", () => heatmap.draw(select.value));
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
      .concat(R.first_large_divergence ? [["first large divergence", R.first_large_divergence]] : [])
      .map(([label, ev]) => ev ? [label, ev.tensor, ev.layer, ev.position + " " + JSON.stringify(String(tokenAt(ev.position))),
        ev.chunk, ev.tier || "", fmt(ev.max_abs), fmt(ev.rel)] : [label, "none", "", "", "", "", "", ""]);
    table("firsts", ["event", "tensor", "layer", "position", "chunk", "tier", "largest |difference|",
      "rel_diff (‖a−b‖² / (‖a‖²+‖b‖²))"], rows);
  }

  function conversation() {
    const box = document.getElementById("conversation"), list = Array.isArray(R.conversation) ? R.conversation : [];
    if (!list.length) box.append(el("p", "none", "not in this report"));
    list.forEach((m, i) => {
      const chunk = chunks.find((c) => String(c.name).split("#")[0] === String(m.role) && chunks.indexOf(c) === i);
      const card = el("div", "message");
      card.append(el("b", "", String(m.role) + (chunk ? " · chunk " + chunk.name + " · positions " + span(chunk.positions) : "")));
      card.append(el("pre", "", String(m.content)));
      box.append(card);
    });
  }

  function options(given) {       // --engine-option settings: ", with key=value, ..."
    if (!given || typeof given !== "object" || Array.isArray(given)) return "";
    const parts = Object.keys(given).map((k) => k + "=" + JSON.stringify(given[k]));
    return parts.length ? ", with " + parts.join(", ") : "";
  }

  function engine() {
    const box = document.getElementById("engine"), e = R.engine;
    if (!e) { box.parentNode.hidden = true; return; }
    const floor = R.noise_floor || {}, rows = [
      ["engine", String(e.name) + " " + String(e.version) + (e.weights ? " on " + String(e.weights) + " weights" +
        (e.quantized ? " (" + String(e.quantized) + ")" : "") : "") + options(e.options)],
      ["cache hit", "warm run served " + fmt(e.cache_hit_tokens) + " of " + fmt(e.prompt_tokens) + " prompt tokens from its cache" +
        (e.cached_positions_recorded != null && e.cached_positions_recorded !== e.cache_hit_tokens ?
          "; but the warm trace records " + fmt(e.cached_positions_recorded) + " positions read from it: the count or the recording is wrong" : "")],
      ["noise floor", "two cold runs: " + (floor.bitwise_equal ? "bitwise equal" : "logits max_abs " + fmt(floor.max_abs_logit))]];
    (R.flips || []).forEach((f) => rows.push(["flip: " + f.kind, "step " + f.step + ": " +
      JSON.stringify(String(f.reference_token)) + " → " + JSON.stringify(String(f.candidate_token)) +
      ", cold margin " + fmt(f.reference_margin) + ", logits max_abs there " + fmt(f.logit_max_abs)]));
    const ref = R.engine_vs_reference;
    if (ref) rows.push(["vs kvdiff reference", (ref.tokens_identical ? "tokens identical" : "tokens differ (" +
      fmt((ref.flip || {}).kind) + ")") + "; " + breaks(ref) + (e.quantized ? " (its matmuls run on " +
      String(e.quantized) + " weights: its projections differ from the reference's by quantization; what a run's " +
      "own tensors prove, norms recomputed and RoPE's rotation, is unaffected)" : "")]);
    table("engine", ["", "details"], rows);
    if (ref && Array.isArray(ref.diagnoses) && ref.diagnoses.length) {
      const box = document.getElementById("against");
      box.parentNode.hidden = false;
      diagnoses(box, ref.diagnoses);
    }
  }

  function breaks(section) {     // where a section's runs first part beyond tolerance, and the operation
    const op = section.first_operation, first = section.first_divergence;
    if (op && op.tier === "divergent") return "first breaks: " + op.operation + " at layer " + fmt(op.layer) +
      ", position " + fmt(op.position) + (op.proved ? " (inputs match)" : " (not proved)");
    if (first) return "first beyond tolerance: " + first.tensor + " at layer " + fmt(first.layer) + ", position " +
      fmt(first.position);
    return "within tolerance everywhere";
  }

  function diagnoses(box, list) {
    list = (list || []).filter((d) => d && typeof d === "object");
    if (!list.length) box.append(el("p", "none", "no diagnosis"));
    for (const d of list) {
      const card = el("div", "diag");
      card.append(el("h3", "", d.kind));
      card.append(el("p", "meta", (d.chunk == null ? "" : "chunk " + fmt(d.chunk) + " · ") + "positions " + span(d.positions)));
      card.append(el("p", "", d.evidence));
      const extra = Object.keys(d).filter((k) => !["kind", "chunk", "positions", "evidence"].includes(k));
      if (extra.length) card.append(el("p", "meta", extra.map((k) => k + " = " + span(d[k])).join(" · ")));
      box.append(card);
    }
  }

  function timeline() {
    const box = document.getElementById("timeline"), re = R.recomputed;
    if (re && Array.isArray(re.positions)) box.parentNode.insertBefore(el("p", "",
      "blend recomputed " + re.positions.length + " of " + fmt(re.placed) + " placed positions (" + fmt(re.share) +
      "): " + (re.positions.join(", ") || "none") + "; the ratio counts " + fmt(re.counted_over)), box);
    const dg = R.digest;
    if (dg && typeof dg === "object") box.parentNode.insertBefore(el("p", "", "digest capture: every row hashed; " +
      (dg.zoom ? "layers " + span(dg.zoom.layers) + ", positions " + span(dg.zoom.positions) + " recorded in full; " +
        (dg.repeated ? "the zoom run repeated the first" : "the zoom run did NOT repeat the first (nondeterministic)")
        : "no zoom run: every digest equal")), box);
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

  function blendErrors() {
    const be = R.blend_errors, names = ["blend", "isolated-local", "isolated-global"];
    const box = document.getElementById("blend-summary");
    const ok = be && Array.isArray(be.positions) && be.positions.length && be.positions.every(Number.isInteger) &&
      Array.isArray(be.recomputed) && names.every((n) => Array.isArray(be[n]) && be[n].length === be.positions.length);
    if (!ok) { box.parentNode.hidden = true; return; }
    const again = be.positions.map((_, i) => i).filter((i) => be.recomputed[i] === true);
    const mended = again.filter((i) => typeof num(be.blend[i]) === "number" &&
      names.slice(1).every((n) => typeof num(be[n][i]) === "number" && num(be.blend[i]) <= num(be[n][i])));
    box.textContent = "blend's error is at most both isolated strategies' at " + mended.length + " of " +
      again.length + " recomputed positions (of " + be.positions.length + " placed)";
    table("blend", ["position", "chunk", "recomputed", ...names], be.positions.map((p, i) =>
      [p + " " + JSON.stringify(String(tokenAt(p))), chunkAt(p), be.recomputed[i] === true ? "yes" : "no",
        ...names.map((n) => fmt(be[n][i]))]));
  }

  function metadata() {
    const meta = R.metadata || {}, ref = meta.reference || {}, cand = meta.candidate || {};
    const keys = [...new Set([...Object.keys(ref), ...Object.keys(cand)])];
    table("metadata", ["", "reference", "candidate"], keys.map((k) => [k, fmt(ref[k]), fmt(cand[k])]));
  }

  function main() {
    data = JSON.parse(document.getElementById("kvdiff-data").textContent);
    R = data.report;
    prompt = (R.prompt && R.prompt.tokens) || [];
    refTokens = (R.reference && R.reference.tokens) || [];
    candTokens = (R.candidate && R.candidate.tokens) || [];
    chunks = R.chunks || [];
    flip = R.first_token_divergence || null;
    verdict();
    if (data.default_point) {
      heatmap = kvdiffHeatmap({ report: R, el, fmt, num, chunkAt, tokenAt,
        canvas: document.getElementById("heatmap"), tooltip: document.getElementById("tooltip"),
        wrap: document.getElementById("heatmap-wrap"), legendBox: document.getElementById("legend") });
      pointSelector();
      heatmap.draw(data.default_point);
      document.body.setAttribute("data-nonblank-pixels", String(heatmap.nonBlankPixels()));
    } else {
      document.getElementById("heatmap-wrap").replaceChildren(el("p", "none", "no heatmap in this report"));
    }
    conversation();
    generated();
    firsts();
    engine();
    diagnoses(document.getElementById("diagnoses"), R.diagnoses);
    timeline();
    blendErrors();
    metadata();
    document.body.setAttribute("data-ready", "1");
  }

  document.addEventListener("DOMContentLoaded", main);
})();
