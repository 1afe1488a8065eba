"""The llama.cpp target (kvdiff.targets.llamacpp) on the bundled SmolLM2 GGUF, with real llama-cpp-python runs.

One engine for the module (reset_cache between tests), on the float32 copy of the GGUF that
`compare --engine llama.cpp` runs by default: its reference is kvdiff's transformers model loaded
from the same GGUF (dequantized), so engine and reference hold the same values and differ by
llama.cpp's summation order alone; cold and warm engine runs are compared exactly. The GGUF's own
Q4_1 weights (`--engine-weights native`) are run by the tests that say so. Planted bugs go through
the engine's own extension points: a `cb_eval` tap that changes tensors, the context's attention
mask (`llama_set_causal_attn`), or the engine's sequence state (`llama_state_seq_get/set_data`)
edited between the primer and the warm request.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

import kvdiff  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.engine.loading import default_gguf_path  # noqa: E402
from kvdiff.errors import InputError, KvdiffError  # noqa: E402
from kvdiff.probes.recorder import TraceRecorder  # noqa: E402
from kvdiff.targets.gguf_float import float32_gguf  # noqa: E402
from kvdiff.targets.llamacpp import LlamaCppTarget  # noqa: E402
from kvdiff.trace import open_trace  # noqa: E402
from conftest import lent_open_target  # noqa: E402

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely. When you are unsure, say so, and never "
          "invent facts. Prefer plain words over jargon, keep every answer short, and always name your sources "
          "when you can. Never repeat the question back, and do not apologise for things you did not do.")
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
PRIMER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
NEW = 6            # generated tokens per run


@pytest.fixture(scope="module")
def gguf():
    return default_gguf_path()


@pytest.fixture(scope="module")
def hf(default_model):
    return default_model            # the reference: the same GGUF, dequantized (the session's copy)


@pytest.fixture(scope="module")
def target(gguf):
    t = LlamaCppTarget(float32_gguf(gguf), n_ctx=256)
    yield t
    t.close()


@pytest.fixture
def native(gguf):
    """The GGUF as it is (Q4_1), for one test at a time."""
    t = LlamaCppTarget(gguf, n_ctx=256)
    yield t
    t.close()


@pytest.fixture(scope="module")
def ids(hf):
    _, tokenizer = hf
    prompt, primer = render_prompt_ids(tokenizer, PROMPT), render_prompt_ids(tokenizer, PRIMER)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, primer)) if a != b)
    assert len(prompt) >= 80 and shared >= 64
    return prompt, primer, shared           # llama.cpp keeps the whole common prefix (no blocks)


def _record(target, hf, path, prompt_ids):
    model, tokenizer = hf
    recorder = TraceRecorder.for_model(model, tokenizer, PROMPT, path, input_ids=prompt_ids, capture=target.points,
                                       strategy="llama.cpp", max_new_tokens=NEW)
    run = target.generate(prompt_ids, NEW, sink=recorder)
    return recorder.finish(run.token_ids, run.text), run


@pytest.fixture(scope="module")
def cold_trace(target, hf, ids, tmp_path_factory):
    target.reset_cache()
    path, run = _record(target, hf, tmp_path_factory.mktemp("llamacpp-cold") / "cold.h5", ids[0])
    assert run.cache_hit_tokens == 0
    target.reset_cache()
    return path


def _warm(target, hf, ids, path, during_primer=None, after_primer=None, during_warm=None):
    """Reset, run the primer (optionally with a tap planted), optionally edit the cache, record the
    warm run (optionally with a tap planted)."""
    target.reset_cache()
    if during_primer:
        target.taps.append(during_primer)
    try:
        target.generate(ids[1], 1)
    finally:
        target.taps.clear()
    if after_primer:
        after_primer(target)
    if during_warm:
        target.taps.append(during_warm)
    try:
        trace, run = _record(target, hf, path, ids[0])
    finally:
        target.taps.clear()
    target.reset_cache()
    assert run.cache_hit_tokens == ids[2]
    return trace


def _cached_diagnoses(div, cached: int):
    return [d for d in div.diagnoses if d.positions and d.positions[1] < cached]


# -- clean runs ------------------------------------------------------------------------------------


def test_cold_reset_and_warm_runs(target, ids):
    prompt, primer, cached = ids
    target.reset_cache()
    first = target.generate(prompt, NEW)
    target.reset_cache()
    again = target.generate(prompt, NEW)
    assert first.token_ids == again.token_ids and len(first.token_ids) == NEW
    assert first.cache_hit_tokens == again.cache_hit_tokens == 0
    target.generate(primer, 1)
    warm = target.generate(prompt, NEW)
    assert warm.token_ids == first.token_ids
    assert warm.cache_hit_tokens == cached
    assert warm.margins == pytest.approx(first.margins) and all(m >= 0 for m in warm.margins)
    assert target.info.name == "llama.cpp" and target.info.version and target.info.checkpoint.suffix == ".gguf"
    target.reset_cache()


def test_traces_open_and_warm_matches_cold(target, hf, ids, cold_trace, tmp_path):
    prompt, _, cached = ids
    warm = _warm(target, hf, ids, tmp_path / "warm.h5")
    with open_trace(cold_trace) as t:
        assert list(t.positions) == list(range(len(prompt) + NEW - 1))
        assert set(t.meta.points) == set(target.points) and t.meta.kv_only_positions.size == 0
        assert not t.provenance.reused.any()
        assert t.steps.position.tolist() == list(range(len(prompt) - 1, len(prompt) + NEW - 1))
        logits = t.point(None, "logits")
        assert logits.shape[0] == len(prompt) + NEW - 1
        # the logits row of each step is the logits point's row at that position, and chose the token
        np.testing.assert_array_equal(logits[t.steps.position].argmax(-1), t.steps.token_id)
    with open_trace(warm) as t:
        assert t.meta.kv_only_positions.tolist() == list(range(cached))
        assert t.provenance.reused.tolist() == [True] * cached + [False] * (t.positions.size - cached)
        assert t.provenance.chunk[0] == "cache" and t.provenance.chunk[cached] == "prompt"
        assert t.provenance.encoded_position.tolist() == t.positions.tolist()
        with open_trace(cold_trace) as c:       # llama.cpp's CPU kernels: the warm run is bitwise the cold one
            for layer in list(t.meta.layers) + [None]:
                for point in t.points_in(layer):
                    rows = slice(0 if point in ("k", "v") else cached, None)     # cached k/v: read from the cache
                    np.testing.assert_array_equal(t.point(layer, point)[rows], c.point(layer, point)[rows])
    div = kvdiff.diff(cold_trace, warm)
    assert div.tokens_identical and div.first_divergence is None and not div.diagnoses, div.diagnoses


def test_the_same_prompt_again_is_served_whole_from_the_cache(target, hf, ids, cold_trace, tmp_path):
    """kvdiff compare's default warm fill is the prompt itself (one token): llama-cpp-python then keeps
    the whole prompt and samples the first token from the logits it kept, with no prompt forward.
    Expected: a hit of every prompt token, all of them K/V-only rows read from the cache, and a warm
    trace kvdiff finds no difference in."""
    prompt = ids[0]
    target.reset_cache()
    target.generate(prompt, 1)
    warm, run = _record(target, hf, tmp_path / "warm.h5", prompt)
    target.reset_cache()
    assert run.cache_hit_tokens == len(prompt)
    with open_trace(warm) as t:
        assert t.meta.kv_only_positions.tolist() == list(range(len(prompt)))
        assert t.steps.position.tolist() == list(range(len(prompt) - 1, len(prompt) + NEW - 1))
    div = kvdiff.diff(cold_trace, warm)
    assert div.tokens_identical and div.first_divergence is None and not div.diagnoses, div.diagnoses


def test_engine_tensors_line_up_with_the_reference(target, hf, ids, cold_trace, tmp_path):
    """On the float32 copy llama.cpp holds the reference's values: every point of every layer (q and k
    back in the checkpoint's head layout) within tolerance of the reference's, the tokens the same. A
    wrong layout, mapping or position would break tolerance at layer 0."""
    assert target.info.quantized is None and target.info.checkpoint.name.endswith(".F32.gguf")
    model, tokenizer = hf
    ref = kvdiff.record(model, tokenizer, PROMPT, tmp_path / "ref.h5", max_new_tokens=NEW)
    div = kvdiff.diff(ref, cold_trace)
    assert div.tokens_identical and div.first_divergence is None, div.diagnoses
    assert [d.kind for d in div.diagnoses] == ["numerical_noise"]
    assert div.first_bit_difference is not None                 # other kernels: the bits do differ
    assert {"q", "k", "v", "attn_out", "resid_post"} <= set(div.comparison.points)


def test_native_tensors_line_up_with_the_reference(native, hf, ids, tmp_path):
    """On the GGUF's own Q4_1 weights the rows differ by quantization, but each point must correlate
    with the reference's at the same layer and position (measured: median cosine >= 0.998
    everywhere); a wrong layout or mapping would not."""
    assert native.info.quantized == "Q4_1"
    model, tokenizer = hf
    ref = kvdiff.record(model, tokenizer, PROMPT, tmp_path / "ref.h5", max_new_tokens=NEW)
    cold, _ = _record(native, hf, tmp_path / "cold.h5", ids[0])
    with open_trace(ref) as r, open_trace(cold) as c:
        n = len(ids[0])                     # the prompt's positions: the same tokens in both
        for layer in (0, model.config.num_hidden_layers - 1):
            for point in ("resid_pre", "attn_norm", "q", "k_pre_rope", "k", "v", "attn_out", "mlp_out", "resid_post"):
                a = r.point(layer, point)[:n].reshape(n, -1).astype(np.float64)
                b = c.point(layer, point)[:n].reshape(n, -1).astype(np.float64)
                cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
                assert np.median(cos) > 0.99, (layer, point, np.median(cos))     # 0.085 for k in the GGUF's layout


# -- planted bugs: diff(cold, warm) must name them -------------------------------------------------


def _rerotated(target, offset: int, applies, base: float | None = None):
    """A tap re-rotating q and k (every layer) by `offset` more positions where `applies(positions)`,
    with RoPE of `base` (default: the GGUF's)."""
    base = float(target.llm.metadata["llama.rope.freq_base"]) if base is None else base
    d = target.head_dim
    inv = base ** (-np.arange(0, d, 2) / d)
    pre = {}

    def shift(name, op, rows, positions):
        if not name.startswith(("Qcur-", "Kcur-")):
            return None
        if op != "ROPE":
            pre[name] = rows.copy()
            return None
        pos = np.asarray(positions)
        keep = applies(pos)
        x = pre.pop(name).astype(np.float64).reshape(len(pos), -1, d // 2, 2)
        angle = (pos[:, None] + offset) * inv[None, :]
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        out = np.stack([x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos], -1)
        rows = rows.copy()
        rows[keep] = out.reshape(len(pos), -1)[keep]
        return rows
    return shift


@pytest.mark.parametrize("base", [None, 20000.0])
def test_rope_of_another_base_in_every_run_is_named_against_the_reference(native, hf, gguf, monkeypatch, tmp_path,
                                                                          base):
    """`kvdiff compare --engine llama.cpp --engine-weights native` with RoPE of base 20000 in every run
    (the GGUF says 100000): cold and warm agree, and against kvdiff's reference every projection
    differs by quantization (Q4_1), yet the RoPE claim rests on each run's own k_pre_rope and k.
    Expected (written before the first run): rope_mismatch at layer 0 fitting base 2e4 against the
    reference's 1e5, no position_mismatch; with no bug, neither (quantization alone claims no RoPE
    fault)."""
    from rich.console import Console

    from kvdiff.reports.terminal import render_terminal
    from kvdiff.run import engine_compare
    from kvdiff.run.compare import compare
    from kvdiff.run.model_cache import ModelKey

    monkeypatch.setattr(engine_compare, "open_target", lent_open_target(native, "native"))
    if base is not None:
        native.taps.append(_rerotated(native, 0, lambda pos: pos >= 0, base))
    result = compare(PROMPT, engine="llama.cpp", model=str(gguf), warm=PRIMER, max_new_tokens=NEW,
                     out=tmp_path / "run", model_cache={ModelKey(str(gguf)): hf}, engine_weights="native")
    report = result.report.to_json()
    assert report["engine"]["quantized"] == "Q4_1" and report["engine"]["weights"] == "native"
    assert report["engine"]["cache_hit_tokens"] == report["engine"]["cached_positions_recorded"] > 0
    against = report["engine_vs_reference"]
    rope = [d for d in against["diagnoses"] if d["kind"] in ("rope_mismatch", "position_mismatch")]
    if base is None:
        assert rope == []
        console = Console(width=200, record=True, no_color=True)
        render_terminal(result.report, console)
        assert "its matmuls run on Q4_1 weights: its projections differ from the reference's by quantization" \
            in " ".join(console.export_text().split())
        return
    assert rope and {d["kind"] for d in rope} == {"rope_mismatch"} and all(d["layer"] == 0 for d in rope)
    assert all(abs(d["base"] / 2e4 - 1) < 1e-3 and abs(d["reference_base"] / 1e5 - 1) < 1e-3 for d in rope)
    assert rope[0]["positions"][0] == 0


def _scaled(name: str, factor: float, op: str | None = None):
    """A tap scaling the named graph tensor (only its `op` node where given) in every forward."""
    def scale(tensor, tensor_op, rows, positions):
        return rows * factor if tensor == name and op in (None, tensor_op) else None
    return scale


class _NotCausal:
    """llama.cpp's own switch: attention over every key of the batch, later ones too (embedding mode)."""

    def __init__(self, target):
        self.target = target

    def __enter__(self):
        self.target.lib.llama_set_causal_attn(self.target.llm._ctx.ctx, False)

    def __exit__(self, *exc):
        self.target.lib.llama_set_causal_attn(self.target.llm._ctx.ctx, True)


@pytest.mark.parametrize("bug", ["none", "not causal", "not causal, cut window", "v scaled", "rope base"])
def test_a_bug_in_every_float32_run_is_diagnosed_against_the_reference(target, hf, gguf, monkeypatch, tmp_path, bug):
    """`kvdiff compare --engine llama.cpp` (float32 weights, the default) with a bug in every run of the
    engine: cold and warm agree (with the mask not causal, the warm run's rows also see rows the fill
    request left in the cache, explained the same way), so only the engine against kvdiff's reference can show it, and with
    the reference's values in the engine every rule applies, attention's included (on Q4_1 weights
    the q projection is the first operation whatever the bug). Expected: no bug, no diagnosis and the
    tokens the same; the context's attention made non-causal: attention_mismatch at layer 0 from position 0, explained
    as a mask that is not causal (the explanation added after its first run said "no tested
    explanation"), attention the first operation; where the zoom window (64 positions) ends before
    the prompt's forward does, that explanation cannot be tested (keys past the window are not
    recorded) and is not claimed, the attention_mismatch still is; layer 1's v x1.01: operation_mismatch, the v projection at layer 1 first
    (both written after an exploratory run of the same plants); RoPE of base 20000 (written before
    its first run): rope_mismatch at layer 0 fitting 2e4 against 1e5."""
    from kvdiff.run import engine_compare
    from kvdiff.run.compare import compare
    from kvdiff.run.model_cache import ModelKey

    monkeypatch.setattr(engine_compare, "open_target", lent_open_target(target))
    plant = {"v scaled": _scaled("Vcur-1", 1.01), "rope base": _rerotated(target, 0, lambda pos: pos >= 0, 20000.0)}
    if bug in plant:
        target.taps.append(plant[bug])
    try:
        with _NotCausal(target) if bug.startswith("not causal") else contextlib.nullcontext():
            result = compare(PROMPT, engine="llama.cpp", model=str(gguf), warm=PRIMER, max_new_tokens=NEW,
                             out=tmp_path / "run", model_cache={ModelKey(str(gguf)): hf},
                             zoom_positions=64 if bug.endswith("cut window") else 128)
    finally:
        target.taps.clear()
        target.reset_cache()
    report = result.report.to_json()
    engine, against = report["engine"], report["engine_vs_reference"]
    assert engine["weights"] == "float32" and engine["quantized"] is None and engine["cache_hit_tokens"] > 0
    assert engine["checkpoint"].endswith(".F32.gguf")
    if bug.startswith("not causal"):      # the fill's rows saw its own later tokens; the warm run's, the fill's
        assert {(d["kind"], d.get("explanation"), d.get("computed_otherwise")) for d in report["diagnoses"]} <= \
            {("attention_mismatch", "not causal", None), ("attention_mismatch", None, None),
             ("norm_consistency", None, None), ("cache_content_mismatch", None, True)}
    else:
        assert report["diagnoses"] == []
    kinds = [d["kind"] for d in against["diagnoses"] if d["kind"] != "norm_consistency"]
    op = against["first_operation"]
    if bug == "none":
        assert against["tokens_identical"] and against["first_divergence"] is None and kinds == []
        return
    if bug == "rope base":
        rope = [d for d in against["diagnoses"] if d["kind"] in ("rope_mismatch", "position_mismatch")]
        assert rope and {d["kind"] for d in rope} == {"rope_mismatch"} and all(d["layer"] == 0 for d in rope)
        assert all(abs(d["base"] / 2e4 - 1) < 1e-3 and abs(d["reference_base"] / 1e5 - 1) < 1e-3 for d in rope)
        return
    attention = ("attention_mismatch", "attention (softmax(q k^T) v)", 0)
    expected = {"not causal": attention, "not causal, cut window": attention,
                "v scaled": ("operation_mismatch", "v projection", 1)}[bug]
    first = against["diagnoses"][0]
    assert (first["kind"], first["layer"], first["positions"][0]) == (expected[0], expected[2], 0), against
    if bug == "not causal":
        assert first["explanation"] == "not causal" and first["fit_residual"] < 0.1, first
    if bug.endswith("cut window"):
        assert first["explanation"] is None and first["positions"][1] == 63, first
    assert (op["operation"], op["layer"], op["position"], op["proved"]) == (expected[1], expected[2], 0, True), op


def test_position_shift_of_cached_tokens(target, hf, ids, cold_trace, tmp_path):
    """While the primer runs, a cb_eval tap re-rotates q and k of positions below `cached` at p + 5 in
    every layer (relative positions, hence attention, unchanged; the cache holds keys rotated 5 too far).
    Expected: position_mismatch over the cached positions 0..cached-1 (chunk "cache"), offset +5, and
    no cache_content_mismatch (v is untouched)."""
    cached = ids[2]
    shift = _rerotated(target, 5, lambda pos: pos < cached)
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", during_primer=shift))
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["position_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (0, cached - 1)
    assert found[0].details["offset"] == 5


def test_rows_computed_after_the_hit_encoded_three_positions_on(target, hf, ids, cold_trace, tmp_path):
    """In the warm run, q and k of the positions computed after the cache hit are rotated at p + 3
    (the suffix of a hit encoded from the wrong start). Expected (written before the first run): a
    position_mismatch from the first computed position `cached` on, offset +3; no missing_context and
    no cache_content_mismatch anywhere; the first operation RoPE at layer 0, position `cached`."""
    cached = ids[2]
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5",
                                        during_warm=_rerotated(target, 3, lambda pos: pos >= cached)))
    kinds = {d.kind for d in div.diagnoses}
    assert "missing_context" not in kinds and "cache_content_mismatch" not in kinds, div.diagnoses
    shifted = [d for d in div.diagnoses if d.kind == "position_mismatch"]
    assert shifted and shifted[0].positions[0] == cached and all(d.details["offset"] == 3 for d in shifted)
    op = div.report().to_json()["first_operation"]
    assert (op["operation"], op["layer"], op["position"]) == ("RoPE (on q and k)", 0, cached), op


def test_cached_values_rounded_to_bfloat16(target, hf, ids, cold_trace, tmp_path):
    """While the primer runs, every layer's V rows are rounded to bfloat16 (a cache that stores V in
    bf16). Expected: one cache_content_mismatch over the cached positions 0..cached-1 (chunk "cache"),
    rounding "bfloat16", no source position; no position_mismatch or missing_context over them."""
    from kvdiff.analysis.storage import round_to

    def rounded(name, op, rows, positions):
        return round_to(rows, "bfloat16") if name.startswith("Vcur-") else None

    cached = ids[2]
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", during_primer=rounded))
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (0, cached - 1)
    assert found[0].details["rounding"] == "bfloat16" and set(found[0].details["source_positions"]) == {None}


def test_cached_keys_of_a_changed_k_projection(target, hf, ids, cold_trace, tmp_path):
    """While the primer runs, layer 0's keys are 1.05x theirs (the k projection changed when the
    cached rows were computed; V right). Expected: cache_content_mismatch over the cached positions
    0..cached-1 at layer 0 naming k and the scale 1.05; no position_mismatch or missing_context over them."""
    def scaled(name, op, rows, positions):
        return rows * np.float32(1.05) if name == "Kcur-0" and op == "ROPE" else None

    cached = ids[2]
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", during_primer=scaled))
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    assert found[0].positions == (0, cached - 1) and found[0].details["layer"] == 0
    assert "k" in found[0].details["points"] and abs(found[0].details["k_scale"] - 1.05) < 1e-3, found[0].details


def test_dropped_cached_row(target, hf, ids, cold_trace, tmp_path):
    """After the primer, K and V of cached position 40 are zeroed in every layer of the engine's saved
    sequence state, which is loaded back (a row never written). Expected: cache_content_mismatch at
    exactly 40..40 (chunk "cache"), no source position (zeros match no row), and no other diagnosis
    over the cached positions."""
    def drop(target):
        state = target.read_cache()
        cell = int(np.flatnonzero(state.positions == 40)[0])
        for k, v in zip(state.k, state.v):
            k[cell] = 0
            v[cell] = 0
        target.write_cache(state)
        again = target.read_cache()
        assert not again.k[0][np.flatnonzero(again.positions == 40)[0]].any()

    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", after_primer=drop))
    found = _cached_diagnoses(div, ids[2])
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (40, 40)
    assert found[0].details["source_positions"] == [None]


def test_stale_cached_rows(target, hf, ids, cold_trace, tmp_path):
    """After the primer, the cache cells of positions 48..55 are overwritten with the K/V of
    positions 8..15 in every layer (a stale entry: another position's rows). Expected before the
    run: cache_content_mismatch over 48..55 naming source positions 8..15 where those rows are
    unique in the reference, and a first operation that is a cache read at position 48."""
    def stale(target):
        state = target.read_cache()
        cells = {int(p): i for i, p in enumerate(state.positions)}
        for k, v in zip(state.k, state.v):
            for offset in range(8):
                k[cells[48 + offset]] = k[cells[8 + offset]]
                v[cells[48 + offset]] = v[cells[8 + offset]]
        target.write_cache(state)

    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", after_primer=stale))
    found = [d for d in _cached_diagnoses(div, ids[2]) if d.kind == "cache_content_mismatch"]
    assert found and found[0].positions[0] == 48 and found[0].positions[1] <= 55, div.diagnoses
    sources = found[0].details["source_positions"]
    assert [s for s in sources if s is not None] and all(s in (None, p - 40) for p, s in zip(range(48, 56), sources))
    report = div.report().to_json()
    assert report["first_operation"]["position"] == 48 and report["first_operation"]["tensor"] in ("k", "v")


def test_a_write_landing_on_a_kept_cell_shows_in_the_cached_rows(target, hf, ids, cold_trace, tmp_path):
    """During the warm request's first forward (the suffix after the hit), the row it writes for
    position `cached` lands on the kept cell of position 20 as well, in every layer (a write index into
    the kept prefix). The cached rows are read after that forward, so they show it. Expected (written
    before the first run): a cache_content_mismatch over exactly 20..20 (chunk "cache") whose row is
    the token at `cached` computed there. Written first as `computed_at` == [cached]; the first run
    named it `source_positions` == [cached], the more exact claim (the row is bitwise the cold run's
    row at `cached`: the same token in the same context), so that is what is asserted."""
    cached, ctx = ids[2], target.llm._ctx
    engine_decode, forwards = type(ctx).decode.__get__(ctx), []

    def decode_writing_a_kept_cell(batch):
        engine_decode(batch)
        if forwards:
            return
        forwards.append(batch)
        state = target.read_cache()
        cells = {int(p): i for i, p in enumerate(state.positions)}
        for k, v in zip(state.k, state.v):
            k[cells[20]], v[cells[20]] = k[cells[cached]], v[cells[cached]]
        target.write_cache(state)

    def plant(target):
        target.llm._ctx.decode = target._decode(decode_writing_a_kept_cell)

    try:
        div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", after_primer=plant))
    finally:
        target.llm._ctx.decode = target._decode(engine_decode)
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (20, 20), found[0]
    assert found[0].details["source_positions"] == [cached], found[0].details


def test_a_kept_cell_evicted_as_the_suffix_begins_is_a_key_not_attended(target, hf, ids, cold_trace, tmp_path):
    """As the warm request's suffix is about to be evaluated, the engine removes the kept cell of
    position 40 (`kv_cache_seq_rm`) while `n_tokens` still counts it (red-team l3: kvdiff stopped with
    "kept 65 prompt tokens but its cache holds positions ..."). Its K/V are recorded as the cache held
    them before the forward; the rows after the hit attend every kept key but 40: missing_context
    unattended [40, 40] from the first row after the hit."""
    cached, llm = ids[2], target.llm
    engine_eval, evicted = type(llm).eval.__get__(llm), []

    def evicting_eval(tokens):
        if not evicted and llm.n_tokens > 40:
            evicted.append(int(llm.n_tokens))
            llm._ctx.kv_cache_seq_rm(0, 40, 41)
        return engine_eval(tokens)

    def plant(target):
        evicted.clear()
        target.llm.eval = target._evaluate(evicting_eval)

    try:
        div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", after_primer=plant))
    finally:
        target.llm.eval = target._evaluate(engine_eval)
    assert evicted == [cached]
    found = [d for d in div.diagnoses if d.kind in ("missing_context", "attention_mismatch", "cache_content_mismatch")]
    assert [d.kind for d in found][:1] == ["missing_context"], div.diagnoses
    assert found[0].details["unattended"] == [40, 40] and found[0].positions[0] == cached


# -- errors ----------------------------------------------------------------------------------------


def test_llamacpp_failure_is_a_kvdiff_error_and_the_engine_survives(target, ids):
    bad = ids[0][:10] + [target.llm.n_vocab() + 7]           # llama_decode refuses a token past the vocabulary
    with pytest.raises(KvdiffError, match="llama.cpp failed: ") as info:
        target.generate(bad, 2)
    assert info.value.exit_code == 3 and "refused the batch as invalid" in str(info.value)
    run = target.generate(ids[0], 2)
    assert len(run.token_ids) == 2 and run.cache_hit_tokens == 0
    target.reset_cache()


def test_a_tap_error_stops_the_forward_and_is_raised(target, ids):
    def boom(name, op, rows, positions):
        if name == "ffn_out-3":
            raise RuntimeError("planted failure")

    target.taps.append(boom)
    try:
        with pytest.raises(KvdiffError, match="llama.cpp failed: .*planted failure"):
            target.generate(ids[0], 2)
    finally:
        target.taps.clear()
    assert len(target.generate(ids[0], 2).token_ids) == 2
    target.reset_cache()


def test_not_installed_is_an_input_error_with_the_install_command(monkeypatch, gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(InputError, match=r'llama.cpp is not installed: CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install '
                                         r"llama-cpp-python==0\.3\.36"):
        LlamaCppTarget(gguf)
