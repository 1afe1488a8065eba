"""Row invariance of exact numerics' CPU linear: a row's bits whatever rows come with it."""

from __future__ import annotations

import gc

import pytest
import torch

from kvdiff.engine import cpu_linear
from kvdiff.engine.invariant_linear import invariant_linear

# (out, in) of every linear of the default model (SmolLM2-135M): q/o, k/v, up/gate, down, lm_head
DEFAULT_MODEL_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
BATCHES = (1, 2, 17, 100)
ALL_ROWS = 2000
# whether this CPU's oneDNN gives a row the same bits in any call (AMD EPYC: yes; the GPU hosts' Intel
# Xeon with torch 2.11: no, so exact numerics keep to MKL's forms there and these tests of oneDNN's
# own forms have nothing to check)
ONEDNN_INVARIANT = cpu_linear.ONEDNN and cpu_linear.OneDnnCheck().agrees(
    torch.randn((96, 576), generator=torch.Generator().manual_seed(0)))


def row_invariance_failures(linear, weight: torch.Tensor, rows: torch.Tensor) -> list[tuple[int, int]]:
    """(batch size, first row) of every batch of `rows` whose results differ in any bit from the
    same rows computed in one batch of all of them; batches at the start, end and in between."""
    whole = linear(rows, weight)
    failures = []
    for size in BATCHES:
        for first in sorted({0, 1, 3, 15, 16, 17, 101, 999, len(rows) - size}):
            if not torch.equal(linear(rows[first:first + size], weight), whole[first:first + size]):
                failures.append((size, first))
    return failures


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mkl"])
@pytest.mark.parametrize("shape", DEFAULT_MODEL_SHAPES, ids=lambda s: "%dx%d" % s)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(shape, onednn, monkeypatch):
    monkeypatch.setattr(cpu_linear, "ONEDNN", cpu_linear.ONEDNN and onednn)
    torch.manual_seed(0)
    weight = torch.randn(shape)
    rows = torch.randn(ALL_ROWS, shape[1])
    assert row_invariance_failures(invariant_linear, weight, rows) == []


@pytest.mark.parametrize("shape", [(32, 64), (192, 576)], ids=lambda s: "%dx%d" % s)
def test_rows_that_require_grad_get_the_bits_of_rows_that_do_not(shape):
    """A model run with grad enabled (transformers' forward outside no_grad) hands its linears
    rows that require grad: on an AVX2 CPU oneDNN then ran a training kernel with other bits
    than the inference kernel the engine's rows and the row-invariance probe get."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(shape))
    packed = cpu_linear.PackedWeights()
    rows = torch.randn(35, shape[1])
    plain = invariant_linear(rows, weight, packed=packed)
    assert torch.equal(invariant_linear(rows.clone().requires_grad_(), weight, packed=packed), plain)
    assert torch.equal(invariant_linear(rows.clone().requires_grad_(), weight), plain)


@pytest.mark.parametrize("shape", [(49152, 576), (576, 576)], ids=lambda s: "%dx%d" % s)
def test_the_weight_first_form_of_the_lm_head_is_row_invariant_too(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    rows = torch.randn(ALL_ROWS, shape[1])

    def head(x, w):
        return invariant_linear(x, w, weight_first=True)

    assert row_invariance_failures(head, weight, rows) == []
    torch.testing.assert_close(head(rows[:5], weight), rows[:5] @ weight.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form, tile", [(cpu_linear.tiled_matmul, cpu_linear.ROW_TILE),
                                        (cpu_linear.weight_first_matmul, cpu_linear.HEAD_TILE)])
def test_one_tile_of_rows_is_multiplied_in_a_batch_of_two_as_many_tiles_are(form, tile, monkeypatch):
    """A batched matmul of one tile runs another kernel than a batch of several: on an Intel Xeon
    (torch 2.11) a 16-row tile of 1536-wide rows got other bits in rows 9-16 alone than in a batch,
    which broke exact numerics' row invariance there (this AMD CPU gives the same bits either way,
    so the batch sizes are what is checked here, and the bits)."""
    batches = []
    bmm = torch.bmm

    def counted(a, b):
        batches.append(a.shape[0])
        return bmm(a, b)

    monkeypatch.setattr(torch, "bmm", counted)
    torch.manual_seed(0)
    weight, rows = torch.randn(96, 1536), torch.randn(3 * tile, 1536)
    whole = form(rows, weight)
    for n in range(1, 2 * tile + 1):
        batches.clear()
        assert torch.equal(form(rows[:n], weight), whole[:n]), n
        assert batches == [max(2, -(-n // tile))], n


def test_exact_numerics_take_the_lm_head_weight_first_where_onednn_does_not_apply(tiny_llama, monkeypatch):
    from kvdiff.engine.numerics import patched_forwards

    model = tiny_llama[0]
    head = model.get_output_embeddings()
    forwards = dict((id(m), f) for m, f in patched_forwards(model))
    rows = torch.randn(3, head.weight.shape[1])
    layer = model.model.layers[0].self_attn.q_proj
    for onednn in (ONEDNN_INVARIANT, False):
        monkeypatch.setattr(cpu_linear, "ONEDNN", onednn)
        head_form = cpu_linear.onednn_matmul if onednn else cpu_linear.weight_first_matmul
        assert torch.equal(forwards[id(head)](rows), head_form(rows, head.weight))
        assert torch.equal(forwards[id(layer)](rows), cpu_linear.onednn_matmul(rows, layer.weight) if onednn
                           else cpu_linear.small_matmul(rows, layer.weight))


@pytest.mark.skipif(not ONEDNN_INVARIANT, reason="this CPU's oneDNN inner product is not row-invariant (or absent)")
def test_onednn_with_other_bits_for_some_row_count_is_not_used(monkeypatch):
    # the first call for a weight finds a call of 17 rows giving other bits and keeps to MKL's forms
    monkeypatch.setattr(cpu_linear, "_ONEDNN_CHECK", cpu_linear.OneDnnCheck())
    plain = cpu_linear.onednn_matmul
    monkeypatch.setattr(cpu_linear, "onednn_matmul",
                        lambda rows, weight: plain(rows, weight) * (1 + 2 ** -20 * (rows.shape[0] == 17)))
    torch.manual_seed(0)
    weight = torch.randn(96, 576)
    assert not cpu_linear._ONEDNN_CHECK.agrees(weight)
    assert cpu_linear.OneDnnCheck().agrees(torch.randn(96, 576)) is False      # (the same perturbed form)
    monkeypatch.setattr(cpu_linear, "onednn_matmul", plain)
    assert cpu_linear.OneDnnCheck().agrees(weight)
    assert row_invariance_failures(invariant_linear, weight, torch.randn(300, 576)) == []


def test_a_small_form_with_other_bits_is_not_used(monkeypatch):
    # the first call for a weight finds the small form's bits differ and keeps to the tiles
    monkeypatch.setattr(cpu_linear, "ONEDNN", False)
    monkeypatch.setattr(cpu_linear, "_CHECK", cpu_linear.SmallRowsCheck())
    plain = cpu_linear.small_matmul
    monkeypatch.setattr(cpu_linear, "small_matmul", lambda rows, weight: plain(rows, weight) * (1 + 2 ** -20))
    torch.manual_seed(0)
    weight = torch.randn(96, 576)
    rows = torch.randn(300, 576)
    assert not cpu_linear._CHECK.agrees(weight)
    assert row_invariance_failures(invariant_linear, weight, rows) == []


def test_row_tiles_are_kept_for_the_same_input_and_remade_when_it_changes():
    """A linear's input as whole tiles: a row repeated, rows zero-padded; the same tensor at the
    same version gets the tiles made for it, a changed or another tensor new ones."""
    from kvdiff.engine.row_tiles import row_tiles

    x = torch.randn(1, 1, 8)
    tiles = row_tiles(x, 4)
    assert tiles.shape == (1, 4, 8) and torch.equal(tiles, x.expand(1, 4, 8))
    assert row_tiles(x, 4) is tiles
    x.mul_(2)
    assert torch.equal(row_tiles(x, 4), x.expand(1, 4, 8))
    rows = torch.randn(2, 3, 8)
    padded = row_tiles(rows, 4)
    assert padded.shape == (8, 8) and torch.equal(padded[:6], rows.reshape(6, 8)) and not padded[6:].any()
    assert row_tiles(rows.clone(), 4) is not padded
    with torch.inference_mode():
        frozen = torch.randn(5, 8)
    assert row_tiles(frozen, 4) is row_tiles(frozen, 4)


def test_rows_made_with_spare_rows_are_read_as_tiles_in_place():
    """An output made by `with_spare_rows` (exact RMSNorm and attention on CUDA) is read by the
    next linear as its whole tiles without a copy, also through a contiguous view (attention's
    (T, H, D) reshaped to (T, H * D)); a view that does not start at its first row is copied."""
    from kvdiff.engine.row_tiles import row_tiles, with_spare_rows

    rows = with_spare_rows((6, 2, 4), torch.float32, torch.device("cpu"), 4)
    rows.copy_(torch.randn(6, 2, 4))
    flat = rows.reshape(6, 8)
    tiles = row_tiles(flat, 4)
    assert tiles.shape == (8, 8) and tiles.data_ptr() == flat.data_ptr() and torch.equal(tiles[:6], flat)
    one = with_spare_rows((1, 8), torch.float32, torch.device("cpu"), 4)
    one.fill_(3.0)
    step = one.view(1, 1, 8)
    assert row_tiles(step, 4).shape == (1, 4, 8) and row_tiles(step, 4).data_ptr() == one.data_ptr()
    later = flat[1:]
    assert torch.equal(row_tiles(later, 4)[:5], later) and row_tiles(later, 4).data_ptr() != flat.data_ptr()


@pytest.mark.skipif(not ONEDNN_INVARIANT, reason="this CPU's oneDNN inner product is not row-invariant (or absent)")
def test_packed_weights_follow_their_weight_keep_its_bits_and_stop_at_their_budget(monkeypatch):
    torch.manual_seed(0)
    weight, rows = torch.randn(96, 576), torch.randn(5, 576)
    packed = cpu_linear.PackedWeights()
    first = packed.of(weight)
    assert packed.of(weight) is first
    assert torch.equal(cpu_linear.onednn_matmul(rows, first), cpu_linear.onednn_matmul(rows, weight))
    weight.mul_(2)          # written in place: packed again
    again = packed.of(weight)
    assert again is not first
    assert torch.equal(cpu_linear.onednn_matmul(rows[:1], again), cpu_linear.onednn_matmul(rows[:1], weight))
    monkeypatch.setattr(cpu_linear, "PACKED_BYTES", 96 * 576 * 4 + 1)
    assert cpu_linear.PackedWeights().of(weight) is not weight
    full = cpu_linear.PackedWeights()
    full.of(weight)
    other = torch.randn(96, 576)
    assert full.of(other) is other          # past the budget: the weight as it is


@pytest.mark.skipif(not cpu_linear.ONEDNN, reason="this torch has no oneDNN inner product")
def test_a_packed_copy_is_dropped_with_its_weight():
    """The process's store (`PACKED`) keys copies by the weight's id: a dead weight's copy must go
    before its id can name another tensor, and give its bytes back to the budget."""
    store = cpu_linear.PackedWeights()
    weight = torch.randn(96, 576)
    store.of(weight)
    assert store._bytes == 96 * 576 * 4
    del weight
    gc.collect()
    assert store._bytes == 0 and not store._packed
