"""Row digests: a 64-bit hash of each captured row's bits and two statistics, computed where the row is.

A digest trace keeps, for every probe point, layer and position, the row's hash and its `rms`
and `max_abs`; full rows only in a zoom window. Equal hashes are equal bits (up to a 2^-32
chance for a difference spread over many elements, a 0 chance for rows that differ in one
element). The statistics are computed in float64 and stored as float32, which holds `max_abs`
exactly (it is one of a float32, bfloat16 or float16 row's elements) and `rms` to 2^-24 of
itself; they bound the difference from below (analysis/digests.py), which tells a difference
beyond tolerance without the rows.

The hash of a row is sum_k w_k * m_k mod 2^64 over the row's bytes read as little-endian 64-bit
words w_k (two float32 elements a word; a row zero-padded to a multiple of 8 bytes; bfloat16
and float16 rows are widened to float32 first, exactly, so a row hashes the same whichever of
them an engine keeps it in, a NaN among them as the one CANONICAL_NAN), with m_k odd multipliers drawn from k alone (splitmix64), so a
row's hash does not depend on the device, the batch or which other rows were hashed with it:
the engines' traces and kvdiff's compare. The words are a view of the row, not a widened copy:
the hash reads each byte once. `ROW_HASH` names this hash in the traces, which older ones
(each element widened to its own word) do not.
"""

from __future__ import annotations

import functools
import math

import torch

DIGEST_STATS = ("rms", "max_abs")
_GOLDEN = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64
_MIX1, _MIX2 = -4658895280553007687, -7723592293110705685    # splitmix64's constants as int64
_multipliers: dict[tuple[int, torch.device], torch.Tensor] = {}
_bases: dict[tuple[int, ...], torch.Tensor] = {}       # gathered_row_digests' tables' addresses, on their device
BLOCK_ELEMENTS = 1 << 24          # rows hashed together on a GPU
HOST_BLOCK_ELEMENTS = 1 << 18     # on the host: temporaries that stay in cache and in the heap
CANONICAL_NAN = 0x7FC00000        # the bits a widened 16-bit NaN hashes as
ROW_HASH = "le-words64-splitmix"      # the /digests group's `row_hash`: how its rows were hashed


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits with zeros shifted in (torch's >> on int64 keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def multipliers(width: int, device: torch.device) -> torch.Tensor:
    """The odd int64 multipliers m_0..m_{width-1} (splitmix64 of the column index), cached per device."""
    key = (width, torch.device(device))
    found = _multipliers.get(key)
    if found is None or found.numel() < width:
        x = (torch.arange(1, width + 1, dtype=torch.int64, device=device) * _GOLDEN)
        x = (x ^ _logical_shift(x, 30)) * _MIX1
        x = (x ^ _logical_shift(x, 27)) * _MIX2
        found = _multipliers[key] = (x ^ _logical_shift(x, 31)) | 1
    return found[:width]


def flat_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (T, ...) as T flat rows (T, width), zero rows too (where `reshape(T, -1)` cannot)."""
    return rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))


def row_digests(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hash int64 (T,), statistics float32 (T, 2): rms and max_abs) of the T rows of `rows`
    (T, ...), on the rows' device; rows are flattened to T vectors. Hashed a block of rows at a
    time: the temporaries take 12 bytes a float32 element (a 32k-token prompt's logits are GBs)."""
    flat = flat_rows(rows.detach())
    if flat.shape[1] == 0:
        zeros = torch.zeros(flat.shape[0], device=flat.device)
        return torch.zeros(flat.shape[0], dtype=torch.int64, device=flat.device), torch.stack([zeros, zeros], 1)
    if flat.is_cuda and flat.dtype in (torch.float32, torch.bfloat16, torch.float16) and _gpu_kernel() is not None:
        return _gpu_kernel().row_digests(flat, multipliers((flat.shape[1] + 1) // 2, flat.device), CANONICAL_NAN)
    step = max(1, (BLOCK_ELEMENTS if flat.is_cuda else HOST_BLOCK_ELEMENTS) // flat.shape[1])
    if flat.shape[0] > step:
        parts = [_block_digests(flat[i:i + step]) for i in range(0, flat.shape[0], step)]
        return torch.cat([h for h, _ in parts]), torch.cat([s for _, s in parts])
    return _block_digests(flat)


def gathered_row_digests(tables: list[torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_digests` of the rows at `slots` of each of `tables` (one dtype and row shape, a KV
    cache's layers): hashes (len(slots), len(tables)) and statistics (..., 2). On a GPU one
    launch reads the rows where they are (no copy out of the cache: inside a CUDA graph's decode
    step, 2 kernels a layer fewer); else the rows are gathered first."""
    first = tables[0]
    kernel = _gpu_kernel() if first.is_cuda else None
    if (kernel is None or first.dtype not in kernel.TRITON_DTYPES or first[0].numel() == 0
            or any(not t[0].is_contiguous() or t.stride() != first.stride() or t.shape[1:] != first.shape[1:]
                   or t.dtype != first.dtype for t in tables)):
        digests = [row_digests(t.index_select(0, slots.to(t.device))) for t in tables]
        return torch.stack([h for h, _ in digests], 1), torch.stack([s for _, s in digests], 1)
    key = tuple(t.data_ptr() for t in tables)
    bases = _bases.get(key)
    if bases is None:       # made outside a graph's capture (its warm-up step), where a copy from the host may run
        bases = _bases[key] = torch.tensor(key, dtype=torch.int64, device=first.device)
    return kernel.gathered_row_digests(tables, bases, slots, multipliers((first[0].numel() + 1) // 2, first.device),
                                       CANONICAL_NAN)


@functools.lru_cache(maxsize=1)
def _gpu_kernel():
    """trace/hash_kernel, imported at the first digest on a GPU (it imports Triton); None without Triton."""
    from kvdiff.trace import hash_kernel
    return hash_kernel if hash_kernel.available else None


def _widened(flat: torch.Tensor) -> torch.Tensor:
    """16-bit rows as float32, exactly (a row hashes by its values, as the diff compares float32
    rows), every NaN as CANONICAL_NAN: devices widen a NaN's payload differently."""
    flat = flat.float()
    return torch.where(flat.isnan(), CANONICAL_NAN, flat.view(torch.int32)).view(torch.float32)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of each row of `flat` (T, W) as little-endian int64 words, a row zero-padded to a
    multiple of 8 bytes. A row of 8-byte multiples is viewed in place; others are copied."""
    nbytes = flat.shape[1] * flat.element_size()
    if nbytes % 8 == 0:
        try:
            return flat.view(torch.int64)
        except RuntimeError:        # a view whose offset or row stride is not a whole word
            return flat.contiguous().view(torch.int64)
    padded = torch.zeros(flat.shape[0], nbytes + 8 - nbytes % 8, dtype=torch.uint8, device=flat.device)
    padded[:, :nbytes] = flat.contiguous().view(torch.uint8)
    return padded.view(torch.int64)


def _block_digests(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = _widened(flat)
    words = _words(flat)
    hashes = (words * multipliers(words.shape[1], flat.device)).sum(1)
    values = flat.double()          # exact; vector_norm(dtype=float64) converts element by element, 4-8x slower
    stats = torch.empty(flat.shape[0], len(DIGEST_STATS), dtype=torch.float32, device=flat.device)
    # written into place: few kernels (on a GPU each costs more host time than its rows)
    torch.div(torch.linalg.vector_norm(values, dim=1), flat.shape[1] ** 0.5, out=stats[:, 0])
    # the largest magnitude is one of the row's elements: read from the row itself, not its float64 copy
    stats[:, 1] = (flat if flat.is_floating_point() else values).abs().amax(1)
    return hashes, stats


STAGE_BYTES = 1 << 27     # a stage: large captures of one row width and dtype, copied in and hashed together
STAGE_CAPTURES = 32       # and at most this many captures of the first one's rows (a forward's are all alike)


class _Stage:
    """A buffer that captures of one row width, dtype and device are copied into, and the
    captures in it: (index in the batch, first row, rows)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.filled = buffer, 0
        self.members: list[tuple[int, int, int]] = []


class DigestBatch:
    """The captures of one forward, hashed a few launches at a time rather than one (or, on the
    host, a few torch calls) each: a decode step hands over hundreds of one-row captures, and
    a GPU prefill hundreds of large ones, whose launches cost more host time than the GPU
    takes to hash them. `add` keeps small captures by reference until `digests()` (the caller
    copies one the model may change in place before the forward ends); `stage` copies a large
    one into a stage of its row width, hashed in one launch whenever it is full."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor | None] = []      # None: staged
        self._stages: dict[tuple[int, torch.dtype, torch.device], _Stage] = {}
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}     # digests of staged captures hashed

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, rows: torch.Tensor) -> int:
        """Keep `rows` (T, ...) until `digests()`; returns its index there."""
        rows = rows.detach()
        self._rows.append(rows if rows.dim() == 2 else flat_rows(rows))
        return len(self._rows) - 1

    def stage(self, rows: torch.Tensor) -> int | None:
        """Copy `rows` (T, ...) into the stage of its row width and dtype; returns its index in
        `digests()`, or None (nothing kept) where it has no rows or would not fit a stage of STAGE_BYTES."""
        flat = flat_rows(rows.detach())
        width = flat.shape[1]
        capacity = STAGE_BYTES // max(1, width * flat.element_size())
        if not 0 < flat.shape[0] <= capacity or width == 0:
            return None
        key, n = (width, flat.dtype, flat.device), flat.shape[0]
        stage = self._stages.get(key)
        if stage is not None and stage.filled + n > stage.buffer.shape[0]:
            self._hash_stage(stage)
            stage = stage if n <= stage.buffer.shape[0] else None
        if stage is None:
            rows_held = min(capacity, n * STAGE_CAPTURES)
            stage = self._stages[key] = _Stage(torch.empty(rows_held, width, dtype=flat.dtype, device=flat.device))
        stage.buffer[stage.filled:stage.filled + n].copy_(flat)
        stage.members.append((len(self._rows), stage.filled, n))
        stage.filled += n
        self._rows.append(None)
        return len(self._rows) - 1

    def _hash_stage(self, stage: _Stage) -> None:
        """Hash a stage's rows (one launch on a GPU) and empty it; a later copy into it runs after
        the hash on the device's stream."""
        hashes, stats = row_digests(stage.buffer[:stage.filled])
        for i, first, n in stage.members:
            self._staged[i] = hashes[first:first + n], stats[first:first + n]
        stage.members, stage.filled = [], 0

    def digests(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each capture's `row_digests`, in the order added; empties the batch (and lets its
        stages' buffers go)."""
        for stage in self._stages.values():
            if stage.filled:
                self._hash_stage(stage)
        groups: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
        for i, rows in enumerate(self._rows):
            if rows is not None:
                groups.setdefault((rows.shape[1], rows.dtype, rows.device), []).append(i)
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [self._staged.get(i) for i in range(len(self._rows))]
        for members in groups.values():
            parts = [self._rows[i] for i in members]
            hashes, stats = row_digests(torch.cat(parts) if len(parts) > 1 else parts[0])
            for i, h, s in zip(members, hashes.split([p.shape[0] for p in parts]),
                               stats.split([p.shape[0] for p in parts])):
                out[i] = h, s
        self._rows, self._stages, self._staged = [], {}, {}
        return out
