"""Digest capture: row hashes and statistics, digest traces, the zoom run, and digest vs full diffs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvdiff
from kvdiff.analysis import diff
from kvdiff.analysis.align import align
from kvdiff.analysis.digests import first_digest_mismatch
from kvdiff.cli import app
from kvdiff.errors import InputError
from kvdiff.trace.format import digest_tables
from kvdiff.run.compare import compare
from kvdiff.run.zoom import repeat_findings
from kvdiff.trace import open_trace
from kvdiff.trace.digest import DigestBatch, gathered_row_digests, row_digests
from tests.conftest import SEED_MESSAGES as SEEDS, SEED_PROMPT, SEED_SYSTEM

STRATEGIES = ("none", "prefix", "isolated-local", "isolated-global", "rerotate", "blend")


def test_a_hash_tells_one_flipped_bit_and_does_not_depend_on_the_batch(monkeypatch):
    rows = torch.randn(7, 3, 16)
    hashes, stats = row_digests(rows)
    flipped = rows.clone()
    flipped.view(torch.int32)[4, 1, 5] ^= 1                  # the last bit of one element
    assert (row_digests(flipped)[0] != hashes).tolist() == [False] * 4 + [True] + [False] * 2
    assert torch.equal(row_digests(rows[2:3])[0], hashes[2:3])          # alone or in a batch
    flat = rows.reshape(7, -1).double()
    assert torch.allclose(stats[:, 0].double(), flat.pow(2).mean(1).sqrt(), rtol=1e-6)
    assert torch.equal(stats[:, 1].double(), flat.abs().amax(1))        # max_abs stored exactly
    batch = DigestBatch()
    batch.add(rows[:2]), batch.add(torch.randn(3, 5)), batch.add(rows[2:])
    together = batch.digests()
    assert torch.equal(torch.cat([together[0][0], together[2][0]]), hashes)
    monkeypatch.setattr("kvdiff.trace.digest.HOST_BLOCK_ELEMENTS", 100)  # hashed a few rows at a time: the same
    blocked = row_digests(rows)
    assert torch.equal(blocked[0], hashes) and torch.equal(blocked[1], stats)
    bf16 = rows.to(torch.bfloat16)
    assert row_digests(bf16)[0].shape == (7,) and not torch.equal(row_digests(bf16)[0], hashes)
    assert torch.equal(row_digests(bf16)[0], row_digests(bf16.float())[0])    # by value: an engine's float32 logits
    empty = torch.empty(0, 3, 16)                   # no rows: empty digests, not a reshape error
    assert [t.shape for t in row_digests(empty)] == [(0,), (0, 2)]
    batch = DigestBatch()
    assert batch.stage(empty) is None                # nothing to stage: the caller hashes it alone
    batch.add(empty)
    assert [t.shape for t in batch.digests()[0]] == [(0,), (0, 2)]


def test_staged_captures_hash_as_they_were_copied_a_stage_at_a_time(monkeypatch):
    """Large captures copied into a stage of their row width: each capture's digests are its own
    rows' (at the time it was staged), whichever stage fill hashed it, beside captures kept by
    reference; one too large for a stage is refused (the caller hashes it alone)."""
    monkeypatch.setattr("kvdiff.trace.digest.STAGE_BYTES", 10 * 16 * 4)     # ten float32 rows of 16
    monkeypatch.setattr("kvdiff.trace.digest.STAGE_CAPTURES", 2)            # a stage sized by its first capture
    gen = torch.Generator().manual_seed(1)
    captures = [torch.randn(n, 4, 4, generator=gen) for n in (3, 4, 2, 6, 1, 9)] + [torch.randn(2, 5, generator=gen)]
    batch = DigestBatch()
    kept = batch.add(torch.randn(2, 16, generator=gen))
    indices = [batch.stage(c) for c in captures]
    expected = [row_digests(c) for c in captures]
    captures[0].add_(1)                                      # after it was staged: its copy is hashed
    assert batch.stage(torch.randn(11, 16)) is None and len(batch) == len(captures) + 1
    digests = batch.digests()
    for i, (hashes, stats) in zip(indices, expected):
        assert torch.equal(digests[i][0], hashes) and torch.equal(digests[i][1], stats)
    assert digests[kept][0].shape == (2,) and len(batch) == 0 and batch.digests() == []


def _splitmix64(j: int) -> int:
    mask = (1 << 64) - 1
    x = (j * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@pytest.mark.parametrize("width", [4, 7])
def test_a_row_hash_is_the_documented_sum_of_its_little_endian_words(width):
    """The hash written in docs/trace-format.md, in plain integers: a trace's digests mean that."""
    rows = torch.randn(3, width)
    raw = rows.numpy().tobytes()
    expected = []
    for r in range(3):
        row = raw[r * width * 4:(r + 1) * width * 4]
        row += bytes(-len(row) % 8)                     # zero-padded to whole 8-byte words
        words = [int.from_bytes(row[k:k + 8], "little") for k in range(0, len(row), 8)]
        total = sum(w * (_splitmix64(k + 1) | 1) for k, w in enumerate(words)) % (1 << 64)
        expected.append(total - (1 << 64) if total >= 1 << 63 else total)
    assert row_digests(rows)[0].tolist() == expected
    wide = torch.randn(3, width + 1)
    assert torch.equal(row_digests(wide[:, 1:])[0], row_digests(wide[:, 1:].contiguous())[0])   # not word-aligned


def test_a_digest_trace_hashed_another_way_is_refused(tiny_llama, tmp_path):
    import h5py
    path = kvdiff.record(*tiny_llama, SEEDS, tmp_path / "t.h5", max_new_tokens=1, trace_mode="digest")
    with h5py.File(path, "a") as f:
        f["digests"].attrs["row_hash"] = "elements-widened"
    with pytest.raises(kvdiff.errors.TraceError, match="hashed by 'elements-widened'.*record it again"):
        open_trace(path)


def test_a_digest_trace_holds_a_table_for_every_layer_and_refuses_an_earlier_layout(tiny_llama, tmp_path):
    """Digests of every layer in one dataset a table, (positions, layers, points), each cell the
    digest of that layer's row; norm weights of the window's layers; a trace laid out a dataset
    per layer is refused."""
    import h5py
    model, tok = tiny_llama
    path = kvdiff.record(model, tok, SEEDS, tmp_path / "t.h5", max_new_tokens=2, trace_mode="digest",
                         layers="1", positions="3-4")
    with open_trace(path) as trace:
        layers, points = trace.meta.digest_layers, digest_tables(trace.meta.digest_points, 0)[""]
        resid = trace.point(1, "resid_post")
        assert np.array_equal(trace.digests(1, "resid_post")[0][[3, 4]], row_digests(torch.from_numpy(resid))[0].numpy())
    with h5py.File(path, "a") as f:
        assert f["digests/layers/hash"].shape == (len(trace.digest_positions), len(layers), len(points))
        assert f["digests/layers/kv_hash"].shape[1:] == (len(layers), 2)
        assert list(f["norms"]) == ["1"]        # norm weights of the window's layers alone
        del f["digests"].attrs["layout"]
    with pytest.raises(kvdiff.errors.TraceError, match="a dataset per layer.*record it again"):
        open_trace(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (see docs/gpu.md)")
def test_a_row_hashes_the_same_on_a_gpu_as_on_the_host():      # and whatever it widened 16-bit rows with
    wide = torch.randn(9, 3001)
    wide[4, 7], wide[5, 9] = float("nan"), float("-inf")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(3, 20001)          # few wide rows: each split among programs
        logits[1, 15000] = float("nan")
        for rows in (torch.randn(33, 4, 64).to(dtype), torch.randn(5, 7).to(dtype), wide.to(dtype)[:, 1:],
                     torch.randn(6, 40).to(dtype).t(),        # odd widths, unaligned and strided views
                     logits.to(dtype), logits.to(dtype)[:, 1:]):
            host, on_gpu = row_digests(rows), row_digests(rows.cuda())
            assert torch.equal(host[0], on_gpu[0].cpu()), (dtype, rows.shape)
            assert torch.allclose(host[1], on_gpu[1].cpu(), rtol=2 ** -22, equal_nan=True), (dtype, rows.shape)
            assert torch.equal(host[1][:, 1].isnan(), on_gpu[1][:, 1].cpu().isnan())
            assert torch.equal(host[1][:, 1].nan_to_num(), on_gpu[1][:, 1].cpu().nan_to_num()), dtype   # exact
        caches = [torch.randn(40, 3, 64, device="cuda").to(dtype) for _ in range(4)]     # a KV cache's layers
        slots = torch.tensor([5, 0, 39], device="cuda")
        hashes, stats = gathered_row_digests(caches, slots)
        for j, cache in enumerate(caches):          # read where the cache holds them: the rows' own digests
            assert torch.equal(hashes[:, j], row_digests(cache.index_select(0, slots))[0])
            assert torch.equal(stats[:, j], row_digests(cache.index_select(0, slots))[1])


def _record(model, tokenizer, path, **kwargs):
    return kvdiff.record(model, tokenizer, SEEDS, path, max_new_tokens=5, numerics="exact", **kwargs)


def test_a_digest_trace_holds_every_row_digested_and_its_window_in_full(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    first = _record(model, tokenizer, tmp_path / "first.h5", trace_mode="digest")
    zoom = _record(model, tokenizer, tmp_path / "zoom.h5", trace_mode="digest", layers="1", positions="2-9")
    full = _record(model, tokenizer, tmp_path / "full.h5")
    with open_trace(first) as a, open_trace(zoom) as b, open_trace(full) as f:
        assert a.meta.trace_mode == "digest" and a.positions.size == 0 and a.meta.points == ()
        assert np.array_equal(a.digest_positions, f.positions)
        assert b.meta.layers == (1,) and b.positions.tolist() == list(range(2, 10))
        assert first_digest_mismatch(a, b) is None                   # the same run, digested twice
        for layer in (*f.meta.layers, None):     # every row, the repeated decode steps' (digested together) too
            for point in f.points_in(layer):
                hashes, stats = b.digests(layer, point)
                rows = torch.from_numpy(f.point(layer, point))
                assert np.array_equal(row_digests(rows)[0].numpy(), hashes), (layer, point)
                assert np.array_equal(row_digests(rows)[1][:, 1].numpy(), stats[:, 1]), (layer, point)
        assert np.array_equal(b.point(1, "k"), f.point(1, "k", slice(2, 10)))
        assert f.meta.trace_mode == "full" and f.digest_positions.size == 0
        assert a.nbytes * 2 < f.nbytes
    with pytest.raises(InputError, match="same trace mode"):
        diff(first, full)


def _digest_datasets(path) -> dict[str, np.ndarray]:
    import h5py

    found = {}
    with h5py.File(path) as f:
        f["digests"].visititems(lambda name, obj: found.update({name: obj[()]}) if isinstance(obj, h5py.Dataset)
                                else None)
    return found


def _digest_forwards(monkeypatch) -> list:
    """The engine's forwards whose captures were digested together (digest_probes.py): their rows each."""
    from kvdiff.engine import runner
    rows = []

    class Counted(runner.DigestProbes):
        def end(self) -> None:
            rows.append(self.rows)
            super().end()

    monkeypatch.setattr(runner, "DigestProbes", Counted)
    return rows


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_digest_trace_of_captures_hashed_together_equals_one_hashed_a_capture_at_a_time(tiny_llama, tmp_path,
                                                                                        monkeypatch, device):
    """A prompt forward's captures hashed together give the trace every bit of the digests each
    capture hashed alone gives: the engine's (kept by reference, stacked and hashed whenever
    they hold HELD_BYTES and at the forward's end), and the reference path's (large ones copied
    into stages)."""
    from kvdiff.engine import Engine, runner
    from kvdiff.probes.recorder import TraceRecorder

    model, tokenizer = tiny_llama
    model = model.to(device)
    monkeypatch.setattr("kvdiff.probes.digests.HASH_AT_ONCE_ELEMENTS", 64)     # the tiny model's prompt rows
    monkeypatch.setattr("kvdiff.trace.digest.STAGE_BYTES", 40 * 64 * 4)        # a few captures a stage
    monkeypatch.setattr("kvdiff.engine.digest_probes.HELD_BYTES", 40 * 64 * 4)
    together = _digest_forwards(monkeypatch)
    selection = runner.forward_selection
    try:
        digests = []
        for staged in (("cpu", "cuda"), ()):
            engine = Engine(model, tokenizer, strategy="prefix")        # a cold run each
            monkeypatch.setattr("kvdiff.probes.digests.STAGED_DEVICES", staged)
            monkeypatch.setattr(runner, "forward_selection", selection if staged else lambda views: None)
            recorder = TraceRecorder.for_model(model, tokenizer, SEEDS, tmp_path / f"e{len(staged)}.h5",
                                               strategy="prefix", max_new_tokens=3, trace_mode="digest")
            (out,) = engine.generate([SEEDS], max_new_tokens=3, sinks={0: recorder})
            recorder.finish(out.token_ids, out.text, out.chunks)
            kvdiff.record(model, tokenizer, SEEDS, tmp_path / f"r{len(staged)}.h5", max_new_tokens=3,
                          trace_mode="digest")
            digests.append({name: _digest_datasets(tmp_path / f"{name}{len(staged)}.h5") for name in ("e", "r")})
    finally:
        model.to("cpu")
    assert together == [len(kvdiff.conversation.render_prompt_ids(tokenizer, SEEDS))]     # the prompt's forward
    for name in ("e", "r"):
        staged, alone = digests[0][name], digests[1][name]
        assert staged.keys() == alone.keys() and staged
        for key in staged:
            assert np.array_equal(staged[key], alone[key], equal_nan=True), (name, key)


def test_requests_sharing_a_forward_each_get_their_rows_digests(tiny_llama, tmp_path, monkeypatch):
    """Two recorded requests prefilled in one forward and decoded together: each trace holds the
    digests its request recorded alone, bit for bit (exact numerics: a row's bits do not depend
    on the batch)."""
    from kvdiff.engine import Engine
    from kvdiff.probes.recorder import TraceRecorder

    model, tokenizer = tiny_llama
    other = [{"role": "user", "content": "Name three rivers of Europe."}]
    together = _digest_forwards(monkeypatch)

    def traces(conversations: list, tag: str) -> list[dict]:
        engine = Engine(model, tokenizer, strategy="none", numerics="exact")
        recorders = {i: TraceRecorder.for_model(model, tokenizer, c, tmp_path / f"{tag}{i}.h5", strategy="none",
                                                numerics="exact", max_new_tokens=3, trace_mode="digest")
                     for i, c in enumerate(conversations)}
        outs = engine.generate(conversations, max_new_tokens=3, sinks=recorders)
        for i, out in enumerate(outs):
            recorders[i].finish(out.token_ids, out.text, out.chunks)
        return [_digest_datasets(tmp_path / f"{tag}{i}.h5") for i in recorders]

    both = traces([SEEDS, other], "both")
    n = [len(kvdiff.conversation.render_prompt_ids(tokenizer, c)) for c in (SEEDS, other)]
    assert together == [sum(n)]       # one prompt forward for both (a decode step's rows are logged by each sink)
    alone = traces([SEEDS], "seeds") + traces([other], "other")
    for got, want in zip(both, alone):
        assert got.keys() == want.keys() and got
        for key in got:
            assert np.array_equal(got[key], want[key], equal_nan=True), key


def test_a_probed_prompts_logits_row_does_not_keep_every_rows_logits(tiny_llama, tmp_path, monkeypatch):
    """The probes ask for every prompt row's logits (a 32k-token prompt's are 17 GB on the 1B
    shape): the row a request samples from is its own copy, not a view that keeps them all."""
    from kvdiff.engine import Engine, runner
    from kvdiff.probes.recorder import TraceRecorder

    model, tokenizer = tiny_llama
    final, returned = runner.ModelRunner._final, []

    def kept(self, x, groups, spans, probes):
        out = final(self, x, groups, spans, probes)
        returned.extend((x.shape[0], row) for row in out if row is not None)
        return out

    monkeypatch.setattr(runner.ModelRunner, "_final", kept)
    recorder = TraceRecorder.for_model(model, tokenizer, SEEDS, tmp_path / "t.h5", strategy="none",
                                       max_new_tokens=2, trace_mode="digest")
    (out,) = Engine(model, tokenizer, strategy="none").generate([SEEDS], max_new_tokens=2, sinks={0: recorder})
    recorder.finish(out.token_ids, out.text, out.chunks)
    rows, row = returned[0]     # the prompt forward's
    assert rows > 1 and row.untyped_storage().nbytes() == row.nbytes


def test_a_capture_changed_in_place_before_its_forward_is_digested_is_refused():
    from kvdiff.engine.digest_probes import DigestProbes
    from kvdiff.probes.selection import Selection
    from kvdiff.trace.sink import ProbeIntegrityError

    probes = DigestProbes(Selection.parse(2, "resid_pre,resid_post"), rows=3)
    rows = torch.randn(3, 8)
    probes.capture("resid_pre", 0, rows)
    probes.capture("resid_post", 0, torch.randn(3, 8))
    rows.add_(1)
    with pytest.raises(ProbeIntegrityError, match="'resid_pre' at layer 0 in place"):
        probes.digest()


def test_the_zoom_run_not_repeating_the_first_is_reported_with_where(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    paths = [_record(model, tokenizer, tmp_path / f"{name}.h5", trace_mode="digest") for name in ("a", "b")]
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3        # the second run is not the first
        try:
            again = _record(model, tokenizer, tmp_path / "again.h5", trace_mode="digest")
        finally:
            model.model.layers[1].mlp.down_proj.weight[0, 0] -= 1e-3
    assert repeat_findings((paths[0], paths[0]), (paths[1], paths[1])) == []
    (finding,) = repeat_findings((paths[0], paths[1]), (paths[1], again))
    assert finding.kind == "nondeterministic" and finding.details == {"side": "candidate", "layer": 1,
                                                                      "tensor": "mlp_out"}
    assert finding.positions == (0, 0) and finding.confidence == 1.0


def test_a_run_not_repeating_itself_only_after_the_first_difference_leaves_the_diagnoses_there_standing(
        tiny_llama, tmp_path):
    """Red-team t4: an engine whose later rows did not repeat led the report with `nondeterministic`
    ("nothing else can be trusted") though every row up to the first difference repeated bitwise."""
    from kvdiff.analysis.diagnosis import Diagnosis, top_diagnosis
    from kvdiff.run.zoom import diagnoses_with

    model, tokenizer = tiny_llama
    clean = _record(model, tokenizer, tmp_path / "clean.h5", trace_mode="full")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-2
        try:
            changed = _record(model, tokenizer, tmp_path / "changed.h5", trace_mode="full")
        finally:
            model.model.layers[1].mlp.down_proj.weight[0, 0] -= 1e-2
    div = kvdiff.diff(clean, changed)
    first = div.first_bit_difference
    assert (first.layer, first.position) == (1, 0) and div.diagnoses

    def finding(layer, position):
        return Diagnosis("nondeterministic", None, (position, position), "the candidate's zoom run is not its first run",
                         {"side": "candidate", "layer": layer, "tensor": "q"}, confidence=1.0)

    diagnoses_with(div, [finding(1, 3)])
    (later,) = [d for d in div.diagnoses if d.kind == "nondeterministic"]
    assert later.details["after_first_difference"] and "what is diagnosed there stands" in later.evidence
    assert top_diagnosis(div.diagnoses).kind != "nondeterministic"
    diagnoses_with(div, [finding(0, 0)])
    top = top_diagnosis(div.diagnoses)
    assert top.kind == "nondeterministic" and "after_first_difference" not in top.details


def test_a_repeat_whose_statistics_differ_under_equal_hashes_is_not_its_first_run(tiny_llama, tmp_path):
    """A 2^-32 hash collision between the two runs of one side: the statistics still tell them apart."""
    import h5py

    model, tokenizer = tiny_llama
    first = _record(model, tokenizer, tmp_path / "first.h5", trace_mode="digest")
    again = tmp_path / "again.h5"
    again.write_bytes(Path(first).read_bytes())
    with open_trace(first) as t:
        layer, column = t.meta.digest_layers.index(1), digest_tables(t.meta.digest_points, 1)[""].index("mlp_out")
    with h5py.File(again, "r+") as f:                       # position 3's rms, hash kept
        stats = f["digests/layers/stats"]
        rms = stats[3, layer, column, 0]
        stats[3, layer, column, 0] = rms * np.float32(1 + 2 ** -20)
    assert repeat_findings((first,), (first,), ("candidate",)) == []
    (finding,) = repeat_findings((first,), (again,), ("candidate",))
    assert finding.details == {"side": "candidate", "layer": 1, "tensor": "mlp_out"} and finding.positions == (3, 3)
    with h5py.File(again, "r+") as f:                       # one float32 step: the rounding of a stored rms
        f["digests/layers/stats"][3, layer, column, 0] = np.nextafter(rms, np.float32(np.inf))
    with open_trace(first) as a, open_trace(again) as b:
        assert first_digest_mismatch(a, b) is None


def test_statistics_prove_a_breach_outside_the_window_and_only_a_difference_for_a_last_bit(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    reference = _record(model, tokenizer, tmp_path / "ref.h5", trace_mode="digest")
    layer = model.model.layers[2].mlp
    for scale, name in ((1.5, "big"), (1 + 2 ** -20, "tiny")):
        handle = layer.register_forward_hook(lambda m, i, out, s=scale: out * s)
        try:
            _record(model, tokenizer, tmp_path / f"{name}.h5", trace_mode="digest")
        finally:
            handle.remove()
    big = diff(reference, tmp_path / "big.h5").comparison.points["mlp_out"]
    tiny = diff(reference, tmp_path / "tiny.h5").comparison.points["mlp_out"]
    row = big.row_of(2)
    compared = big.tier[row] != 3                   # positions after the tokens part are incomparable
    assert set(big.tier[row, compared].tolist()) == {2} and (big.max_abs[row, compared] > 0).all()   # proved
    assert set(tiny.tier[row].tolist()) <= {0, 4} and 4 in tiny.tier[row].tolist()      # different (or equal)
    assert np.isin(big.tier[:row], (0, 3)).all() and (tiny.tier[:row] == 0).all()    # earlier layers equal



def test_inspect_says_what_a_digest_trace_holds_every_row_and_its_window(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    zoom = _record(model, tokenizer, tmp_path / "zoom.h5", trace_mode="digest", layers="1", positions="2-9")
    result = CliRunner().invoke(app, ["inspect", str(zoom)], terminal_width=300)
    assert result.exit_code == 0, result.output
    with open_trace(zoom) as t:
        every = f"positions 0-{int(t.digest_positions[-1])}"
    text = " ".join(result.output.split())        # rich wraps the summary's values
    assert f"generated; {every} " in text and " mode digest: " in text       # every digested position, not the window's
    digests, window = text[text.index(" digests "):text.index(" window full rows")], text[text.index(" window full rows"):]
    assert "layers 0-2" in digests and every in digests and "logits" in digests
    assert "layers 1, positions 2-9" in window and "window rows" in window

def test_a_window_keeps_k_and_v_at_its_key_positions_and_nothing_else_there(tiny_llama, tmp_path):
    """A zoom window's keys (ZoomWindow.keys): the positions before it hold k and v rows of its
    layers, as computed, listed as key-only (schema 4); no other point holds a row there, the diff
    compares k and v there and leaves the other points' cells to their digests, and `inspect` says so."""
    import h5py

    model, tokenizer = tiny_llama
    keyed = _record(model, tokenizer, tmp_path / "keys.h5", trace_mode="digest", layers="1", positions="6-9",
                    key_positions="0-5")
    full = _record(model, tokenizer, tmp_path / "full.h5")
    with open_trace(keyed) as t, open_trace(full) as f:
        assert t.meta.schema_version == 4 and t.meta.key_only_positions.tolist() == list(range(6))
        assert t.positions.tolist() == list(range(10))
        for point in ("k", "v"):
            assert np.array_equal(t.point(1, point), f.point(1, point, slice(0, 10)))
    with open_trace(keyed) as t:                          # the full rows: every point but k and v at 6-9 only
        rows = align(t.meta, t.meta, t.positions, t.positions, t.steps, t.steps, str)
        assert rows.computed.tolist() == [False] * 6 + [True] * 4 and not rows.kv_only.any()
    divergence = diff(keyed, keyed)
    assert divergence.first_bit_difference is None
    q, k = (divergence.comparison.points[p] for p in ("q", "k"))
    assert (k.tier[k.row_of(1), :10] == 0).all() and (q.tier[q.row_of(1), :10] == 0).all()   # q by its digests
    text = " ".join(CliRunner().invoke(app, ["inspect", str(keyed)], terminal_width=300).output.split())
    assert "key rows positions 0-5: only k and v kept in full" in text
    with h5py.File(keyed, "r+") as h:                     # a reader of schema 3 would take the missing rows for data
        h.attrs["schema_version"] = 3
    with pytest.raises(InputError, match="key_only_positions needs schema 4"):
        diff(keyed, keyed)


def test_equal_hashes_are_not_bitwise_where_the_statistics_prove_the_rows_differ(tiny_llama, tmp_path):
    """A 2^-32 hash collision, or a trace edited by hand: the statistics' proof of a difference wins."""
    import h5py

    model, tokenizer = tiny_llama
    reference = _record(model, tokenizer, tmp_path / "ref.h5", trace_mode="digest")
    layer = model.model.layers[2].mlp
    handle = layer.register_forward_hook(lambda m, i, out: out * 1.5)
    try:
        _record(model, tokenizer, tmp_path / "cand.h5", trace_mode="digest")
    finally:
        handle.remove()
    with h5py.File(reference, "r") as ref, h5py.File(tmp_path / "cand.h5", "r+") as cand:
        for table in ("hash", "kv_hash"):           # every row's hash made the reference's, statistics kept
            cand["digests/layers/" + table][...] = ref["digests/layers/" + table][...]
    mlp = diff(reference, tmp_path / "cand.h5").comparison.points["mlp_out"]
    row = mlp.row_of(2)
    compared = mlp.tier[row] != 3
    assert set(mlp.tier[row, compared].tolist()) == {2} and (mlp.max_abs[row, compared] > 0).all()
    assert np.isin(mlp.tier[:row], (0, 3)).all()          # rows whose statistics agree stay bitwise


def test_a_window_row_that_does_not_match_its_digest_is_a_damaged_trace(tiny_llama, tmp_path):
    import h5py

    model, tokenizer = tiny_llama
    zoom = _record(model, tokenizer, tmp_path / "zoom.h5", trace_mode="digest", layers="1", positions="2-9")
    assert diff(zoom, zoom).first_bit_difference is None          # every window row matches its digest
    stats = tmp_path / "stats.h5"
    stats.write_bytes(Path(zoom).read_bytes())
    with h5py.File(zoom, "r+") as f:
        f["layers/1/attn_out"][5, 3] += 1.0                     # one element of one window row
    with pytest.raises(InputError, match="row of attn_out of layer 1 at position 5 does not match its digest"):
        diff(zoom, zoom)
    with open_trace(stats) as t:
        layer, column = t.meta.digest_layers.index(1), digest_tables(t.meta.digest_points, 1)[""].index("attn_out")
    with h5py.File(stats, "r+") as f:                        # the rms of that row's digest, 1% off
        f["digests/layers/stats"][5, layer, column, 0] *= 1.01
    with pytest.raises(InputError, match="row of attn_out of layer 1 at position 5 does not match its digest"):
        diff(stats, stats)

@pytest.mark.parametrize("strategy, warm", [(s, False) for s in STRATEGIES] + [("prefix", True),
                                                                               ("isolated-local", True)])
def test_the_seeds_scenario_has_the_same_first_divergence_and_diagnoses_in_digest_and_full_mode(strategy, warm,
                                                                                                 tmp_path):
    runs = {mode: compare(SEEDS, model="tiny-llama", strategy=strategy, max_new_tokens=4, trace_mode=mode, warm=warm,
                          out=tmp_path / mode) for mode in ("digest", "full")}
    digest, full = (runs[m].report.to_json() for m in ("digest", "full"))
    for key in ("verdict", "first_bit_difference", "first_divergence", "top_diagnosis", "first_operation"):
        assert digest[key] == full[key], key
    # the same claims; norm_consistency counts the norms it checked, fewer in a window of 2 layers
    claim = lambda d: {k: v for k, v in d.items() if d["kind"] != "norm_consistency" or k in
                       ("kind", "chunk", "positions", "source", "confidence")}
    assert [claim(d) for d in digest["diagnoses"]] == [claim(d) for d in full["diagnoses"]]
    flips = digest["first_token_divergence"], full["first_token_divergence"]
    if flips[0] is not None:                      # the logits row: outside the window, its size a lower bound
        sized = ("max_abs", "rel", "cosine")
        assert {k: v for k, v in flips[0].items() if k not in sized} == {k: v for k, v in flips[1].items()
                                                                            if k not in sized}
    for point, grid in full["heatmaps"].items():      # every cell: the digest's tier agrees, its size is a bound
        tiers, exact = np.array(digest["heatmaps"][point]["tiers"]), np.array(grid["tiers"])
        assert np.array_equal(tiers == "bitwise", exact == "bitwise"), point
        assert (exact[tiers == "divergent"] == "divergent").all(), point
        assert np.isin(exact[tiers == "different"], ("noise", "divergent")).all(), point
        low = np.array(digest["heatmaps"][point]["max_abs"], dtype=float)
        high = np.array(grid["max_abs"], dtype=float)
        known = ~np.isnan(low) & ~np.isnan(high)
        assert (low[known] <= high[known] * (1 + 1e-6)).all(), point
    assert digest["digest"]["repeated"] is True and full.get("digest") is None
    if digest["first_bit_difference"] is None:
        assert digest["digest"]["zoom"] is None
    else:
        layer = digest["first_bit_difference"]["layer"]
        assert layer is None or digest["digest"]["zoom"]["layers"][0] == max(layer - 1, 0)   # and the one before
    assert set(digest["heatmaps"]) == set(full["heatmaps"])
    assert len(digest["heatmaps"]["k"]["positions"]) == len(full["heatmaps"]["k"]["positions"])


def test_cli_trace_modes_and_a_clear_error_for_layers_in_digest_mode(tmp_path):
    runner = CliRunner()
    base = ["compare", "--system", SEED_SYSTEM, "--prompt", SEED_PROMPT, "--model", "tiny-llama", "-n", "2"]
    refused = runner.invoke(app, base + ["--layers", "0-1", "--out", str(tmp_path / "a")])
    assert refused.exit_code == 2 and "--zoom-layers" in refused.stderr
    full = runner.invoke(app, base + ["--trace-mode", "full", "--layers", "0-1", "--out", str(tmp_path / "b")])
    assert full.exit_code == 0, full.stderr
    with open_trace(tmp_path / "b" / "candidate.h5") as trace:
        assert trace.meta.trace_mode == "full" and trace.meta.layers == (0, 1)
    digest = runner.invoke(app, base + ["--strategy", "isolated-local", "--out", str(tmp_path / "d")])
    assert digest.exit_code == 1 and "digest capture: every row hashed; layers 0-1, positions 0-" in digest.stdout
    assert "repeated the first" in digest.stdout and "trace mode" not in full.stdout
    bad = runner.invoke(app, base + ["--trace-mode", "sparse", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "unknown trace mode 'sparse'" in bad.stderr


def test_a_capture_changed_in_place_only_in_a_later_decode_step_drops_the_trace(tiny_llama, tmp_path):
    from kvdiff.trace.sink import ProbeIntegrityError
    model, tokenizer = tiny_llama
    forwards = []

    def change_later(module, args):     # layer 1's resid_post, captured already, changed from the 4th forward on
        forwards.append(1)
        if len(forwards) >= 4:
            args[0].mul_(1)

    handle = model.model.layers[2].register_forward_pre_hook(change_later)
    try:
        with pytest.raises(ProbeIntegrityError, match="'resid_post' at layer 1 in place"):
            _record(model, tokenizer, tmp_path / "t.h5", trace_mode="digest")
    finally:
        handle.remove()
    assert len(forwards) >= 4 and not (tmp_path / "t.h5").exists()
