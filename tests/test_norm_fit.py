"""norm_fit: what a norm ran with, fitted from its rows (expectations written before the first run)."""

import numpy as np
import pytest

from kvdiff.analysis.norm_fit import declared_difference, fit_norm
from kvdiff.analysis.norms import RECOMPUTE_FLOAT32, recompute_rms_norm

RNG = np.random.default_rng(0)
X = RNG.standard_normal((12, 64)).astype(np.float32) * 0.05     # small rows: eps matters
W = (1 + 0.1 * RNG.standard_normal(64)).astype(np.float32)
EPS = 1e-6


@pytest.mark.parametrize("form, out, value", [
    ("eps", recompute_rms_norm(X, W, 1e-2, "float32"), 1e-2),
    ("one plus weight", recompute_rms_norm(X, 1 + W, EPS, "float32"), None),
    ("no weight", recompute_rms_norm(X, np.ones_like(W), EPS, "float32"), None),
    ("skipped", X, None),
    ("scaled", recompute_rms_norm(X, W, EPS, "float32") * 1.02, 1.02),
])
def test_each_form_is_named_with_its_value(form, out, value):
    fit = fit_norm(X, out, W, EPS, "float32", RECOMPUTE_FLOAT32)
    assert fit is not None and fit.form == form
    if value is None:
        assert fit.value is None
    else:
        assert fit.value == pytest.approx(value, rel=1e-3)
    assert fit.rel <= 1e-5


def test_an_unrelated_output_fits_no_form():
    assert fit_norm(X, RNG.standard_normal(X.shape).astype(np.float32), W, EPS, "float32", RECOMPUTE_FLOAT32) is None


def test_declared_differences_in_words():
    assert declared_difference((W, EPS), (W, 1e-2)) == "eps 1e-06 -> 0.01"
    assert declared_difference((W, EPS), (W + 1, EPS)) == "weight + 1 at every element"
    assert declared_difference((W, EPS), (W * 2, EPS)) == "weight x 2 at every element"
    w = W.copy()
    w[3] += 0.5
    assert declared_difference((W, EPS), (w, 1e-5)) == "eps 1e-06 -> 1e-05; weight differs at 1 of 64 elements (max abs 0.5)"
    assert declared_difference((W, EPS), (W[:32], EPS)) == "weight of 32 elements where the reference's has 64"
    assert declared_difference((W, EPS), (W, EPS)) == ""
