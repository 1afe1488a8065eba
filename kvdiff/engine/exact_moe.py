"""Exact (batch-invariant) numerics of mixture-of-experts layers (Qwen3-MoE's router and experts).

The router is a linear layer followed by a softmax and a top-k over each row: with the linear
made row-invariant (`invariant_linear`), a row's logits, weights and choice depend on that row
alone. The experts are where rows meet: each expert multiplies the rows routed to it, so with
transformers' grouped matmul a row's bits depend on which other rows chose the same experts.
Here every expert's rows go through `invariant_linear` (fixed row tiles) and each row's k
weighted expert outputs are added in slot order (best expert first), so a row gets the same
bits whether it is computed in a prefill, a chunk or a decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiff.engine.numerics import invariant_linear

ROUTERS = ("Qwen3MoeTopKRouter",)     # softmax over the logits, top-k, optionally renormalised
EXPERTS = ("Qwen3MoeExperts",)        # gate_up_proj (E, 2I, H), down_proj (E, H, I), no bias


def _router_forward(module: nn.Module):
    def forward(hidden_states: torch.Tensor):
        rows = hidden_states.reshape(-1, module.hidden_dim)
        logits = invariant_linear(rows.to(module.weight.device), module.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probs, module.top_k, dim=-1)
        if module.norm_topk_prob:           # summed in slot order: no reduction kernel picks the order
            total = top[:, :1]
            for slot in range(1, module.top_k):
                total = total + top[:, slot:slot + 1]
            top = top / total
        return logits, top.to(logits.dtype), chosen
    return forward


def _experts_forward(module: nn.Module):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1, 1)
        mixed = hidden_states.new_zeros((tokens * k, hidden_states.shape[-1]))
        for expert in torch.unique(ids).tolist():
            pairs = (ids == expert).nonzero().squeeze(1)       # (token, slot) pairs routed to it
            gated = module._apply_gate(invariant_linear(hidden_states[pairs // k], module.gate_up_proj[expert]))
            mixed[pairs] = invariant_linear(gated, module.down_proj[expert]) * weights[pairs]
        mixed = mixed.view(tokens, k, -1)
        out = mixed[:, 0]
        for slot in range(1, k):
            out = out + mixed[:, slot]
        return out
    return forward


def moe_forwards(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(module, exact forward) for every router and experts module of `model` that exact numerics
    replace (none in a dense model)."""
    out: list[tuple[nn.Module, object]] = []
    for m in model.modules():
        name = type(m).__name__
        if name in ROUTERS:
            out.append((m, _router_forward(m)))
        elif name in EXPERTS:
            out.append((m, _experts_forward(m)))
    return out
