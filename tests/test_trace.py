"""The HDF5 trace writer and reader: round trips, atomic completion, refusals."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import h5py
import numpy as np
import pytest
import torch

from kvdiff.errors import TraceError
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace import ChunkRecord, ModelDims, TraceMeta, TraceWriter, open_trace


def make_meta(dtype: str = "float32", prompt: int = 400) -> TraceMeta:
    """A unit test's metadata: a prompt of `prompt` tokens (positions the test writes rows at lie
    in it: the reader refuses positions past the prompt and generated tokens), nothing generated."""
    return TraceMeta(
        kvdiff_version="0.1.0", model_name="unit", model_fingerprint="cfg:0/w:0", tokenizer_fingerprint="tok",
        dtype=dtype, device="cpu", torch_version=torch.__version__, transformers_version="5", strategy="reference",
        numerics="fast", messages=[{"role": "user", "content": "hi"}], input_ids=np.arange(prompt, dtype=np.int64) % 50,
        dims=ModelDims(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=50,
                       attn_scale=8 ** -0.5), points=("resid_pre", "k"), layers=(0, 1),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_round_trip_bit_for_bit(tmp_path, dtype):
    path = tmp_path / "t.h5"
    g = torch.Generator().manual_seed(0)
    rows = {(layer, p): (torch.randn(8, 32, generator=g) * 100).to(dtype) for layer in (0, 1) for p in ("resid_pre",)}
    keys = {layer: (torch.randn(8, 2, 8, generator=g) * 1e-3).to(dtype) for layer in (0, 1)}
    chunks = [ChunkRecord("system", (0, 3), "ab", "miss", (0, 3)), ChunkRecord("user", (4, 5), "cd", "hit", (4, 5))]
    with TraceWriter(path, make_meta(str(dtype).removeprefix("torch."), prompt=6)) as w:
        for layer in (0, 1):
            w.write_rows(f"layers/{layer}", "resid_pre", range(6), rows[(layer, "resid_pre")][:6])
            w.write_rows(f"layers/{layer}", "k", range(6), keys[layer][:6])
        for step, pos in enumerate((6, 7)):  # decode rows arrive one at a time
            for layer in (0, 1):
                w.write_rows(f"layers/{layer}", "resid_pre", [pos], rows[(layer, "resid_pre")][pos:pos + 1])
                w.write_rows(f"layers/{layer}", "k", [pos], keys[layer][pos:pos + 1])
            w.append_steps([(step, pos - 1, 7 + step)], np.array([[7 + step, 3]]), np.array([[2.5, 1.0]]), [1.5])
        w.write_provenance([5, 4, 3], "system", 0, [15, 14, 13], False)
        w.write_provenance([4, 5], "usér 😀", 1, [4, 5], True)      # a later report replaces an earlier one
        w.close(generated_ids=[7, 8], text="ok", chunks=chunks)
    with open_trace(path) as tr:
        assert tr.meta.chunks == chunks and tr.meta.text == "ok" and tr.meta.dtype == str(dtype)[6:]
        assert tr.positions.tolist() == list(range(8))
        for layer in (0, 1):
            got = tr.layer(layer)
            for name, want in (("resid_pre", rows[(layer, "resid_pre")]), ("k", keys[layer])):
                want32 = want.float().numpy() if dtype == torch.bfloat16 else want.numpy()
                assert got[name].dtype == want32.dtype
                assert np.array_equal(got[name].view(np.uint8), want32.view(np.uint8))
        assert tr.steps.token_id.tolist() == [7, 8] and tr.steps.topk_ids.shape == (2, 2)
        assert tr.steps.position.tolist() == [5, 6] and tr.steps.topk_values.dtype == np.float32
        prov = tr.provenance
        assert prov.chunk == ["", "", "", "system", "usér 😀", "usér 😀", "", ""] and prov.reused[4] and not prov.reused[3]
        assert prov.encoded_position[3:6].tolist() == [13, 4, 5] and prov.prefill_id[3:6].tolist() == [0, 1, 1]


def test_sparse_positions_read_back_aligned(tmp_path):
    path = tmp_path / "t.h5"
    rows = torch.arange(500, dtype=torch.float32).reshape(10, 50)
    with TraceWriter(path, replace(make_meta(), points=("logits",))) as w:
        w.write_rows("final", "logits", [9, 2, 5], rows[[9, 2, 5]])
    with open_trace(path) as tr:
        assert tr.positions.tolist() == [2, 5, 9]
        assert np.array_equal(tr.final()["logits"], rows[[2, 5, 9]].numpy())
        assert tr.provenance is None


def test_single_points_and_row_blocks_read_back_aligned_with_positions(tmp_path):
    path = tmp_path / "t.h5"
    rows = torch.arange(400 * 32, dtype=torch.float32).reshape(400, 32)
    kept = np.r_[0:10, 50:60, 390:400]
    with TraceWriter(path, replace(make_meta(), layers=(0,))) as w:
        w.write_rows("layers/0", "resid_pre", kept, rows[kept])
        w.write_rows("layers/0", "k", kept, torch.ones(kept.size, 2, 8, dtype=torch.bfloat16))
    with open_trace(path) as tr:
        full = tr.point(0, "resid_pre")
        assert np.array_equal(full, rows[kept].numpy()) and sorted(tr.points_in(0)) == ["k", "resid_pre"]
        for rows_ in (slice(0, 10), slice(5, 15), slice(0, 30, 7), np.array([3, 12, 25]), np.array([25, 3, 12]),
                      np.array([0, 29]), np.array([], dtype=np.int64)):
            assert np.array_equal(tr.point(0, "resid_pre", rows_), full[rows_]), rows_
        assert list(tr.layer(0, points=["k"], rows=slice(2, 4))) == ["k"]
        assert tr.layer(0, points=["k"], rows=slice(2, 4))["k"].shape == (2, 2, 8)
        assert tr.row_nbytes(0, "k") == 2 * 8 * 4 and tr.row_nbytes(0, "resid_pre") == 32 * 4   # bf16 reads as fp32
        with pytest.raises(TraceError, match="no probe point 'q'"):
            tr.point(0, "q")


def test_points_read_once_leave_no_chunk_cache_behind(tmp_path):
    """The reader keeps datasets open between reads; HDF5 must not keep their chunks with them."""
    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    meta = replace(make_meta(), dims=replace(make_meta().dims, num_layers=40, hidden_size=2048), layers=tuple(range(40)), points=("resid_pre",))
    with TraceWriter(tmp_path / "t.h5", meta) as w:
        for layer in meta.layers:
            w.write_rows(f"layers/{layer}", "resid_pre", range(256), torch.randn(256, 2048))   # 2 MB a layer
    with open_trace(tmp_path / "t.h5") as tr:
        before = resident()
        for layer in meta.layers:
            tr.point(layer, "resid_pre")
        assert resident() - before < 20e6


def test_a_point_missing_positions_is_an_integrity_error_and_leaves_no_file(tmp_path):
    path = tmp_path / "t.h5"
    w = TraceWriter(path, make_meta())
    w.write_rows("layers/0", "resid_pre", range(4), torch.zeros(4, 32))
    w.write_rows("layers/0", "k", range(3), torch.zeros(3, 2, 8))
    with pytest.raises(ProbeIntegrityError, match=r"layers/0/k holds no rows for positions 3"):
        w.close()
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_steps_whose_top_k_and_margins_do_not_match_are_refused(tmp_path):
    with TraceWriter(tmp_path / "t.h5", make_meta()) as w:
        with pytest.raises(ProbeIntegrityError, match="2 steps with top-k ids of shape"):
            w.append_steps([(0, 3, 7), (1, 4, 8)], np.zeros((2, 5)), np.zeros((2, 4)), [1.0, 2.0])
        with pytest.raises(ProbeIntegrityError, match="and 1 margins"):
            w.append_steps([(0, 3, 7), (1, 4, 8)], np.zeros((2, 5)), np.zeros((2, 5)), [1.0])
        with pytest.raises(ProbeIntegrityError, match="0 steps with top-k ids of shape"):
            w.append_steps([], np.zeros((1, 5)), np.zeros((1, 5)), [])
        w.append_steps([], np.zeros((0, 5)), np.zeros((0, 5)), [])          # no steps: nothing to keep
        w.abort()


def test_an_exception_inside_the_writer_context_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "t.h5", make_meta()) as w:
            w.write_rows("layers/0", "resid_pre", range(4), torch.zeros(4, 32))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def _complete_trace(path) -> None:
    with TraceWriter(path, replace(make_meta(), points=("resid_pre",), layers=(0,))) as w:
        w.write_rows("layers/0", "resid_pre", range(200), torch.randn(200, 32))


def test_reader_refuses_bad_files_with_one_line(tmp_path):
    good = tmp_path / "good.h5"
    _complete_trace(good)
    (tmp_path / "text.h5").write_text("hello")
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = np.zeros(3)
    newer = tmp_path / "newer.h5"
    _complete_trace(newer)
    with h5py.File(newer, "a") as f:
        f.attrs["schema_version"] = 99
    incomplete = tmp_path / "incomplete.h5"
    _complete_trace(incomplete)
    with h5py.File(incomplete, "a") as f:
        f.attrs["complete"] = False
    truncated = tmp_path / "truncated.h5"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    cases = {"missing.h5": "not found", "text.h5": "not an HDF5 file", "foreign.h5": "not a kvdiff trace",
             "newer.h5": "schema 99, newer", "incomplete.h5": "incomplete", "truncated.h5": "truncated"}
    for name, message in cases.items():
        with pytest.raises(TraceError, match=message) as info:
            open_trace(tmp_path / name)
        assert "\n" not in str(info.value)


_KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_trace import make_meta
    from kvdiff.trace import TraceWriter
    w = TraceWriter({path!r}, make_meta())
    pos = 0
    while True:
        w.write_rows("layers/0", "resid_pre", range(pos, pos + 64), torch.randn(64, 32))
        w.flush()
        pos += 64
        if pos == 640:
            print("ready", flush=True)
""")


def test_a_killed_writer_never_leaves_a_complete_trace(tmp_path):
    path = tmp_path / "killed.h5"
    script = _KILLED_WRITER.format(tests=os.path.dirname(__file__), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not path.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".partial")
    with pytest.raises(TraceError, match="incomplete|truncated|corrupt"):
        open_trace(leftovers[0])
