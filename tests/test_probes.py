"""Probes on transformers models: coverage, fidelity, integrity, selection, planted changes."""

import numpy as np
import pytest
import torch

import kvdiff
from kvdiff.engine.reference import reference_generate
from kvdiff.probes.hooks import attach_probes
from kvdiff.probes.model_meta import model_dims
from kvdiff.probes.taps import Taps
from kvdiff.trace.points import ALL_POINTS, LAYER_POINTS
from kvdiff.run.record import record
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.probes.selection import Selection
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.probes.spec import LLAMA_SPEC, ProbeRule, ProbeSpec
from kvdiff.trace import TraceWriter, open_trace

from conftest import SEED_MESSAGES

MESSAGES = SEED_MESSAGES


class KeepingRecorder(TraceRecorder):
    """A recorder that also keeps its own copy of every captured row, to compare with the trace."""

    kept: dict

    def capture(self, point, layer, rows, positions):
        if self.wants(point, layer):
            shape = self.dims.point_shape(point)
            self.kept.setdefault((point, layer), []).append(rows.detach().clone().reshape(len(positions), *shape))
        super().capture(point, layer, rows, positions)


def test_every_point_layer_and_position_is_recorded_and_hooks_are_removed(tiny_model, tmp_path):
    model, tokenizer = tiny_model

    def hooks():  # transformers may keep output-capturing hooks of its own from earlier calls
        return {(name, id(h)) for name, m in model.named_modules()
                for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values(), m.__dict__.get("forward"))}

    before = hooks()
    path = record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=5)
    plain = reference_generate(model, tokenizer, MESSAGES, max_new_tokens=5)
    with open_trace(path) as tr:
        n_prompt = len(tr.meta.input_ids)
        assert tr.meta.generated_ids.tolist() == plain.token_ids  # the mask stayed causal
        assert tr.meta.points == ALL_POINTS and tr.meta.layers == tuple(range(model.config.num_hidden_layers))
        # Every position, prompt and generated (the last generated token is never fed back).
        assert tr.positions.tolist() == list(range(n_prompt + len(plain.token_ids) - 1))
        for layer in tr.meta.layers:
            rows = tr.layer(layer)
            assert set(rows) == set(LAYER_POINTS)
            assert all(r.shape[0] == tr.positions.size for r in rows.values())
            # Hooks sit on the right modules: the residual additions hold exactly.
            assert np.array_equal(rows["resid_mid"], rows["resid_pre"] + rows["attn_out"])
            assert np.array_equal(rows["resid_post"], rows["resid_mid"] + rows["mlp_out"])
            stats = tr.norm_stats(layer)
            assert set(stats) == {"attn_norm", "mlp_norm"}
            np.testing.assert_allclose(stats["attn_norm"]["input_rms"],
                                       np.sqrt((rows["resid_pre"].astype(np.float64) ** 2).mean(-1)), rtol=1e-12)
        final = tr.final()
        rows_of_steps = np.searchsorted(tr.positions, tr.steps.position)
        assert np.array_equal(final["logits"][rows_of_steps].argmax(-1), tr.steps.token_id)
        assert tr.steps.token_id.tolist() == plain.token_ids
        assert np.all(tr.steps.topk_ids[:, 0] == tr.steps.token_id) and np.all(tr.steps.margin >= 0)
        assert tr.provenance is None and tr.meta.strategy == "reference"
    assert model.config._attn_implementation == "sdpa"
    assert hooks() == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_captured_rows_read_back_bit_for_bit(tmp_path, dtype):
    model, tokenizer = kvdiff.load_model("tiny-qwen3", dtype=dtype)
    recorder = TraceRecorder.for_model(model, tokenizer, MESSAGES, tmp_path / "t.h5")
    recorder.kept = {}
    with attach_probes(model, recorder) as probes:
        out = reference_generate(model, tokenizer, MESSAGES, max_new_tokens=3, sink=probes)
    recorder.finish(out.token_ids, out.text)
    with open_trace(tmp_path / "t.h5") as tr:
        assert tr.meta.dtype == dtype
        for (point, layer), parts in recorder.kept.items():
            want = torch.cat(parts)
            want = (want.float() if dtype == "bfloat16" else want).numpy()
            got = (tr.final() if layer is None else tr.layer(layer))[point]
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), point
        weight, eps = tr.norm_weight(0, "k_norm")
        assert np.array_equal(weight, model.model.layers[0].self_attn.k_norm.weight.detach().float().numpy()) and eps == 1e-6


def test_a_planted_weight_change_shows_in_its_layer_and_not_before(tmp_path):
    model, tokenizer = kvdiff.load_model("tiny-llama")
    record(model, tokenizer, MESSAGES, tmp_path / "a.h5", max_new_tokens=2)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[3, 5] += 0.5
    record(model, tokenizer, MESSAGES, tmp_path / "b.h5", max_new_tokens=2)
    with open_trace(tmp_path / "a.h5") as a, open_trace(tmp_path / "b.h5") as b:
        assert a.meta.model_fingerprint != b.meta.model_fingerprint
        prompt = len(a.meta.input_ids)
        for point, rows in a.layer(0).items():
            assert np.array_equal(rows[:prompt], b.layer(0)[point][:prompt]), point
        la, lb = a.layer(1), b.layer(1)
        for point in ("resid_pre", "attn_norm", "q", "k_pre_rope", "k"):
            assert np.array_equal(la[point][:prompt], lb[point][:prompt]), point
        assert not np.array_equal(la["v"][:prompt], lb["v"][:prompt])
        assert not np.array_equal(la["attn_out"][:prompt], lb["attn_out"][:prompt])


def test_selection_keeps_only_chosen_points_layers_and_positions(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    path = record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=3,
                  capture="v,k,logits", layers="0,2", positions="0-3,30")
    with open_trace(path) as tr:
        assert tr.meta.points == ("k", "v", "logits") and tr.meta.layers == (0, 2)
        assert tr.positions.tolist() == [0, 1, 2, 3, 30]
        assert set(tr.layer(2)) == {"k", "v"} and set(tr.final()) == {"logits"}
        assert tr.norm_stats(0) == {}
        with pytest.raises(kvdiff.errors.TraceError, match="no 'layers/1'"):
            tr.layer(1)


@pytest.mark.parametrize("mode", ["full", "digest"])
def test_positions_that_hold_no_row_of_the_run_are_refused_and_leave_no_trace(tiny_llama, tmp_path, mode):
    """Positions past the run wrote a trace the reader then refused ("/layers/0 is missing");
    a negative one was taken as given."""
    model, tokenizer = tiny_llama
    window = {"layers": "0"} if mode == "digest" else {}
    path = tmp_path / "t.h5"
    with pytest.raises(kvdiff.InputError, match=r"positions 500-600 hold no row of this run, whose positions "
                                                r"are 0-\d+: choose positions within them"):
        record(model, tokenizer, MESSAGES, path, max_new_tokens=2, positions="500-600", trace_mode=mode, **window)
    assert not path.exists()
    with pytest.raises(kvdiff.InputError, match="bad position -3: positions count from 0"):
        record(model, tokenizer, MESSAGES, path, max_new_tokens=2, positions=[4, -3], trace_mode=mode, **window)
    assert not path.exists()


def _assert_sized_to_its_rows(path) -> None:
    import h5py

    with h5py.File(path) as f:
        digests = "digests" in f           # a digest trace: its digests are its rows
        rows = f["digests/positions" if digests else "positions"].shape[0]
        sized = []
        for group in ("digests",) if digests else ("layers", "final"):
            def check(name, obj):
                if isinstance(obj, h5py.Dataset) and obj.shape[:1] == (rows,):
                    assert obj.id.get_storage_size() <= obj.nbytes * (rows + 1) // rows, (path, name)
                    sized.append(name)
            f[group].visititems(check)
    assert rows < 128 and sized


def test_a_short_trace_file_holds_no_room_for_rows_that_never_come(tiny_llama, tmp_path):
    """HDF5 chunks of at least 128 rows made a 44-token trace of the default model 93 MB for its
    31 MB of rows; `record` and `compare` now size them to the prompt plus the new tokens."""
    model, tokenizer = tiny_llama
    _assert_sized_to_its_rows(record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=3))
    for mode in ("full", "digest"):
        run = kvdiff.compare(MESSAGES, model="tiny-llama", max_new_tokens=3, out=tmp_path / mode, trace_mode=mode)
        _assert_sized_to_its_rows(run.reference_trace)
        _assert_sized_to_its_rows(run.candidate_trace)


def test_selection_strings_are_parsed_and_checked():
    sel = Selection.parse(30, capture="q, k", layers="0-3,29", positions="5")
    assert sel.points == ("q", "k") and sel.layers == (0, 1, 2, 3, 29) and sel.positions == {5}
    with pytest.raises(kvdiff.InputError, match="unknown probe point"):
        Selection.parse(30, capture="kv")
    with pytest.raises(kvdiff.InputError, match="out of range"):
        Selection.parse(30, layers="28-30")
    with pytest.raises(kvdiff.InputError, match="0-99999999999 out of range: the model has layers 0-29"):
        Selection.parse(30, layers="0-99999999999")      # refused before the range is expanded


def test_a_declared_probe_that_never_fires_is_an_error_and_leaves_no_trace(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    spec = ProbeSpec(tuple(r for r in LLAMA_SPEC.rules if r.point != "mlp_out"))
    with pytest.raises(ProbeIntegrityError, match="probe 'mlp_out' did not fire at layer 0"):
        record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2, spec=spec)
    assert list(tmp_path.iterdir()) == []
    assert not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == "sdpa"


def test_a_probe_firing_twice_or_matching_nothing_is_an_error(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    twice = ProbeSpec(LLAMA_SPEC.rules + (ProbeRule("model.layers.*.mlp.down_proj", "mlp_out"),))
    with pytest.raises(ProbeIntegrityError, match="'mlp_out' fired 2 times at layer 0"):
        record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2, spec=twice)
    nothing = ProbeSpec(LLAMA_SPEC.rules + (ProbeRule("model.blocks.*.ffn", "mlp_out"),))
    with pytest.raises(ProbeIntegrityError, match="'model.blocks.\\*.ffn' \\(mlp_out\\) match no module"):
        record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2, spec=nothing)


@pytest.mark.parametrize("mode", ["full", "digest"])
def test_a_forward_over_no_positions_is_refused_in_either_mode(tiny_llama, tmp_path, mode):
    """An adapter that brackets a forward holding no rows of its request breaks the sink's contract:
    one error naming it, where the digest recorder failed inside torch (`reshape(0, -1)`)."""
    model, tokenizer = tiny_llama
    recorder = TraceRecorder.for_model(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=1, trace_mode=mode)
    with pytest.raises(ProbeIntegrityError, match="begin_forward over no positions"):
        recorder.begin_forward([])
    recorder.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_buffer_overwritten_after_capture_does_not_change_the_trace(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    dims = model_dims(model)
    writer = TraceWriter(tmp_path / "t.h5", TraceRecorder.for_model(
        model, tokenizer, MESSAGES, tmp_path / "meta.h5", capture="resid_pre", layers="0").writer.meta)
    recorder = TraceRecorder(writer, dims, Selection.parse(dims.num_layers, "resid_pre", "0"))
    buffer = torch.arange(4 * dims.hidden_size, dtype=torch.float32).reshape(4, -1)
    original = buffer.clone()
    recorder.begin_forward(range(4))
    recorder.capture("resid_pre", 0, buffer, range(4))
    buffer.fill_(-1.0)
    recorder.end_forward()
    recorder.finish([], "x")      # nothing generated: no steps
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], original.numpy())



def _resid_recorder(tiny_llama, path, capture="resid_pre,resid_post"):
    """A recorder of `capture` at layer 0 of tiny-llama (all positions), driven by hand."""
    model, tokenizer = tiny_llama
    dims = model_dims(model)
    meta = TraceRecorder.for_model(model, tokenizer, MESSAGES, path.with_name("meta.h5"), capture=capture,
                                   layers="0").writer.meta
    return TraceRecorder(TraceWriter(path, meta), dims, Selection.parse(dims.num_layers, capture, "0"))


def _step(recorder, position, captures):
    """One forward over `position`: captures are (point, layer, rows), the caller's positions one object."""
    positions = [position]
    recorder.begin_forward(positions)
    for point, layer, rows in captures:
        recorder.capture(point, layer, rows, positions)
    recorder.end_forward()


def test_decode_steps_repeating_a_layout_go_to_the_writer_together_bit_for_bit(tiny_llama, tmp_path, monkeypatch):
    model, tokenizer = tiny_llama
    repeats = []
    commit_repeat = TraceWriter.commit_repeat
    monkeypatch.setattr(TraceWriter, "commit_repeat", lambda self, *a: (repeats.append(a[3]), commit_repeat(self, *a)))
    recorder = KeepingRecorder.for_model(model, tokenizer, MESSAGES, tmp_path / "t.h5")
    recorder.kept = {}
    with attach_probes(model, recorder) as probes:
        out = reference_generate(model, tokenizer, MESSAGES, max_new_tokens=6, sink=probes)
    recorder.finish(out.token_ids, out.text)
    n_prompt = len(out.input_ids)
    # The prompt's forward and the first decode step go capture by capture; the next four repeat the latter.
    assert [int(p[0]) for p in repeats] == list(range(n_prompt + 1, n_prompt + 5))
    with open_trace(tmp_path / "t.h5") as tr:
        for (point, layer), parts in recorder.kept.items():
            got = (tr.final() if layer is None else tr.layer(layer))[point]
            assert np.array_equal(got, torch.cat(parts).numpy()), point
        np.testing.assert_allclose(tr.norm_stats(1)["mlp_norm"]["input_rms"],
                                   np.sqrt((tr.layer(1)["resid_mid"].astype(np.float64) ** 2).mean(-1)), rtol=1e-12)


def test_a_decode_step_breaking_the_layout_is_checked_capture_by_capture(tiny_llama, tmp_path):
    hidden = tiny_llama[0].config.hidden_size
    rows = [torch.full((1, hidden), float(p)) for p in range(8)]
    recorder = _resid_recorder(tiny_llama, tmp_path / "t.h5")
    with torch.no_grad():
        recorder.begin_forward(range(4))
        for point in ("resid_pre", "resid_post"):
            recorder.capture(point, 0, torch.cat(rows[:4]), range(4))
        recorder.end_forward()
        _step(recorder, 4, [("resid_pre", 0, rows[4]), ("resid_post", 0, -rows[4])])
        _step(recorder, 5, [("resid_post", 0, -rows[5]), ("resid_pre", 0, rows[5])])      # another order
        _step(recorder, 6, [("resid_pre", 0, rows[6]), ("resid_pre", 1, rows[0]), ("resid_post", 0, -rows[6])])
        with pytest.raises(ProbeIntegrityError, match="probe 'resid_post' did not fire at layer 0 in the forward "
                                                      "over positions 7"):
            _step(recorder, 7, [("resid_pre", 0, rows[7])])
    assert not (tmp_path / "t.h5").exists()
    recorder = _resid_recorder(tiny_llama, tmp_path / "u.h5")
    with torch.no_grad():
        for p in range(7):
            _step(recorder, p, [("resid_pre", 0, rows[p]), ("resid_post", 0, -rows[p])] if p != 5 else
                  [("resid_post", 0, -rows[p]), ("resid_pre", 0, rows[p])])
    recorder.finish([], "x")      # nothing generated: no steps
    with open_trace(tmp_path / "u.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"][:, 0], np.arange(7.0))
        assert np.array_equal(tr.layer(0)["resid_post"][:, 0], -np.arange(7.0))


def test_a_layout_found_complete_in_one_trace_does_not_excuse_a_later_trace_missing_a_capture(tiny_llama, tmp_path):
    hidden = tiny_llama[0].config.hidden_size
    rows = torch.ones(1, hidden)
    with torch.no_grad():
        first = _resid_recorder(tiny_llama, tmp_path / "t.h5")
        _step(first, 0, [("resid_pre", 0, rows), ("resid_post", 0, rows)])
        first.finish([], "x")
        again = _resid_recorder(tiny_llama, tmp_path / "u.h5")      # the same selection: the layout is known
        _step(again, 0, [("resid_pre", 0, rows), ("resid_post", 0, rows)])
        again.finish([], "x")
        short = _resid_recorder(tiny_llama, tmp_path / "v.h5")
        with pytest.raises(ProbeIntegrityError, match="probe 'resid_post' did not fire at layer 0"):
            _step(short, 0, [("resid_pre", 0, rows)])
    assert not (tmp_path / "v.h5").exists()


def test_model_dims_follow_a_module_replaced_or_rescaled_between_traces():
    import copy

    from kvdiff.engine.tiny import build_tiny_model

    model, _ = build_tiny_model("tiny-llama", num_layers=2)
    attention = model.model.layers[0].self_attn
    assert model_dims(model).attn_scale == attention.scaling
    attention.scaling = 0.5                               # an attribute changed in place
    assert model_dims(model).attn_scale == 0.5
    replaced = copy.deepcopy(attention)
    replaced.scaling = 0.25
    model.model.layers[0].self_attn = replaced            # a module replaced
    assert model_dims(model).attn_scale == 0.25
    del replaced.scaling, replaced.layer_idx                # no longer an attention module: the next one is
    model.model.layers[0].self_attn = copy.deepcopy(replaced)
    assert model_dims(model).attn_scale == model.model.layers[1].self_attn.scaling


@pytest.mark.parametrize("layout", ["repeated", "broken"])
def test_rows_changed_in_place_during_a_logged_decode_step_drop_the_trace(tiny_llama, tmp_path, layout):
    hidden = tiny_llama[0].config.hidden_size
    recorder = _resid_recorder(tiny_llama, tmp_path / "t.h5")
    with torch.no_grad():
        for p in range(2):
            _step(recorder, p, [("resid_pre", 0, torch.zeros(1, hidden)), ("resid_post", 0, torch.zeros(1, hidden))])
        rows, positions = torch.ones(1, hidden), [2]
        recorder.begin_forward(positions)
        recorder.capture("resid_pre", 0, rows, positions)
        if layout == "repeated":
            recorder.capture("resid_post", 0, torch.ones(1, hidden), positions)
        rows.add_(1)                         # before the forward ends: the logged reference is stale
        with pytest.raises(ProbeIntegrityError, match="changed the captured rows .*resid_pre.* in place"):
            recorder.end_forward()
    assert not (tmp_path / "t.h5").exists() and not recorder.writer.tmp_path.exists()


def test_inference_tensors_in_a_logged_decode_step_are_copied(tiny_llama, tmp_path):
    hidden = tiny_llama[0].config.hidden_size
    recorder = _resid_recorder(tiny_llama, tmp_path / "t.h5", capture="resid_pre")
    with torch.inference_mode():
        made = [torch.full((1, hidden), float(p)) for p in range(4)]     # no version counter
    with torch.no_grad():
        for p in range(4):
            _step(recorder, p, [("resid_pre", 0, made[p])])
    with torch.inference_mode():
        for rows in made:
            rows.add_(100)               # after their forwards, before the writer reads the kept steps
    recorder.finish([], "x")      # nothing generated: no steps
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"][:, 0], np.arange(4.0))


def test_step_top_k_is_taken_a_batch_of_steps_at_a_time_from_copies_of_the_rows(tiny_llama, tmp_path):
    """Steps' logits rows are held (copied: an engine may rewrite its buffer the next step) and
    their top-k taken STEPS_HELD at a time; every step's top-k and margin reach the trace."""
    from kvdiff.probes.recorder import STEPS_HELD
    recorder = _resid_recorder(tiny_llama, tmp_path / "t.h5")
    n_prompt, steps = len(recorder.writer.meta.input_ids), 2 * STEPS_HELD + 22
    hidden = tiny_llama[0].config.hidden_size
    recorder.begin_forward(list(range(n_prompt)))      # the prompt's rows, which a trace must hold
    for point in ("resid_pre", "resid_post"):
        recorder.capture(point, 0, torch.randn(n_prompt, hidden), list(range(n_prompt)))
    recorder.end_forward()
    vocab = tiny_llama[0].config.vocab_size
    rows = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(4))
    buffer = torch.empty(vocab)
    for i in range(steps):
        buffer.copy_(rows[i])                       # one buffer, rewritten every step
        recorder.capture_step(i, n_prompt - 1 + i, buffer, int(rows[i].argmax()))
    recorder.finish(rows.argmax(1).tolist(), "")
    top = rows.topk(recorder.top_k, dim=1)
    with open_trace(tmp_path / "t.h5") as tr:
        got = tr.steps
    assert got.step.tolist() == list(range(steps)) and got.token_id.tolist() == rows.argmax(1).tolist()
    assert np.array_equal(got.topk_ids, top.indices.numpy()) and np.array_equal(got.topk_values, top.values.numpy())
    np.testing.assert_array_equal(got.margin, (top.values[:, 0].double() - top.values[:, 1].double()).numpy())


def test_probes_delegate_to_an_attention_wrapper_installed_before_them(tiny_llama, tmp_path):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    model, tokenizer = tiny_llama
    calls = []

    def outer(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("test_outer", outer)
    AttentionMaskInterface.register("test_outer", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation("test_outer")
    try:
        path = record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=3)
        assert model.config._attn_implementation == "test_outer"
    finally:
        model.set_attn_implementation("sdpa")
    plain = reference_generate(model, tokenizer, MESSAGES, max_new_tokens=3)
    with open_trace(path) as tr:
        assert len(calls) == 3 * model.config.num_hidden_layers
        assert tr.meta.generated_ids.tolist() == plain.token_ids


@pytest.mark.real_model
def test_default_model_trace_holds_every_point_for_all_30_layers_and_positions(default_model, tmp_path):
    model, tokenizer = default_model
    path = record(model, tokenizer, MESSAGES, tmp_path / "ref.h5", max_new_tokens=4)
    with open_trace(path) as tr:
        assert tr.meta.dims.num_layers == 30 and tr.meta.layers == tuple(range(30))
        assert (tr.meta.dims.num_heads, tr.meta.dims.num_kv_heads, tr.meta.dims.head_dim) == (9, 3, 64)
        assert tr.positions.tolist() == list(range(len(tr.meta.input_ids) + len(tr.meta.generated_ids) - 1))
        assert len(tr.meta.input_ids) == 32
        for layer in range(30):
            rows = tr.layer(layer)
            assert set(rows) == set(LAYER_POINTS)
            assert all(r.shape[0] == tr.positions.size and np.isfinite(r).all() for r in rows.values())
        assert set(tr.final()) == {"final_norm", "logits"}
        assert set(tr.norm_stats(None)) == {"final_norm"}


def test_kvdiff_record_and_inspect_print_what_the_trace_holds(tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from kvdiff.cli import app

    model, tokenizer = tiny_llama
    path = kvdiff.record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2, compression="gzip")
    result = CliRunner().invoke(app, ["inspect", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in ("tiny-llama", "strategy reference", "3 layers", "resid_pre", "logits", "0-2", "float32"):
        assert text in result.output
    (tmp_path / "bad.h5").write_text("x")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "bad.h5")])
    assert result.exit_code == 2 and "not an HDF5 file" in result.output


def test_taps_run_around_a_forward_after_the_modules_own_hooks_and_come_off():
    seen = []
    bare, hooked = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    hooked.register_forward_hook(lambda m, args, out: out * 0)      # ours see what it returns
    taps = Taps()
    for module in (bare, hooked):
        taps.add(module, [lambda m, args, kwargs: seen.append(("before", m))],
                 [lambda m, args, kwargs, out: seen.append(("after", m, out.abs().sum().item()))])
    assert "forward" in bare.__dict__ and "forward" not in hooked.__dict__     # wrapped; torch's hooks
    x = torch.ones(1, 2)
    bare(x), hooked(x)
    assert [s[:2] for s in seen] == [("before", bare), ("after", bare), ("before", hooked), ("after", hooked)]
    assert seen[1][2] > 0 and seen[3][2] == 0
    taps.remove()
    seen.clear()
    bare(x), hooked(x)
    assert seen == [] and "forward" not in bare.__dict__ and len(hooked._forward_hooks) == 1
    taps.add(bare, [lambda m, args, kwargs: seen.append("tap")], [])
    inner = bare.forward
    bare.forward = lambda *args: inner(*args) * 2          # wrapped again after the tap, as accelerate would
    taps.remove()
    assert torch.equal(bare(x), 2 * torch.nn.functional.linear(x, bare.weight, bare.bias)) and seen == []  # inert


def test_a_forward_past_the_request_is_refused_as_the_engines_count(tiny_llama, tmp_path):
    """An engine whose own count of the tokens it holds was off (red-team l3: llama.cpp's whole-prompt
    shortcut) wrote rows past the sequence, and the reader then blamed the trace's writer."""
    model, tokenizer = tiny_llama
    recorder = TraceRecorder.for_model(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2)
    prompt = recorder.max_positions - 2
    with pytest.raises(ProbeIntegrityError, match=rf"positions {prompt + 2}-{prompt + 2}, outside the request's "
                                                  rf"0-{prompt + 1} .*: the engine's count of the tokens it holds is off"):
        recorder.begin_forward([prompt + 2])
    recorder.abort()
    assert not (tmp_path / "t.h5").exists()


def test_rows_of_another_count_or_a_logits_row_of_another_size_name_the_engine_not_the_model(tiny_llama, tmp_path):
    """Red-team round 6, t51d and t51e: an adapter handed one row more than its forward's positions
    (the error blamed the checkpoint), and a step's logits row one value short (accepted silently);
    rows of another shape still name the model's shapes."""
    model, tokenizer = tiny_llama
    recorder = TraceRecorder.for_model(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2)
    hidden, dims = model.config.hidden_size, model_dims(model)
    recorder.begin_forward([0, 1, 2])
    with pytest.raises(ProbeIntegrityError, match="4 rows captured for the forward's 3 positions: the engine"):
        recorder.capture("resid_pre", 0, torch.zeros(4, hidden), [0, 1, 2])
    with pytest.raises(ProbeIntegrityError, match=r"rows of shape \(3, 4, 16\) do not hold 3 positions .* KV heads"):
        recorder.capture("k", 0, torch.zeros(3, 2 * dims.num_kv_heads, dims.head_dim), [0, 1, 2])
    with pytest.raises(ProbeIntegrityError, match=f"a logits row of {dims.vocab_size - 1} values, not the model's"):
        recorder.capture_step(0, 2, torch.zeros(dims.vocab_size - 1), 5)
    recorder.abort()
