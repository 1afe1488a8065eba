"""Array-level pieces of the analyzer: metrics, tolerances, RoPE geometry, attention mass, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvdiff.analysis.attention import span_attention
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.norms import same_norm
from kvdiff.analysis.rope import estimate_positions, estimate_thetas, rotate
from synthetic import Faults, SyntheticModel, rope, write_trace
from kvdiff.analysis.tolerance import DTYPE_DEFAULTS, Tier, Tolerance, Tolerances, parse_tolerance
from kvdiff.cli import app
from kvdiff.errors import InputError


def test_rel_is_exact_for_last_bit_differences_and_matches_the_definition():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 100
    y = x.copy()
    y[1, 3] = np.nextafter(y[1, 3], np.float32(np.inf))
    y[2] = -x[2]
    y[3] = x[3] * 1.5
    m = row_metrics(x, y)
    assert m.bitwise.tolist() == [True, False, False, False]
    assert m.rel[0] == 0 and 0 < m.rel[1] < 1e-12
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    literal = 1 - 2 * (xd * yd).sum(1) / ((xd ** 2).sum(1) + (yd ** 2).sum(1))
    assert np.allclose(m.rel[2:], literal[2:], rtol=1e-12) and m.rel[2] == pytest.approx(2.0)
    assert m.cosine[2] == pytest.approx(-1.0) and m.cosine[3] == pytest.approx(1.0)
    assert m.max_abs[3] == pytest.approx(np.abs(x[3]).max() * 0.5, rel=1e-6)


def test_tiers_scale_the_tolerance_by_the_row_not_the_element():
    x = np.array([[1000.0, 1e-3], [1.0, 1e-3]], dtype=np.float32)
    y = x + np.array([[0.0, 2e-3], [0.0, 2e-3]], dtype=np.float32)   # 2e-3 on a tiny element
    tiers = row_metrics(x, y).tiers(DTYPE_DEFAULTS["float32"])
    assert tiers.tolist() == [Tier.NOISE, Tier.DIVERGENT]            # noise next to 1000, not next to 1


def test_non_finite_rows_are_divergent_and_flagged_per_trace():
    x = np.ones((2, 4), dtype=np.float32)
    y = x.copy()
    y[1, 0] = np.nan
    m = row_metrics(x, y)
    assert m.tiers(Tolerance(1.0, 1.0)).tolist() == [Tier.BITWISE, Tier.DIVERGENT]
    assert m.ref_finite.all() and m.cand_finite.tolist() == [True, False] and np.isnan(m.rel[1])


def test_tolerance_parsing_and_dtype_defaults():
    assert parse_tolerance("logits=1e-4,1e-3") == ("logits", Tolerance(1e-4, 1e-3))
    assert parse_tolerance("k=0.5") == ("k", Tolerance(0.5, 0.0))
    for bad in ("logits", "logits=x", "nope=1", "k=1,2,3", "k=-1"):
        with pytest.raises(InputError):
            parse_tolerance(bad)
    tols = Tolerances.for_dtypes("float32", "bfloat16", overrides={"q": Tolerance(0, 0)})
    assert tols.default == DTYPE_DEFAULTS["bfloat16"] and tols.for_point("q") == Tolerance(0, 0)


@pytest.mark.parametrize("base", [10000.0, 100000.0])
def test_rope_frequencies_and_encoded_positions_are_read_back_without_the_base(base):
    g = torch.Generator().manual_seed(0)
    k_pre = torch.randn(40, 3, 64, generator=g)
    k = rope(k_pre, torch.arange(40), base).numpy()
    thetas = estimate_thetas(k_pre.numpy(), k, np.arange(40))
    assert np.allclose(thetas, base ** (-np.arange(0, 64, 2) / 64), rtol=1e-4, atol=1e-7)
    shifted = rope(k_pre[16:28], torch.arange(12) + 1000, base).numpy()
    pos, quality = estimate_positions(k_pre[16:28].numpy(), shifted, thetas, 4096)
    assert pos.tolist() == list(range(1000, 1012)) and quality.min() > 0.999
    back = rotate(shifted, np.full(12, -1000.0), thetas)
    assert np.allclose(back, rope(k_pre[16:28], torch.arange(12), base).numpy(), atol=1e-4)


def test_rope_frequencies_are_read_past_rows_rotated_one_position_on():
    """The reference's own decode rows encoded one position on (a bug in every run: red-team round 5,
    t12) bent the least-squares line: thetas 0.24% off, and cached keys rotated exactly one position
    on fit no integer position."""
    g = torch.Generator().manual_seed(0)
    k_pre = torch.randn(134, 3, 64, generator=g)
    positions = torch.arange(134)
    k = rope(k_pre, torch.where(positions >= 96, positions + 1, positions), 100000.0).numpy()
    thetas = estimate_thetas(k_pre.numpy(), k, positions.numpy())
    assert np.allclose(thetas, 100000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-5, atol=1e-8)
    _, quality = estimate_positions(k_pre[88:96].numpy(), rope(k_pre[88:96], positions[88:96] + 1, 100000.0).numpy(),
                                    thetas, 4096)
    assert quality.min() > 0.99999


def test_attention_mass_matches_a_direct_softmax_with_gqa():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    mass, _ = span_attention(q.numpy(), k.numpy(), v.numpy(), np.arange(6), np.array([5, 2]), (0, 1), 8 ** -0.5)
    kk = k.repeat_interleave(2, 1)
    w = (torch.einsum("hd,shd->hs", q[5].double(), kk.double()) * 8 ** -0.5).softmax(-1)
    assert mass[0] == pytest.approx(float(w[:, :2].sum(1).mean()))
    w2 = (torch.einsum("hd,shd->hs", q[2].double(), kk[:3].double()) * 8 ** -0.5).softmax(-1)
    assert mass[1] == pytest.approx(float(w2[:, :2].sum(1).mean()))


def test_attention_shift_is_the_relative_move_of_a_direct_attention_output_with_gqa():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    _, shift = span_attention(q.numpy(), k.numpy(), v.numpy(), np.arange(6), np.array([5, 2, 1]), (0, 1), 8 ** -0.5)
    kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()

    def out(row: int, keys: slice) -> torch.Tensor:
        w = (torch.einsum("hd,shd->hs", q[row].double(), kk[keys]) * 8 ** -0.5).softmax(-1)
        return torch.einsum("hs,shd->hd", w, vv[keys])

    full, without = out(5, slice(0, 6)), out(5, slice(2, 6))
    assert shift[0] == pytest.approx(float((without - full).norm() / full.norm()))
    assert shift[1] == pytest.approx(float((out(2, slice(2, 3)) - out(2, slice(0, 3))).norm() / out(2, slice(0, 3)).norm()))
    assert shift[2] == 1.0                        # every key it sees is left out


def test_same_norm_compares_eps_and_weights_rounded_to_the_less_precise_dtype():
    w = np.array([1.0, 1.0001, 0.3], dtype=np.float32)
    half = torch.from_numpy(w).half().numpy()
    assert same_norm((w, 1e-5, "float32"), (w.copy(), 1e-5, "float32"))
    assert same_norm((w, 1e-5, "float32"), (half, 1e-5, "float16"))
    assert same_norm((half, 1e-5, "float16"), (w, 1e-5, "float32"))
    assert not same_norm((w, 1e-5, "float32"), (half, 1e-6, "float16"))              # eps
    assert not same_norm((w, 1e-5, "float32"), (w * 2, 1e-5, "float32"))             # weights
    assert not same_norm((w, 1e-5, "float32"), (half * 2, 1e-5, "float16"))
    assert same_norm((half, 1e-5, "float16"), (w, 1e-5, "bfloat16")) is None           # two half precisions
    assert same_norm(None, (w, 1e-5, "float32")) is None


def test_cli_diff_exit_codes_and_json(tmp_path):
    model = SyntheticModel(layers=2, seed=2)
    prompt = list(range(3, 23))
    ref = write_trace(model, tmp_path / "r.h5", prompt, 3)
    same = write_trace(model, tmp_path / "s.h5", prompt, 3)
    cand = write_trace(model, tmp_path / "c.h5", prompt, 3, faults=Faults(context_start={p: 10 for p in range(10, 20)}))
    runner = CliRunner()
    ok = runner.invoke(app, ["diff", str(ref), str(same)])
    assert ok.exit_code == 0 and "IDENTICAL" in ok.output
    out = tmp_path / "report.json"
    page = tmp_path / "report.html"
    bad = runner.invoke(app, ["diff", str(ref), str(cand), "--json", str(out), "--html", str(page),
                              "--tolerance", "logits=1e-4,1e-3"])
    report = json.loads(out.read_text())
    assert page.read_text().lower().startswith("<!doctype html>")
    assert bad.exit_code == (0 if report["tokens_identical"] else 1)
    assert report["first_divergence"]["tensor"] == "z" and "missing_context" in bad.output
    assert report["tolerances"]["per_point"]["logits"] == {"atol": 1e-4, "rtol": 1e-3}
    usage = runner.invoke(app, ["diff", str(ref), str(same), "--tolerance", "bogus=1"])
    assert usage.exit_code == 2
