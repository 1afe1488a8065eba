"""Row-invariant linear layers on the CPU: a row's bits do not depend on the rows beside it.

A plain matmul is not enough: on an AVX-512 CPU (torch 2.13, MKL) a single row goes through
a gemv and gets other bits than in a matmul of many rows, and rows of a 1536-wide matmul change
bits between 32 and 1,177 rows. oneDNN's inner product (float32) gives a row the same bits in
any call of two rows or more (one row is padded to two), 2-3x faster than the forms below at
one row and at a thousand: it is used for every weight whose first call finds it so
(`OneDnnCheck`). Otherwise every gemm of one fixed shape is deterministic, so:

- more than SMALL_ROWS rows: one batched matmul of ROW_TILE-row tiles against the same
  (stride-0) weight, each tile a gemm of one shape whatever the number of tiles (two at least:
  a batch of one runs another kernel);
- up to SMALL_ROWS rows (a decode step): one matmul of the rows padded to SMALL_ROWS, which
  costs about a third of a 16-row tile for the small layers of a decode step.

The output embedding (the LM head) goes weight first instead (`weight_first_matmul`): a forward
applies it to a row or two, where the forms above cost 4x a plain matmul on its wide weight.

MKL's blocked kernels give both forms the same bits per row (each output a dot product in the
same order), but that is MKL's choice and not a promise: the first call for each weight
computes probe rows both ways, at every position of the small form, and keeps to the tiles
alone for that weight if any bit differs.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

# oneDNN's inner product is a private torch op: used where this torch has it, else MKL's forms
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

ROW_TILE = 16      # rows per tile of the batched form
SMALL_ROWS = 4     # at most this many rows: one matmul of exactly this many rows
HEAD_TILE = 4      # rows per tile of the weight-first form


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """`x` with zero rows appended up to a multiple of `multiple` rows (one device call)."""
    missing = -x.shape[0] % multiple
    if not missing:
        return x
    return nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, missing))


def _tiles(rows: torch.Tensor, tile: int) -> torch.Tensor:
    """`rows` (2-D) zero-padded to `tile`-row tiles, (tiles, tile, width), two tiles at least: a
    batched matmul of one tile runs another kernel than a batch of several (on an Intel Xeon,
    torch 2.11, a 16-row tile's rows 9-16 got other bits alone, for 1536 inputs)."""
    return pad_rows(rows, tile if rows.shape[0] > tile else 2 * tile).view(-1, tile, rows.shape[-1])


def tiled_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` (rows 2-D) as one batched matmul of ROW_TILE-row tiles (`_tiles`)."""
    tiles = _tiles(rows, ROW_TILE)
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], -1, -1))
    return out.reshape(-1, weight.shape[0])[:rows.shape[0]]


def weight_first_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` as `weight @ tile.T` for HEAD_TILE-row tiles, in one batched matmul: every
    tile is a gemm of one shape, so a row's bits do not depend on the rows beside it. For one row
    of SmolLM2's 49,152 x 576 head: 2.9 ms against 9.2 ms for the small form (2 cores, MKL); for
    2,455 rows 1.3x the row tiles, as every tile reads the whole weight (`_tiles`)."""
    tiles = _tiles(rows, HEAD_TILE)
    out = torch.bmm(weight.unsqueeze(0).expand(tiles.shape[0], -1, -1), tiles.transpose(1, 2))
    return out.transpose(1, 2).reshape(-1, weight.shape[0])[:rows.shape[0]]


def small_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` for at most SMALL_ROWS rows, as one matmul of exactly SMALL_ROWS rows."""
    return nn.functional.linear(pad_rows(rows, SMALL_ROWS), weight)[:rows.shape[0]]


class WeightCheck:
    """A form's agreement with row invariance, probed once for each weight layout (shape,
    strides, dtype, alignment) by `_probe`."""

    def __init__(self) -> None:
        self._agrees: dict[tuple, bool] = {}

    def agrees(self, weight: torch.Tensor) -> bool:
        key = (tuple(weight.shape), weight.stride(), weight.dtype, weight.data_ptr() % 64)
        known = self._agrees.get(key)
        if known is None:
            known = self._agrees[key] = self._probe(weight)
        return known

    @staticmethod
    def _probe(weight: torch.Tensor) -> bool:
        raise NotImplementedError


class SmallRowsCheck(WeightCheck):
    """Whether `small_matmul` gives a weight's rows the bits `tiled_matmul` gives them."""

    @staticmethod
    def _probe(weight: torch.Tensor) -> bool:
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn((SMALL_ROWS, weight.shape[1]), generator=gen).to(weight.dtype)
        tiled = tiled_matmul(probe, weight)
        same = torch.equal(small_matmul(probe, weight), tiled) and all(
            torch.equal(small_matmul(probe[i:i + 1], weight), tiled[i:i + 1]) for i in range(SMALL_ROWS))
        if not same:
            log.debug("small-row matmul differs from the tiles for a %s weight: tiles only", tuple(weight.shape))
        return same


_CHECK = SmallRowsCheck()


def onednn_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` through oneDNN's inner product, a single row padded to two (one row
    alone gets other bits); `weight` as it is or packed (`PackedWeights`), with the same bits.
    Always an inference call: rows that require grad make it a training call, which on an AVX2
    CPU (AMD EPYC) runs another kernel with other bits than the one `OneDnnCheck` probed."""
    rows = rows.detach()
    return torch.ops.mkldnn._linear_pointwise(pad_rows(rows, 2) if rows.shape[0] == 1 else rows, weight, None,
                                              "none", [], "")[:rows.shape[0]]


PACKED_BYTES = 1 << 30      # the most weight bytes one PackedWeights holds packed


class PackedWeights:
    """oneDNN's packed copies of weights, up to PACKED_BYTES: a linear then reads its weight as it
    is, where oneDNN packs an unpacked weight at every call (a decode step's linears 1.5x slower,
    a few-row prefill's 1.2-1.3x). A copy is made at a weight's first call and again when the
    weight is another tensor or was written in place since (its version; a write through `.data`
    leaves none, and an engine assumes fixed weights for its life, as its chunk cache does), and
    dropped with its weight; bits are the unpacked weight's (`OneDnnCheck` probes both).
    `PACKED` is the process's: every engine and reference run of a model share its copies."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._bytes = 0

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` packed, or itself once the copies would pass PACKED_BYTES."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        found = self._packed.get(id(weight))
        if found is not None and found[0] == key:
            return found[1]
        if found is None:
            size = weight.numel() * weight.element_size()
            if self._bytes + size > PACKED_BYTES:
                return weight
            self._bytes += size
            # before its id can name another tensor
            weakref.finalize(weight, self._drop, id(weight), size)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2)
        self._packed[id(weight)] = (key, packed)
        return packed

    def _drop(self, weight_id: int, size: int) -> None:
        self._packed.pop(weight_id, None)
        self._bytes -= size


PACKED = PackedWeights()


# (first row, rows) of the probe's calls, against all PROBE_ROWS rows in one call
PROBE_ROWS = 130
PROBE_CALLS = ((0, 1), (5, 1), (0, 2), (3, 3), (1, 4), (7, 5), (0, 16), (2, 17), (0, 64), (1, 65), (0, 129))


class OneDnnCheck(WeightCheck):
    """Whether a float32 weight gets row-invariant bits from `onednn_matmul`, unpacked and
    packed: probe rows one by one and in calls of 2 to 129 rows, against one call of all."""

    def agrees(self, weight: torch.Tensor) -> bool:
        return ONEDNN and weight.dtype == torch.float32 and super().agrees(weight)

    @staticmethod
    def _probe(weight: torch.Tensor) -> bool:
        probe = torch.randn((PROBE_ROWS, weight.shape[1]), generator=torch.Generator().manual_seed(0))
        whole = onednn_matmul(probe, weight)
        packed = PackedWeights().of(weight)
        same = all(torch.equal(onednn_matmul(probe[first:first + n], form), whole[first:first + n])
                   for first, n in PROBE_CALLS for form in (weight, packed))
        if not same:
            log.debug("oneDNN's rows differ between calls for a %s weight: MKL's forms", tuple(weight.shape))
        return same


_ONEDNN_CHECK = OneDnnCheck()


def cpu_invariant_matmul(rows: torch.Tensor, weight: torch.Tensor, weight_first: bool = False,
                         packed: PackedWeights | None = None) -> torch.Tensor:
    """`rows @ weight.T` (rows 2-D, on the CPU) with each row's bits independent of the others;
    `weight_first`: for a weight that sees a row or two a forward (the LM head), the weight-first
    form where oneDNN's does not apply; `packed`: where the weight's oneDNN packing is kept."""
    if _ONEDNN_CHECK.agrees(weight):
        return onednn_matmul(rows, weight if packed is None else packed.of(weight))
    if weight_first:
        return weight_first_matmul(rows, weight)
    if rows.shape[0] <= SMALL_ROWS and _CHECK.agrees(weight):
        return small_matmul(rows, weight)
    return tiled_matmul(rows, weight)
