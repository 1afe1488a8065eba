"""The diff streams: its peak memory stays under twice one layer's data, logits included."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import kvdiff
from kvdiff.trace import open_trace
from synthetic import Faults, SyntheticModel, write_trace

POSITIONS, VOCAB = 1500, 8192


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = SyntheticModel(layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seed=3)
    prompt = np.random.default_rng(0).integers(0, VOCAB, POSITIONS).tolist()
    root = tmp_path_factory.mktemp("memory")
    late = {p: 700 for p in range(700, POSITIONS)}            # missing context: the diagnoses read rows too
    return (write_trace(model, root / "ref.h5", prompt, 2),
            write_trace(model, root / "cand.h5", prompt, 2, strategy="isolated-global", faults=Faults(context_start=late)))


def test_peak_memory_of_a_diff_is_under_twice_one_layer_with_a_large_vocabulary(pair):
    with open_trace(pair[0]) as tr:
        n = tr.positions.size
        layer_bytes = sum(tr.point(0, p, slice(0, 1)).nbytes for p in tr.points_in(0)) * n
        logits_bytes = tr.row_nbytes(None, "logits") * n
    assert logits_bytes > 5 * layer_bytes                      # reading all logits at once would break the bound
    kvdiff.diff(*pair)                                          # imports and caches outside the measurement
    tracemalloc.start()
    div = kvdiff.diff(*pair)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert "missing_context" in [d.kind for d in div.diagnoses]
    assert peak < 2 * layer_bytes, f"peak {peak / 1e6:.1f} MB, one layer {layer_bytes / 1e6:.1f} MB"

