"""TraceWriter: appends captured rows to an HDF5 trace as generation proceeds.

Rows are copied when they are handed over and written to HDF5 by one background thread, so the
model's forward does not wait for the disk. Large captures on a GPU are copied there
(device_rows.DeviceRows) and brought to the host by the thread; others are copied to host
memory. Both backlogs are bounded (`max_queued_bytes` of host memory, `max_device_bytes` of GPU
memory), and a capture that would pass a bound waits for the thread. Small
captures are staged (staging.Stage) and go to the thread as one job at `commit()` (the recorder
commits at the end of each forward), when the stage is full, or at `flush`; that thread
computes their norm statistics in batches and writes consecutive decode steps together
(step_batch.StepBatch). A decode step that repeats an earlier forward's layout is handed over
as one list (`commit_repeat`, the recorder's path). An error on the thread (disk full, file too
large) is raised in the caller at its next write or at `close`, as a TraceWriteError, and the
unfinished file is deleted.

The file is written under a temporary name in the target's folder; `close()` checks that every
recorded point holds every recorded position, sets the `complete` attribute last, and renames
the file into place. A writer that dies before that leaves only the temporary file, which
readers refuse as incomplete.

Longer than ~300 lines because the hand-over between the caller's thread and the writer thread
(staging, bounds, repeats, errors) is one protocol, kept in one place.
"""

from __future__ import annotations

import logging
import math
import os
import re
import weakref
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from kvdiff.errors import KvdiffError, TraceError, TraceWriteError
from kvdiff.files import in_place, landing
from kvdiff.trace.background import SerialWorker
from kvdiff.trace.device_rows import Bounce, DeviceRows
from kvdiff.trace.norm_stats import norm_statistics
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace.staging import Stage, StageLayout, host_copy
from kvdiff.trace.step_batch import StagedForward, StepBatch, put_norm_stats
from kvdiff.trace.file import Source, Steps, TraceFile
from kvdiff.trace.paths import PARTIAL_SUFFIX
from kvdiff.trace.format import (ChunkRecord, TraceMeta, dtype_name, latent_weight_path, norm_weight_path,
                                 router_bias_path, to_storage)

log = logging.getLogger(__name__)

_COMPRESSIONS = (None, "gzip", "lzf")
DEFAULT_QUEUED_BYTES = 256 << 20
DEFAULT_DEVICE_BYTES = 4 << 30          # and at most a quarter of the GPU's free memory


def _reason(exc: BaseException) -> str:
    """The OS's words for an I/O error, from an OSError or from HDF5's long error text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    found = re.search(r"error message = '([^']*)'", str(exc))
    return found.group(1) if found else (str(exc).splitlines() or [type(exc).__name__])[0]


def _write_error(exc: BaseException, path: Path) -> KvdiffError:
    """What the caller sees for an exception raised while writing: kvdiff's own errors as they are,
    others as a TraceWriteError caused by them."""
    if isinstance(exc, KvdiffError):
        return exc
    if isinstance(exc, OSError):
        error = TraceWriteError(f"cannot write trace {path}: {_reason(exc)}; "
                                "free space on its disk or write the trace to another folder")
    else:
        error = TraceWriteError(f"writing trace {path} failed: {type(exc).__name__}: {_reason(exc)} "
                                "(run with -v for details)")
    error.__cause__ = exc
    return error


class TraceWriter:
    """Writes one trace. Use as a context manager, or call `close()` / `abort()` yourself."""

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, compression: str | None = None,
                 max_queued_bytes: int = DEFAULT_QUEUED_BYTES, max_device_bytes: int | None = None,
                 max_positions: int | None = None, window_positions: int | None = None):
        """`max_device_bytes`: GPU memory that copies of large captures may hold until written;
        None: a quarter of the free memory of the GPU of the first such capture, at most
        DEFAULT_DEVICE_BYTES; 0: captures go to host memory at once.

        `max_positions`: the most positions the run can reach (prompt plus new tokens), if known.
        A short trace's HDF5 chunks are then no longer than that, so its file holds no room for
        rows that never come (a 44-token trace of the default model was 93 MB for 31 MB of rows).
        `window_positions`: a digest trace's zoom window of that many positions sizes its full rows' chunks."""
        if compression not in _COMPRESSIONS:
            raise TraceError(f"unknown compression {compression!r}: use none, gzip or lzf")
        if max_queued_bytes <= 0 or (max_device_bytes is not None and max_device_bytes < 0):
            raise TraceError(f"max_queued_bytes must be positive and max_device_bytes None or not negative, "
                             f"got {max_queued_bytes} and {max_device_bytes}")
        if max_positions is not None and max_positions <= 0:
            raise TraceError(f"max_positions must be positive or None, got {max_positions}")
        self.path = landing(path)
        if self.path.is_dir() or in_place(self.path):
            raise TraceError(f"cannot write trace {path}: it is a folder or not a regular file; give a file name")
        if not self.path.parent.is_dir():
            raise TraceError(f"cannot write trace {self.path}: folder {self.path.parent} does not exist")
        self.meta = meta
        self.compression = compression
        self.tmp_path = self.path.parent / f".{self.path.name}.{os.getpid()}{PARTIAL_SUFFIX}"
        try:
            self._file = TraceFile(self.tmp_path, meta, compression, max_positions, window_positions)
        except OSError as exc:
            raise TraceError(f"cannot write trace {self.path}: {_reason(exc)}") from exc
        self._provenance: list[Source] = []     # in the order reported
        self._steps: list[Steps] = []
        self._stage: Stage | None = None
        self._split = False                     # this forward's captures did not all go into one stage
        self._learning = True                   # the first forward: every staged capture cloned
        self._in_place: set[str] = set()        # captures the model changes in place: always cloned
        self._batch = StepBatch(self._file)          # used by the writer thread only
        self._bounce = Bounce()                      # likewise
        self._open = True
        self._device_bytes = max_device_bytes
        self._worker = SerialWorker(f"kvdiff-trace {self.path.name}", max_queued_bytes, max_device_bytes or 0)
        weakref.finalize(self, self._worker.cancel)     # a writer dropped unclosed ends its thread
        self._submit(self._file.create, 0)

    def _submit(self, job: Callable[[], None], nbytes: int, device_bytes: int = 0) -> None:
        if not self._open:
            raise TraceError(f"trace {self.path} is already closed or aborted")
        self._worker.submit(job, nbytes, device_bytes)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._worker.error is not None:
            self.abort()
            raise _write_error(self._worker.error, self.path)

    # -- rows --------------------------------------------------------------------------------

    def write_rows(self, group: str, point: str, positions: Sequence[int], rows: torch.Tensor,
                   row_shape: Sequence[int] | None = None) -> None:
        """Rows of `point` in `group` ('layers/<i>' or 'final') at global `positions`: (T, ...), or
        any shape holding T rows of `row_shape` (reshaped on the host, not with a device call)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        shape = (pos.size, *row_shape) if row_shape is not None else tuple(rows.shape)
        if rows.numel() != math.prod(shape) or shape[0] != pos.size:
            raise ProbeIntegrityError(f"{group}/{point}: rows of shape {tuple(rows.shape)} for {pos.size} positions")
        self.write_rows_at(f"{group}/{point}", pos, rows, shape)

    def write_rows_at(self, name: str, positions: np.ndarray, rows: torch.Tensor, shape: tuple[int, ...]) -> None:
        """`write_rows` for a caller that has checked that `rows` hold `shape` (len(positions), ...):
        rows of dataset `name` at int64 `positions`. The recorder's path, once per capture."""
        if Stage.takes(rows):
            stage = self._stage_for_captures()
            stage.rows.append((name, positions, stage.add(rows, shape, self._by_reference(name))))
            return
        self._commit_stage()   # rows staged earlier are written first: a later row replaces an earlier one
        self._split = True
        rows, file, steps, bounce = rows.reshape(shape), self._file, self._batch, self._bounce
        kept = self._device_copy(rows)
        host = host_copy(rows) if kept is None else None

        def job() -> None:
            steps.flush()
            pieces = kept.host_pieces(bounce) if kept is not None else [(0, host.ready())]
            for first, piece in pieces:
                data, torch_dtype = to_storage(piece)
                file.put(name, positions[first:first + data.shape[0]], data, torch_dtype)

        self._submit(job, 0 if host is None else host.tensor.nbytes, 0 if kept is None else kept.nbytes)

    def _device_copy(self, rows: torch.Tensor) -> DeviceRows | None:
        """A copy of large `rows` on their GPU, or None where they go to host memory: rows not on a
        GPU, more than the GPU memory allowed (`max_device_bytes`, fixed at the first capture on a
        GPU), or a copy the GPU has no memory for (from then on every capture goes to the host)."""
        if not rows.is_cuda or self._device_bytes == 0:
            return None
        if self._device_bytes is None:
            free, _ = torch.cuda.mem_get_info(rows.device)
            self._set_device_bytes(min(DEFAULT_DEVICE_BYTES, free // 4))
        if rows.nbytes > self._device_bytes:
            return None
        try:
            return DeviceRows(rows)
        except torch.cuda.OutOfMemoryError:
            log.info("no GPU memory for a %.0f MB capture of %s: captures go to host memory from here",
                     rows.nbytes / 1e6, self.path)
            self._set_device_bytes(0)
            return None

    def _set_device_bytes(self, nbytes: int) -> None:
        self._device_bytes = self._worker.max_device_bytes = nbytes

    def write_norm(self, group: str, norm: str, positions: Sequence[int], norm_input: torch.Tensor,
                   norm_output: torch.Tensor) -> None:
        """Statistics (norm_stats.norm_statistics) of norm module `norm` in `group` at `positions`,
        from its input and output rows (any leading shape): computed on the writer thread when the
        rows are few, on the rows' device when they are many."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        self.write_norm_at(f"{group}/norm_stats/{norm}", pos, norm_input, norm_output)

    def write_norm_at(self, name: str, positions: np.ndarray, norm_input: torch.Tensor,
                      norm_output: torch.Tensor) -> None:
        """`write_norm` into statistics group `name` at int64 `positions` (the recorder's path)."""
        x_shape = (norm_input.numel() // max(norm_input.shape[-1], 1), norm_input.shape[-1])
        y_shape = (norm_output.numel() // max(norm_output.shape[-1], 1), norm_output.shape[-1])
        if x_shape[0] != positions.size or y_shape[0] != positions.size:
            raise ProbeIntegrityError(f"{name}: {x_shape[0]} input and {y_shape[0]} output rows "
                                      f"for {positions.size} positions")
        if Stage.takes(norm_input) and Stage.takes(norm_output):
            stage = self._stage_for_captures()
            x_index = stage.add(norm_input, x_shape, self._by_reference(name + ":input"))
            y_index = stage.add(norm_output, y_shape, self._by_reference(name + ":output"))
            stage.norms.append((name, positions, x_index, y_index))
        else:
            self._commit_stage()
            self._split = True
            stats = host_copy(norm_statistics(norm_input.reshape(x_shape), norm_output.reshape(y_shape)))
            file, steps = self._file, self._batch
            self._submit(lambda: (steps.flush(), put_norm_stats(file, name, positions, stats.ready())),
                         stats.tensor.nbytes)

    def _stage_for_captures(self) -> Stage:
        """The stage to add captures to (committing a full one first)."""
        if not self._open:
            raise TraceError(f"trace {self.path} is already closed or aborted")
        self._raise_if_failed()
        if self._stage is None:
            self._stage = Stage()
        elif self._stage.full:
            self._commit_stage()
            self._split = True
            self._stage = Stage()
        return self._stage

    def _by_reference(self, name: str) -> bool:
        """Whether a staged capture of `name` is kept by reference until the end of the forward:
        not in the first forward, nor for captures the model was seen to change in place."""
        return not self._learning and name not in self._in_place

    def commit(self) -> StageLayout | None:
        """The end of a forward: hand the captures staged so far to the writer thread as one job.
        The first forward's captures are all cloned, and tell which kinds of capture the model
        changes in place before the end of a forward; those stay clones, the others are kept by
        reference until here.

        Returns the forward's layout, for `commit_repeat`, when every capture of the forward was
        staged in the one stage committed now and none needs to be cloned."""
        stage, whole = self._stage, not self._split
        self._commit_stage()
        self._learning, self._split = False, False
        return stage.layout() if stage is not None and whole and not self._in_place else None

    def commit_repeat(self, layout: StageLayout, captured: list[torch.Tensor], versions: list[int | None],
                      positions: np.ndarray) -> None:
        """`commit` for a forward whose captures, handed over together, repeat the forward that
        `commit` returned `layout` for: each at `positions`, kept by reference with its version
        counter when captured. The recorder's path for decode steps."""
        if self._stage is not None:
            raise ProbeIntegrityError("commit_repeat with captures staged one by one in the same forward")
        self._stage = Stage.repeat(layout, captured, versions, positions)
        self._commit_stage(layout, int(positions[0]))

    def _commit_stage(self, layout: StageLayout | None = None, position: int | None = None) -> None:
        stage, self._stage = self._stage, None
        if stage is None:
            return
        stale, moved = stage.changed()
        if moved or stale:
            names = {i: name for name, _, i in stage.rows}
            names.update((i, f"{name}:{part}") for name, _, x, y in stage.norms for part, i in (("input", x), ("output", y)))
            self._in_place.update(names[i] for i in moved)
            if stale:
                self.abort()
                raise ProbeIntegrityError(
                    f"the model changed the captured rows {names[stale[0]]} in place before its forward ended, "
                    "though not in its first forward, so they were not copied: the trace was dropped; "
                    "leave that point out of the capture to record this model")
        forward, steps = StagedForward(stage.rows, stage.norms, stage.seal(), layout, position), self._batch
        self._submit(lambda: steps.add(forward), stage.nbytes)

    def write_norm_weight(self, layer: int | None, norm: str, weight: torch.Tensor, eps: float) -> None:
        """A norm's weight (float32, or float64 for a float64 model) and epsilon."""
        self._write_weight(norm_weight_path(layer, norm), weight, eps=float(eps))

    def write_latent_weight(self, layer: int, weight: torch.Tensor) -> None:
        """Multi-head latent attention: the layer's kv_b_proj weight per head, (heads, nope + v, latent)
        (float32, or float64 for a float64 model), which expands a latent into each head's K and V."""
        self._write_weight(latent_weight_path(layer), weight)

    def write_router_bias(self, layer: int, bias: torch.Tensor) -> None:
        """DeepSeek's routing: the layer's e_score_correction_bias (num_experts,), added to the sigmoid
        scores to choose the experts."""
        self._write_weight(router_bias_path(layer), bias)

    def _write_weight(self, name: str, weight: torch.Tensor, **attrs: float) -> None:
        w = weight.detach().to("cpu", torch.float64 if weight.dtype == torch.float64 else torch.float32,
                               copy=True).numpy()
        file, dtype = self._file, dtype_name(weight.dtype)
        self._submit(lambda: file.put_weight(name, w, dtype, **attrs), w.nbytes)

    # -- steps and provenance ----------------------------------------------------------------

    def append_steps(self, steps: Sequence[tuple[int, int, int]], topk_ids: np.ndarray, topk_values: np.ndarray,
                     margins: Sequence[float]) -> None:
        """Generated steps, each (step, position, token id), with their top-k ids and values
        (n, k) and margins (n,): kept in memory (a few bytes a step), written at close."""
        n = len(steps)
        ids, values = np.array(topk_ids, np.int64), np.array(topk_values, np.float32)
        if n == 0 and ids.size == values.size == len(margins) == 0:
            return
        try:
            ids, values = ids.reshape(n, -1), values.reshape(n, -1)
            fits = ids.shape == values.shape and len(margins) == n
        except ValueError:          # not n rows (numpy cannot reshape a non-empty array to zero rows)
            fits = False
        if not fits:
            raise ProbeIntegrityError(f"{n} steps with top-k ids of shape {ids.shape}, values of shape {values.shape} "
                                      f"and {len(margins)} margins")
        self._steps.append((np.array(steps, np.int64).reshape(n, 3), ids, values, np.array(margins, np.float64)))

    def write_provenance(self, positions: Sequence[int], chunk: str, prefill_id: int,
                         encoded_positions: Sequence[int], reused: bool) -> None:
        """Where the K/V at `positions` came from; a later report for a position replaces an earlier one."""
        if len(encoded_positions) != len(positions):
            raise ProbeIntegrityError(
                f"provenance of chunk {chunk!r}: {len(encoded_positions)} encoded positions for {len(positions)} positions")
        if len(positions):
            self._provenance.append((np.array(positions, dtype=np.int64).reshape(-1), str(chunk), int(prefill_id),
                                     np.array(encoded_positions, dtype=np.int64).reshape(-1), bool(reused)))

    # -- closing -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every row handed over is in the file, and flush the file to the OS."""
        self._commit_stage()
        file, steps = self._file, self._batch
        self._submit(lambda: (steps.flush(), file.flush()), 0)
        self._worker.wait_idle()
        self._raise_if_failed()

    def close(self, generated_ids: Sequence[int] | None = None, text: str | None = None,
              chunks: Sequence[ChunkRecord] | None = None, kv_only_positions: Sequence[int] | None = None,
              key_only_positions: Sequence[int] | None = None) -> Path:
        """Finish the trace (optionally setting the generation's outcome) and rename it into place.

        `kv_only_positions`: positions whose K/V the run read from its cache without computing
        them; only the `k` and `v` datasets hold rows there (docs/trace-format.md).
        `key_only_positions`: a digest trace's positions before its window where the run kept only
        the k and v rows it computed (the keys attention read at the window's rows).
        """
        if generated_ids is not None:
            self.meta.generated_ids = np.asarray(generated_ids, dtype=np.int64)
        if text is not None:
            self.meta.text = text
        if chunks is not None:
            self.meta.chunks = list(chunks)
        if kv_only_positions is not None:
            self.meta.kv_only_positions = np.unique(np.asarray(kv_only_positions, dtype=np.int64))
        if key_only_positions is not None:
            self.meta.key_only_positions = np.unique(np.asarray(key_only_positions, dtype=np.int64))
        if not self._open:
            raise TraceError(f"trace {self.path} is already closed or aborted")
        try:
            self.commit()
            self._submit(self._batch.flush, 0)
            self._worker.stop()      # every row written; from here this thread alone uses the file
            self._raise_if_failed()
            n_positions = self._file.finish(self._steps, self._provenance)
            os.replace(self.tmp_path, self.path)
        except Exception as exc:
            self.abort()
            raise _write_error(exc, self.path)
        except BaseException:
            self.abort()
            raise
        self._open = False
        log.info("trace written: %s (%d positions, %.1f MB; peak write backlog %.0f MB in host memory, "
                 "%.0f MB on the GPU)", self.path, n_positions, self.path.stat().st_size / 1e6,
                 self._worker.peak_backlog / 1e6, self._worker.peak_device_backlog / 1e6)
        return self.path

    def abort(self) -> None:
        """Drop the unfinished trace: stop the writer thread, close and delete the temporary file."""
        self._open = False
        self._stage = None
        self._worker.cancel()
        self._batch.discard()
        self._file.discard()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._open:
            self.close()
