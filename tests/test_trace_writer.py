"""The trace writer's background thread: bounded backlog, bit-exact data, errors in the caller."""

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvdiff.errors import TraceError, TraceWriteError
from kvdiff.trace import staging
from kvdiff.trace import writer as trace_writer
from kvdiff.trace.background import SerialWorker
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace import TraceWriter, open_trace

from test_trace import make_meta


def _assert_submit_waits_for(worker: SerialWorker, gate: threading.Event, *sizes: int) -> None:
    """A submit of a job holding `sizes` blocks until `gate` lets the first job finish."""
    blocked = threading.Thread(target=worker.submit, args=(lambda: None, *sizes))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()
    gate.set()
    blocked.join(5)
    assert not blocked.is_alive()


def test_submit_waits_while_the_backlog_would_pass_the_bound():
    worker = SerialWorker("test", max_bytes=100)
    gate = threading.Event()
    worker.submit(gate.wait, 60)
    worker.submit(lambda: None, 30)
    assert worker.backlog == 90
    _assert_submit_waits_for(worker, gate, 30)
    worker.wait_idle()
    assert worker.peak_backlog == 90
    worker.submit(lambda: None, 500)          # larger than the bound: admitted once the backlog is empty
    worker.stop()
    assert worker.backlog == 0 and worker.error is None and worker.peak_backlog == 500


def test_gpu_memory_has_a_backlog_bound_of_its_own():
    worker = SerialWorker("test", max_bytes=100, max_device_bytes=1000)
    gate = threading.Event()
    worker.submit(gate.wait, 0, 600)
    worker.submit(lambda: None, 90, 0)          # host memory: its own bound, not passed
    _assert_submit_waits_for(worker, gate, 0, 600)
    worker.stop()
    assert worker.peak_device_backlog == 600 and worker.peak_backlog == 90


@pytest.mark.parametrize("bounds", [{"max_queued_bytes": 0}, {"max_device_bytes": -1}])
def test_bad_backlog_bounds_are_a_trace_error_before_any_file_is_made(tmp_path, bounds):
    with pytest.raises(TraceError, match="max_queued_bytes must be positive and max_device_bytes None or not negative"):
        TraceWriter(tmp_path / "t.h5", make_meta(), **bounds)
    assert list(tmp_path.iterdir()) == []


def test_wait_idle_waits_for_jobs_that_hold_no_bytes():
    worker = SerialWorker("test", max_bytes=100)
    ran = []
    worker.submit(lambda: (time.sleep(0.2), ran.append(1)))
    worker.wait_idle()
    assert ran == [1]
    worker.stop()


def test_a_failed_job_stops_the_worker_and_drops_later_jobs():
    worker = SerialWorker("test", max_bytes=10)
    ran = []
    worker.submit(lambda: 1 / 0, 5)
    worker.submit(lambda: ran.append(1), 5)
    worker.wait_idle()
    worker.submit(lambda: ran.append(2), 5)
    worker.stop()
    assert isinstance(worker.error, ZeroDivisionError) and ran == [] and worker.backlog == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_written_through_a_tiny_backlog_round_trip_bit_for_bit(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(300, 2, 8, generator=g) * 1e3).to(dtype)
    path = tmp_path / "t.h5"
    meta = replace(make_meta(str(dtype)[6:]), layers=(1,), points=("k",))
    with TraceWriter(path, meta, max_queued_bytes=1024) as w:
        for lo in range(0, 300, 7):                         # blocks arrive out of order and transposed
            block = rows[lo:lo + 7].transpose(0, 1).contiguous().transpose(0, 1)
            w.write_rows("layers/1", "k", range(lo, lo + block.shape[0]), block)
            block.fill_(0)                                    # the caller reuses its buffer at once
    with open_trace(path) as tr:
        got = tr.layer(1)["k"]
    want = rows.float().numpy() if dtype == torch.bfloat16 else rows.numpy()
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (see docs/gpu.md)")
@pytest.mark.parametrize("device_bytes, on_gpu", [(None, True), (0, False)])
def test_large_gpu_captures_wait_on_the_gpu_and_reach_the_file_in_pieces(tmp_path, monkeypatch, device_bytes, on_gpu):
    from kvdiff.trace.device_rows import Bounce
    monkeypatch.setattr(trace_writer, "Bounce", lambda: Bounce(4096))     # pieces of 128 or 64 rows
    g = torch.Generator(device="cuda").manual_seed(7)
    rows = {dtype: (torch.randn(400, 2, 8, device="cuda", generator=g) * 1e3).to(dtype)
            for dtype in (torch.bfloat16, torch.float32)}
    want = {dtype: r.cpu() for dtype, r in rows.items()}
    monkeypatch.setattr(staging, "STAGED_ROWS_BYTES", 1024)           # not staged: copied alone
    for dtype, r in rows.items():
        path = tmp_path / f"{str(dtype)[6:]}.h5"
        meta = replace(make_meta(str(dtype)[6:]), layers=(1,), points=("k",))
        with TraceWriter(path, meta, max_queued_bytes=1024, max_device_bytes=device_bytes) as w:
            w.write_rows("layers/1", "k", range(300), r[:300])
            w.write_rows("layers/1", "k", range(300, 400), r[300:])
            r.fill_(0)                                          # the caller reuses its buffer at once
            peaks = w._worker.peak_backlog, w._worker.peak_device_backlog
        assert (peaks[1] > 0) == on_gpu and (peaks[0] > 1024) != on_gpu
        with open_trace(path) as tr:
            got = tr.layer(1)["k"]
        expected = want[dtype].float().numpy() if dtype == torch.bfloat16 else want[dtype].numpy()
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (see docs/gpu.md)")
def test_a_gpu_out_of_memory_for_a_capture_sends_it_and_the_later_ones_to_host_memory(tmp_path, monkeypatch):
    from kvdiff.trace.device_rows import DeviceRows
    copies = []

    def short_of_memory(rows):
        copies.append(rows.shape[0])
        if len(copies) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return DeviceRows(rows)

    monkeypatch.setattr(trace_writer, "DeviceRows", short_of_memory)
    monkeypatch.setattr(staging, "STAGED_ROWS_BYTES", 1024)
    rows = torch.randn(300, 2, 8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    path = tmp_path / "t.h5"
    with TraceWriter(path, replace(make_meta(), layers=(1,), points=("k",)), max_queued_bytes=1024) as w:
        for lo in range(0, 300, 100):
            w.write_rows("layers/1", "k", range(lo, lo + 100), rows[lo:lo + 100])
        peaks = w._worker.peak_backlog, w._worker.peak_device_backlog
    assert copies == [100, 100] and peaks[0] > 1024 and peaks[1] > 0      # the third went to the host directly
    with open_trace(path) as tr:
        assert np.array_equal(tr.layer(1)["k"], rows.cpu().numpy())


def test_rows_arriving_one_position_at_a_time_are_written_once_per_hdf5_chunk(tmp_path, monkeypatch):
    import h5py
    from kvdiff.trace.column import TraceColumn
    writes = []                     # runs of rows go through TraceColumn.write_run, scattered rows through h5py's slicing
    original, original_run = h5py.Dataset.__setitem__, TraceColumn.write_run
    monkeypatch.setattr(h5py.Dataset, "__setitem__",
                        lambda ds, sel, val: (writes.append(ds.name), original(ds, sel, val)))
    monkeypatch.setattr(TraceColumn, "write_run",
                        lambda col, start, data: (writes.append(col.ds.name), original_run(col, start, data)))
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(300, 2, 8, generator=g)                # 64-byte rows: 128 rows a chunk
    path = tmp_path / "t.h5"
    meta = replace(make_meta(), layers=(1,), points=("k",))
    with TraceWriter(path, meta) as w:
        for p in range(300):                                   # decode steps: one row each
            w.write_rows("layers/1", "k", [p], rows[p:p + 1])
        rows[[5, 200, 299]] = -rows[[5, 200, 299]]
        w.write_rows("layers/1", "k", [299, 5, 200], rows[[299, 5, 200]])   # a later row replaces an earlier one
        rows[299] = 7.0
        w.write_rows("layers/1", "k", [299], rows[299:300])
    with open_trace(path) as tr:
        assert np.array_equal(tr.layer(1)["k"], rows.numpy())
    row_writes = [n for n in writes if n == "/layers/1/k"]
    assert len(row_writes) == 5      # chunks ending at 128 and 256, rows 256-299, the scattered write, row 299


def test_rows_reach_the_file_when_written_not_when_it_is_closed(tmp_path):
    from kvdiff.trace.file import TraceFile
    rows = np.random.default_rng(3).standard_normal((384, 1024)).astype(np.float32)   # 3 chunks of 128 rows
    path = tmp_path / "t.h5"
    f = TraceFile(path, make_meta(prompt=384), None)
    f.create()
    try:
        for layer in range(4):
            f.put(f"layers/{layer}/resid_pre", np.arange(384), rows, "float32")
        assert path.stat().st_size >= 4 * rows.nbytes      # HDF5 kept none of it back in a chunk cache
    finally:
        f.discard()


def test_rows_from_the_first_chunk_on_go_into_chunks_allocated_as_the_column_grows(tmp_path, monkeypatch):
    import h5py
    from kvdiff.trace.column import LatchingFile
    from kvdiff.trace.file import TraceFile
    writes = []
    original = LatchingFile.pwrite
    monkeypatch.setattr(LatchingFile, "pwrite", lambda io, view, at: (writes.append(len(view)), original(io, view, at)))
    rng = np.random.default_rng(5)
    want = {name: rng.standard_normal((600, 256)).astype(np.float32) for name in ("a", "b")}   # 1 KB rows, 128 a chunk
    path = tmp_path / "t.h5"
    f = TraceFile(path, make_meta(prompt=600), None)
    f.create()
    try:
        f.put("layers/0/a", np.arange(300), want["a"][:300], "float32")
        assert writes == [300 * 1024]                     # three chunks allocated together: one write
        for p in range(300, 600):                         # decode steps; the two columns' chunks interleave
            for name in ("a", "b") if p > 300 else ("a",):
                f.put(f"layers/0/{name}", np.array([p]), want[name][p:p + 1], "float32")
            if p == 300:
                f.put("layers/0/b", np.arange(301), want["b"][:301], "float32")
        want["a"][[5, 450, 10]] *= -1
        f.put("layers/0/a", np.array([450, 5, 10]), want["a"][[450, 5, 10]], "float32")   # scattered, through HDF5
        f.finish([], {})
    except BaseException:
        f.discard()
        raise
    with h5py.File(path, "r") as h:
        for name, rows in want.items():
            ds = h[f"layers/0/{name}"]
            assert ds.id.get_create_plist().get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY
            np.testing.assert_array_equal(ds[:], rows)
    # chunks allocated as they are needed (5 of 128 rows a column), not by doubling the extent (6)
    assert path.stat().st_size < 2 * 5 * 128 * 1024 + (64 << 10)


def test_rows_go_into_allocated_chunks_at_most_1_mb_a_system_call(tmp_path, monkeypatch):
    import h5py
    from kvdiff.trace.file import TraceFile
    calls, original = [], os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: (calls.append(len(data)), original(fd, data, at))[1])
    rows = np.random.default_rng(8).standard_normal((3000, 256)).astype(np.float32)       # 3 MB
    f = TraceFile(tmp_path / "t.h5", make_meta(prompt=3000), None)
    f.create()
    f.put("layers/0/a", np.arange(3000), rows, "float32")
    f.finish([], {})
    assert sum(calls) == rows.nbytes and max(calls) <= 1 << 20 and len(calls) <= 4
    with h5py.File(tmp_path / "t.h5", "r") as h:
        np.testing.assert_array_equal(h["layers/0/a"][:], rows)


def test_rows_that_start_past_the_first_chunk_leave_the_chunks_before_them_unallocated(tmp_path):
    import h5py
    from kvdiff.trace.file import TraceFile
    rows = np.random.default_rng(6).standard_normal((10, 256)).astype(np.float32)
    path = tmp_path / "t.h5"
    f = TraceFile(path, make_meta(prompt=5010), None)
    f.create()
    f.put("layers/0/a", np.arange(5000, 5010), rows, "float32")     # a positions= selection near the end
    f.finish([], {})
    with h5py.File(path, "r") as h:
        ds = h["layers/0/a"]
        assert ds.shape == (5010, 256) and ds.id.get_create_plist().get_alloc_time() != h5py.h5d.ALLOC_TIME_EARLY
        np.testing.assert_array_equal(ds[5000:], rows)
    assert path.stat().st_size < 5000 * 1024 // 4


@pytest.mark.parametrize("row_shape, dtype, chunk_rows", [
    ((), np.float64, 1024),              # a norm statistic: at least 8 KB a chunk, a multiple of 128 rows
    ((2, 8), np.float32, 128),
    ((1, 8), np.float32, 256),           # 32 B: 8 KB would take 256 rows
    ((3, 64), np.uint16, 128),
    ((576,), np.uint16, 128),
    ((49152,), np.uint16, 10),           # a logits row: about 1 MB a chunk
])
def test_chunks_hold_about_1_mb_at_most_128_rows_unless_rows_are_tiny(tmp_path, row_shape, dtype, chunk_rows):
    import h5py
    from kvdiff.trace.file import TraceFile
    path = tmp_path / "t.h5"
    f = TraceFile(path, make_meta(prompt=3), None)
    f.create()
    try:
        f.put("layers/0/x", np.arange(3), np.zeros((3, *row_shape), dtype=dtype), "float32")
        f.flush()
        with h5py.File(path, "r") as h:
            assert h["layers/0/x"].chunks == (chunk_rows, *row_shape)
    finally:
        f.discard()


@pytest.mark.parametrize("compression, opts", [(None, None), ("gzip", 4), ("lzf", None)])
def test_row_datasets_are_made_as_h5py_makes_them(tmp_path, compression, opts):
    import h5py
    rows = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(4))
    meta = replace(make_meta(), layers=(1,), points=("k",))
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for path in paths:
        with TraceWriter(path, meta, compression=compression) as w:
            w.write_rows("layers/1", "k", range(3), rows)
    with h5py.File(paths[0], "r") as f:
        ds = f["layers/1/k"]
        assert (ds.compression, ds.compression_opts, ds.maxshape, ds.chunks) == (compression, opts, (None, 2, 8), (128, 2, 8))
        assert ds.attrs["kvdiff_dtype"] == "float32" and np.array_equal(ds[:], rows.numpy())
    assert paths[0].read_bytes() == paths[1].read_bytes()       # no time stamps in the objects


class _LateCopy:
    """Stands in for a CUDA event: the rows only arrive in the host buffer when it is waited on."""

    def __init__(self, host: torch.Tensor, rows: torch.Tensor):
        self.host, self.rows = host, rows

    def synchronize(self) -> None:
        self.host.copy_(self.rows)


def test_the_writer_waits_for_an_asynchronous_copy_before_reading_it(tmp_path, monkeypatch):
    def late_copy(rows):
        host = torch.zeros_like(rows)
        return staging.HostRows(host, _LateCopy(host, rows.clone()))

    monkeypatch.setattr(staging, "STAGED_ROWS_BYTES", 0)          # every capture copied alone
    monkeypatch.setattr(trace_writer, "host_copy", late_copy)
    rows = torch.randn(5, 32)
    with TraceWriter(tmp_path / "t.h5", replace(make_meta(), layers=(0,), points=("resid_pre",))) as w:
        w.write_rows("layers/0", "resid_pre", range(5), rows)
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], rows.numpy())


def test_a_sealed_stage_waits_for_its_asynchronous_copies_before_giving_rows():
    a, b = torch.randn(2, 3), torch.randn(4)
    flat = torch.cat([a.view(-1), b])
    host = torch.zeros_like(flat)
    copy = staging.FlatCopy([1, 0], [a.shape, b.shape], staging.HostRows(host, _LateCopy(host, flat)))
    stored = staging.SealedStage(2, [copy]).stored()
    assert [dtype for _, dtype in stored] == ["float32"] * 2
    assert np.array_equal(stored[1][0], a.numpy()) and np.array_equal(stored[0][0], b.numpy())



def test_a_tensor_staged_twice_is_copied_once_and_given_to_both_captures():
    a, b = torch.randn(1, 1, 6), torch.randn(3)
    stage = staging.Stage()
    for rows, shape in ((a, (1, 6)), (b, (3,)), (a, (6,)), (b, (1, 3))):
        stage.add(rows, shape, by_reference=True)
    sealed = stage.seal()
    assert sealed.parts[0].members == [0, 1] and sealed.same == {2: (0, (6,)), 3: (1, (1, 3))}
    stored = [rows for rows, _ in sealed.stored()]
    assert [r.shape for r in stored] == [(1, 6), (3,), (6,), (1, 3)]
    assert np.array_equal(stored[2], a.reshape(6).numpy()) and np.array_equal(stored[3], b.reshape(1, 3).numpy())


def test_decode_steps_capturing_one_tensor_twice_write_it_to_both_datasets(tmp_path):
    meta = replace(make_meta(), layers=(0, 1), points=("resid_pre", "resid_post"))
    g = torch.Generator().manual_seed(5)
    hidden = [torch.randn(1, 32, generator=g) for _ in range(12)]
    with torch.no_grad(), TraceWriter(tmp_path / "t.h5", meta) as w:
        for p in range(10):        # layer 0's output is layer 1's input, as in a decoder
            w.write_rows("layers/0", "resid_pre", [p], hidden[p])
            w.write_rows("layers/0", "resid_post", [p], hidden[p + 1])
            w.write_rows("layers/1", "resid_pre", [p], hidden[p + 1])
            w.write_norm("layers/1", "attn_norm", [p], hidden[p + 1], hidden[p + 2])
            w.write_rows("layers/1", "resid_post", [p], hidden[p + 2])
            w.commit()
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_post"], torch.cat(hidden[1:11]).numpy())
        assert np.array_equal(tr.layer(1)["resid_pre"], torch.cat(hidden[1:11]).numpy())
        assert np.array_equal(tr.layer(1)["resid_post"], torch.cat(hidden[2:12]).numpy())
        np.testing.assert_allclose(tr.norm_stats(1)["attn_norm"]["output_rms"],
                                   torch.cat(hidden[2:12]).double().square().mean(-1).sqrt().numpy(), rtol=1e-12)

def test_staged_captures_are_private_copies_and_norms_are_computed_in_batches(tmp_path):
    rows, x = torch.randn(5, 32), torch.randn(5, 32) * 3
    want_rows, want_x = rows.clone(), x.clone()
    with TraceWriter(tmp_path / "t.h5", replace(make_meta(), layers=(0,), points=("resid_pre",))) as w:
        w.write_rows("layers/0", "resid_pre", range(5), rows)
        w.write_norm("layers/0", "attn_norm", range(5), x, x * 2)
        w.write_norm("layers/0", "mlp_norm", range(5), x[:, :16], x[:, :16])      # another width
        rows.zero_(), x.zero_()                                                    # the caller reuses its buffers
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], want_rows.numpy())
        stats = tr.norm_stats(0)
    np.testing.assert_allclose(stats["attn_norm"]["input_rms"], want_x.double().square().mean(-1).sqrt().numpy(),
                               rtol=1e-12)
    np.testing.assert_allclose(stats["attn_norm"]["output_rms"], 2 * stats["attn_norm"]["input_rms"], rtol=1e-12)
    np.testing.assert_allclose(stats["mlp_norm"]["max_abs"], want_x[:, :16].double().abs().amax(-1).numpy())


def test_captures_spanning_many_full_stages_land_in_their_own_datasets(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "STAGE_BYTES", 300)              # a stage fills every few captures
    g = torch.Generator().manual_seed(3)
    resid = torch.randn(6, 32, generator=g)
    keys = torch.randn(6, 2, 8, generator=g)
    meta = replace(make_meta(), layers=(0, 1), points=("resid_pre", "k"))
    with TraceWriter(tmp_path / "t.h5", meta) as w:
        for p in range(6):
            for layer in (0, 1):
                w.write_rows(f"layers/{layer}", "resid_pre", [p], resid[p:p + 1] + layer)
                w.write_norm(f"layers/{layer}", "attn_norm", [p], resid[p:p + 1], resid[p:p + 1] * (layer + 2))
                w.write_rows(f"layers/{layer}", "k", [p], keys[p:p + 1] - layer)
            w.commit()
    with open_trace(tmp_path / "t.h5") as tr:
        for layer in (0, 1):
            assert np.array_equal(tr.layer(layer)["resid_pre"], (resid + layer).numpy())
            assert np.array_equal(tr.layer(layer)["k"], (keys - layer).numpy())
            stats = tr.norm_stats(layer)["attn_norm"]
            np.testing.assert_allclose(stats["output_rms"], (layer + 2) * stats["input_rms"], rtol=1e-6)


def test_decode_steps_are_written_together_and_a_layout_change_or_gap_writes_them_first(tmp_path, monkeypatch):
    from kvdiff.trace.file import TraceFile
    puts = []
    put = TraceFile.put
    monkeypatch.setattr(TraceFile, "put", lambda self, name, *a: (puts.append(name), put(self, name, *a)))
    g = torch.Generator().manual_seed(4)
    resid, keys = torch.randn(60, 32, generator=g), torch.randn(60, 2, 8, generator=g)
    steps = list(range(40)) + list(range(42, 50)) + [40, 41] + list(range(50, 60))   # a gap, then filled
    with TraceWriter(tmp_path / "t.h5", replace(make_meta(), layers=(0,), points=("resid_pre", "k"))) as w:
        for n, p in enumerate(steps):
            w.write_rows("layers/0", "resid_pre", [p], resid[p:p + 1])
            if n != 45:                                   # one step without k: another layout
                w.write_rows("layers/0", "k", [p], keys[p:p + 1])
            w.write_norm("layers/0", "attn_norm", [p], resid[p:p + 1], resid[p:p + 1] * 2)
            w.commit()
        w.write_rows("layers/0", "k", [steps[45]], keys[steps[45]:steps[45] + 1])
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], resid.numpy())
        assert np.array_equal(tr.layer(0)["k"], keys.numpy())
        stats = tr.norm_stats(0)["attn_norm"]
    np.testing.assert_allclose(stats["input_rms"], resid.double().square().mean(-1).sqrt().numpy(), rtol=1e-12)
    np.testing.assert_allclose(stats["output_rms"], 2 * stats["input_rms"], rtol=1e-6)
    # positions 0-31 in one call, then 32-39, 42-46, 47 (no k), 48-49, 40-41 and 50-59
    assert puts.count("layers/0/resid_pre") == 7


def test_an_error_on_the_writer_thread_is_raised_at_the_next_write_and_leaves_no_file(tmp_path):
    w = TraceWriter(tmp_path / "t.h5", make_meta())
    w.write_rows("layers/0", "resid_pre", range(4), torch.zeros(4, 32))
    w.write_rows("layers/0", "resid_pre", range(4, 8), torch.zeros(4, 16))   # fails on the thread
    w.commit()                                                                 # as at the end of a forward
    with pytest.raises(ProbeIntegrityError, match=r"layers/0/resid_pre: rows of shape \(16,\)"):
        for pos in range(8, 10_000):
            w.write_rows("layers/0", "resid_pre", [pos], torch.zeros(1, 32))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TraceError, match="already closed or aborted"):
        w.close()


_FILE_TOO_LARGE = textwrap.dedent("""
    import os, resource, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_trace import make_meta
    from kvdiff.errors import TraceError
    from kvdiff.trace import TraceWriter
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    w = TraceWriter({path!r}, make_meta())
    try:
        for pos in range(0, 200_000, 64):
            w.write_rows("layers/0", "resid_pre", range(pos, pos + 64), torch.randn(64, 32))
        w.close()
    except TraceError as exc:
        print(type(exc).__name__, exc.exit_code, exc, sep="|")
    print(os.listdir(os.path.dirname({path!r})))
""")


def test_a_full_disk_on_the_writer_thread_is_a_one_line_trace_error_and_leaves_no_file(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    script = _FILE_TOO_LARGE.format(tests=os.path.dirname(__file__), path=str(folder / "t.h5"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    error, listing = out.stdout.splitlines()
    name, code, message = error.split("|")
    assert issubclass(getattr(sys.modules["kvdiff.errors"], name), TraceError) and name == TraceWriteError.__name__
    assert code == "3" and "File too large" in message and "free space" in message
    assert listing == "[]" and list(folder.iterdir()) == []


def test_a_folder_removed_before_close_is_a_trace_write_error(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    w = TraceWriter(folder / "t.h5", make_meta())
    w.write_rows("layers/0", "resid_pre", range(4), torch.zeros(4, 32))
    w.flush()
    (folder / w.tmp_path.name).unlink()
    folder.rmdir()
    with pytest.raises(TraceWriteError, match="No such file or directory") as info:
        w.close()
    assert "\n" not in str(info.value) and not folder.exists()


def test_a_trace_path_that_is_a_folder_is_refused_at_once_and_a_link_is_followed(tmp_path):
    with pytest.raises(TraceError, match="it is a folder or not a regular file"):
        TraceWriter(tmp_path, make_meta())
    assert list(tmp_path.iterdir()) == []
    kept, link = tmp_path / "kept.h5", tmp_path / "link.h5"
    kept.write_bytes(b"an older trace")
    link.symlink_to(kept)
    rows = torch.randn(6, 32)
    with TraceWriter(link, replace(make_meta(), layers=(0,), points=("resid_pre",))) as w:
        w.write_rows("layers/0", "resid_pre", range(6), rows)
    assert link.is_symlink() and link.resolve() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.h5", "link.h5"]
    with open_trace(link) as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], rows.numpy())

def _resid_pre_writer(path):
    return TraceWriter(path, replace(make_meta(), layers=(0,), points=("resid_pre",)))


def test_after_the_first_forward_staged_rows_are_kept_by_reference_until_the_forward_ends(tmp_path):
    with torch.no_grad(), _resid_pre_writer(tmp_path / "t.h5") as w:
        for step in range(3):
            rows = torch.full((1, 32), float(step))
            w.write_rows("layers/0", "resid_pre", [step], rows)
            w.commit()
            rows.add_(100)                    # after the forward: the sealed copy is its own
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"][:, 0], [0.0, 1.0, 2.0])


def test_rows_the_model_changes_in_place_in_its_first_forward_are_always_copied(tmp_path):
    want = []
    with torch.no_grad(), _resid_pre_writer(tmp_path / "t.h5") as w:
        for step in range(3):
            rows = torch.full((1, 32), float(step))
            w.write_rows("layers/0", "resid_pre", [step], rows)
            want.append(rows.clone())
            rows.add_(100)                    # before the forward ends, in every forward
            w.commit()
    with open_trace(tmp_path / "t.h5") as tr:
        assert np.array_equal(tr.layer(0)["resid_pre"], torch.cat(want).numpy())


def test_rows_changed_in_place_only_after_the_first_forward_drop_the_trace(tmp_path):
    w = _resid_pre_writer(tmp_path / "t.h5")
    with torch.no_grad():
        w.write_rows("layers/0", "resid_pre", [0], torch.zeros(1, 32))
        w.commit()
        rows = torch.ones(1, 32)
        w.write_rows("layers/0", "resid_pre", [1], rows)
        rows.add_(1)
        with pytest.raises(ProbeIntegrityError, match="changed the captured rows layers/0/resid_pre in place"):
            w.commit()
    assert not (tmp_path / "t.h5").exists() and not w.tmp_path.exists()


def test_latching_file_keeps_the_first_write_error_and_drops_every_later_write(tmp_path, monkeypatch):
    from kvdiff.trace.column import LatchingFile
    io = LatchingFile(tmp_path / "f")
    io.pwrite(memoryview(b"abcd"), 0)
    tried = []

    def disk_full(fd, data, at):
        tried.append(at)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", disk_full)
    io.pwrite(memoryview(bytes(3 << 20)), 4)           # three 1 MB pieces: the first fails, no other is tried
    assert tried == [4] and io.error.errno == errno.ENOSPC
    assert io.write(b"xyz") == 3 and io.truncate(1 << 20) == 1 << 20      # dropped, reported as done to HDF5
    io.close()
    assert (tmp_path / "f").read_bytes() == b"abcd"

    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: 0)
    stuck = LatchingFile(tmp_path / "g")
    stuck.pwrite(memoryview(b"abcd"), 0)                # a file that takes no bytes: an error, not a loop
    assert stuck.error.errno == errno.EIO
    stuck.close()


def test_finishing_a_trace_reads_nothing_back_from_the_file(tmp_path, monkeypatch):
    """Datasets grow to exactly the rows they hold: shrinking them at the end made HDF5 read and
    rewrite the last chunk of every dataset."""
    import h5py
    from kvdiff.trace.column import LatchingFile
    from kvdiff.trace.file import TraceFile
    rows = np.random.default_rng(9).standard_normal((300, 1024)).astype(np.float32)     # 128 rows a chunk
    f = TraceFile(tmp_path / "t.h5", make_meta(prompt=300), None)
    f.create()
    f.put("layers/0/a", np.arange(290), rows[:290], "float32")
    f.put("layers/0/a", np.arange(290, 300), rows[290:], "float32")
    f.put("layers/0/b", np.arange(0, 300, 2), rows[::2], "float32")     # scattered rows: written by HDF5
    f.put("layers/0/b", np.arange(1, 300, 2), rows[1::2], "float32")
    reads, original = [], LatchingFile.read
    monkeypatch.setattr(LatchingFile, "read", lambda io, size: (reads.append(size), original(io, size))[1])
    f.finish([], {})
    assert reads == []
    with h5py.File(tmp_path / "t.h5", "r") as h:
        for name in ("a", "b"):
            assert h[f"layers/0/{name}"].shape == (300, 1024)
            np.testing.assert_array_equal(h[f"layers/0/{name}"][:], rows)
