"""Fast numerics' linears on the CPU: the model's results, its modules restored."""

from __future__ import annotations

import torch
from torch import nn

from kvdiff.engine import Engine
from kvdiff.engine.fast_decode import fast_linear, fast_numerics


def test_fast_linear_is_the_linear_for_few_rows_and_many():
    torch.manual_seed(0)
    weight, bias = torch.randn(1536, 576), torch.randn(1536)
    for shape in [(576,), (1, 576), (1, 1, 576), (3, 576), (2, 5, 576), (16, 576), (70, 576), (0, 576)]:
        x = torch.randn(shape)
        out = fast_linear(x, weight, bias)
        assert out.shape == shape[:-1] + (1536,)
        torch.testing.assert_close(out, nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_one_row_goes_through_fast_linear_and_the_model_is_restored(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2, bias=False))
    rows_seen = []
    monkeypatch.setattr("kvdiff.engine.fast_decode.fast_linear",
                        lambda x, w, b: rows_seen.append(x.shape) or nn.functional.linear(x, w, b))
    with fast_numerics(model):
        model(torch.randn(1, 8))
    assert rows_seen == [(1, 8), (1, 4)]
    assert all("forward" not in m.__dict__ for m in model)


def test_fast_engine_generates_with_fast_linears_and_restores_them(tiny_llama, monkeypatch):
    model, tok = tiny_llama
    calls = []
    monkeypatch.setattr("kvdiff.engine.fast_decode.fast_linear",
                        lambda x, w, b: calls.append(x.numel() == x.shape[-1]) or nn.functional.linear(x, w, b))
    messages = [{"role": "user", "content": "Hello there"}]
    Engine(model, tok, strategy="prefix").generate([messages], max_new_tokens=3)
    assert any(calls)
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
