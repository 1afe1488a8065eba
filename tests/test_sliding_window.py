"""Sliding windows past their end (tiny-gemma3 with a 32-position window): the reference matches
transformers' own generation, the engine masks (and skips) keys that left a windowed layer's window
in every attention path, prefix exact stays bitwise the reference, and a cached system chunk the
windowed layers have moved past is reused."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.attention_plan import ForwardAttention, key_sets
from kvdiff.engine.kv_cache import Segment
from kvdiff.engine.exact_attention import KEY_TILE
from kvdiff.engine.numerics import exact_numerics
from kvdiff.run.model_cache import ModelKey
from kvdiff.engine.reference import reference_generate
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.tiny import build_tiny_model
from kvdiff.options import Strategy
from kvdiff.run.compare import compare
from kvdiff.trace import open_trace

from conftest import SHARING_SYSTEM, SEED_PROMPT, SEED_SYSTEM, assert_every_strategy_runs, assert_reference_is_transformers_generation

WINDOW = 32
LONG_USER = SEED_PROMPT + " The quick brown fox jumps over the lazy dog, and the key and value cache of a system prompt." * 5
MESSAGES = [{"role": "system", "content": SEED_SYSTEM}, {"role": "user", "content": LONG_USER}]
OTHER = SHARING_SYSTEM
NAME = "tiny-gemma3-window32"
KEY = ModelKey(NAME)


@pytest.fixture(scope="module")
def windowed():
    return build_tiny_model("tiny-gemma3", sliding_window=WINDOW)


def test_the_conversation_runs_past_the_window(windowed):
    model, tok = windowed
    n = len(render_prompt_ids(tok, MESSAGES))
    system = len(render_prompt_ids(tok, MESSAGES[:1]))
    assert n > system + WINDOW and n > 2 * KEY_TILE     # the user chunk alone is longer than the window
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [WINDOW, WINDOW, None]


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_the_reference_is_transformers_own_generation(windowed, numerics):
    assert_reference_is_transformers_generation(*windowed, MESSAGES, 24, numerics)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs_past_the_window(windowed, strategy, numerics):
    assert_every_strategy_runs(*windowed, strategy, numerics, MESSAGES, OTHER)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_the_window_is_what_the_engine_attends(windowed, numerics):
    """With the windowed layers made global the engine's tokens part from the reference's: the
    window, not luck, makes them agree."""
    model, tok = windowed
    with exact_numerics(model) if numerics == "exact" else torch.no_grad():
        want = reference_generate(model, tok, MESSAGES, 12).token_ids
    eng = Engine(model, tok, numerics=numerics)
    assert eng.generate([MESSAGES], max_new_tokens=12)[0].token_ids == want
    for layer in eng.adapter.layers:
        layer.window = None
    eng.adapter.windows = (None,)
    assert eng.generate([MESSAGES], max_new_tokens=12)[0].token_ids != want


def test_prefix_exact_is_bitwise_with_a_system_chunk_the_window_moved_past(windowed, tmp_path):
    result = compare(MESSAGES, model=NAME, strategy="prefix", numerics="exact", warm=OTHER, max_new_tokens=8,
                     out=tmp_path / "run", model_cache={KEY: windowed})
    report = result.report.to_json()
    assert result.exit_code == 0 and report["first_bit_difference"] is None
    assert [c["cache"] for c in report["chunks"]] == ["hit", "miss", "miss"]
    system = report["chunks"][0]["positions"]
    assert report["chunks"][2]["positions"][1] - WINDOW >= system[1]      # the last rows see none of it


def _group(positions: list[int], length: int) -> RowGroup:
    slots = torch.arange(length)
    return RowGroup([0] * len(positions), positions, positions, slots[positions], slots[positions],
                    [Segment(0, slots, None)], key_slots=np.arange(length) if len(positions) == 1 else None)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_key_sets_diagonal_is_its_visibility_where_it_is_given(window):
    """`KeySet.diagonal` (exact CUDA attention computes the mask from it instead of reading it) is
    given where row i sees exactly keys 0..i + diagonal: a cold prompt, a new turn after cached
    keys, a decode row; not where a window or `lo` hides keys."""
    cpu = torch.device("cpu")
    cases = {"cold": (_group(list(range(0, 20)), 20), 0), "new turn": (_group(list(range(100, 140)), 140), 100),
             "decode": (_group([30], 31), 30), "long turn": (_group(list(range(10, 140)), 140), 10)}
    cases["lo"] = (_group(list(range(0, 20)), 20), None)
    cases["lo"][0].lo = 5
    for name, (group, want) in cases.items():
        (keys,) = key_sets([group], window, True, cpu)
        if window is not None and name in ("new turn", "long turn"):
            want = None         # the window hides the first keys from the last rows
        assert keys.diagonal == want, name
        if keys.diagonal is not None:
            rows, cols = torch.arange(keys.visible.shape[0])[:, None], torch.arange(keys.visible.shape[1])[None, :]
            assert torch.equal(keys.visible, cols <= rows + keys.diagonal), name


@pytest.mark.parametrize("exact", [False, True])
def test_keys_out_of_every_rows_window_are_not_read(exact):
    prefill = _group(list(range(100, 140)), 140)
    cpu = torch.device("cpu")
    keys_of = functools.partial(key_sets, exact=exact, device=cpu)
    plans = ForwardAttention.build([prefill], [slice(0, 40)], (WINDOW, None), keys_of, exact, cpu).plans
    first = 64 if exact else 100 - WINDOW + 1             # exact cuts on a key tile: tiles stay aligned
    windowed, full = plans[WINDOW].keys[0], plans[None].keys[0]
    assert torch.equal(windowed.slots, torch.arange(first, 140)) and first % (KEY_TILE if exact else 1) == 0
    assert torch.equal(full.slots, torch.arange(140))
    rows = torch.arange(100, 140).unsqueeze(1)
    assert torch.equal(windowed.visible, (windowed.slots <= rows) & (windowed.slots > rows - WINDOW))
    if not exact:
        decode = ForwardAttention.build([_group([200], 201)], [slice(0, 1)], (WINDOW, None), keys_of, False, cpu)
        assert decode.plans[WINDOW].plan.lengths.tolist() == [WINDOW] and decode.plans[None].plan.lengths.tolist() == [201]
        assert torch.equal(decode.plans[WINDOW].plan.table[0], torch.arange(201 - WINDOW, 201))


def test_a_windowed_layer_attended_globally_past_the_zoom_start_is_named_from_the_window_keys(windowed, tmp_path,
                                                                                               monkeypatch):
    """Red-team round 5, t02: a warm prefill gives the sliding-window layers no window. Its first
    difference (z, layer 0) lies past where the zoom window starts, so the window keeps k and v at
    every earlier position too (its keys), and the traces declare each layer's window: attention is
    recomputed within the model's window, and the one without it is named. Before, the window held
    no earlier keys (nothing was tested: "the attention itself differs"), and a standard without the
    model's window would have made the reference's window the departure."""
    import kvdiff.engine.runner as runner
    import kvdiff.run.zoom as zoom

    monkeypatch.setattr(zoom, "ZOOM_FROM_START", 8)       # the window starts at the first difference, not at 0
    inner = runner.ModelRunner._keys

    def global_after_the_start(self, groups, window):
        later = any(len(g.positions) > 1 and min(g.positions) > 0 for g in groups)
        return inner(self, groups, None if later else window)

    monkeypatch.setattr(runner.ModelRunner, "_keys", global_after_the_start)
    result = compare(MESSAGES, model=NAME, strategy="prefix", numerics="exact", warm=OTHER, max_new_tokens=8,
                     out=tmp_path / "run", model_cache={KEY: windowed})
    report = result.report.to_json()
    first = report["first_bit_difference"]
    assert (first["layer"], first["tensor"]) == (0, "z") and first["position"] >= WINDOW
    assert report["digest"]["zoom"]["key_positions"] == [0, first["position"] - 1]
    top = report["diagnoses"][report["top_diagnosis"]]
    assert (top["kind"], top["layer"], top["explanation"]) == ("attention_mismatch", 0, "no window"), top
    assert top["fit_residual"] < 1e-3 and top.get("side") != "reference"
    assert f"sliding window of {WINDOW} not applied" in top["evidence"]
    with open_trace(result.reference_trace) as ref:
        assert ref.meta.dims.layer_windows == (WINDOW, WINDOW, 0)
        assert ref.meta.key_only_positions.tolist() == list(range(first["position"]))
        assert ref.meta.schema_version == 4


def test_a_trace_declares_each_layers_window_and_refuses_a_malformed_list(windowed, tmp_path):
    import h5py

    from kvdiff.analysis import diff
    from kvdiff.errors import InputError
    from kvdiff.run.record import record

    model, tok = windowed
    path = record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=2, capture="k,v")
    with open_trace(path) as t:
        assert t.meta.dims.layer_windows == (WINDOW, WINDOW, 0)
        assert [t.meta.dims.window_of(i) for i in (0, 1, 2, None)] == [WINDOW, WINDOW, None, None]
    with h5py.File(path, "r+") as f:
        f.attrs["layer_windows"] = np.array([WINDOW, 0], dtype=np.int64)
    with pytest.raises(InputError, match=r"layer_windows must hold one window per layer \(3 integers"):
        diff(path, path)
