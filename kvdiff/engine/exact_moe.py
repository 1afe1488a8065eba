"""Exact (batch-invariant) numerics of mixture-of-experts layers (Qwen3-MoE's, gpt-oss's and
DeepSeek-V3's routers and experts).

The router is a linear layer followed by a softmax and a top-k over each row (gpt-oss: a top-k of
the logits, then a softmax over those k; DeepSeek-V3: sigmoid scores, top-k within the best
groups of experts, each row alone too): with the linear
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

from kvdiff.engine.invariant_linear import invariant_linear

ROUTERS = ("Qwen3MoeTopKRouter",)     # softmax over the logits, top-k, optionally renormalised
TOPK_ROUTERS = ("GptOssTopKRouter",)  # a biased linear, top-k of the logits, softmax over the k chosen
GROUPED_ROUTERS = ("DeepseekV3TopkRouter",)   # sigmoid scores, top-k within the best groups, renormalised, scaled
# experts module -> whether its weights are stored transposed: Qwen3-MoE's gate_up_proj (E, 2I, H) and
# down_proj (E, H, I), no bias; gpt-oss's (E, H, 2I) and (E, I, H), with biases (gate_up_proj_bias, ...)
EXPERTS = {"Qwen3MoeExperts": False, "GptOssExperts": True, "DeepseekV3Experts": False}


def _router_forward(module: nn.Module):
    def forward(hidden_states: torch.Tensor):
        rows = hidden_states.reshape(-1, module.hidden_dim)
        logits = invariant_linear(rows.to(module.weight.device), module.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probs, module.top_k, dim=-1)
        if module.norm_topk_prob:
            top = top / _slot_sum(top)
        return logits, top.to(logits.dtype), chosen
    return forward


def _slot_sum(top: torch.Tensor) -> torch.Tensor:
    """Each row's sum of its top-k weights (T, k) -> (T, 1), in slot order: no reduction kernel picks the order."""
    total = top[:, :1]
    for slot in range(1, top.shape[1]):
        total = total + top[:, slot:slot + 1]
    return total


def _grouped_router_forward(module: nn.Module):
    """DeepSeek-V3's router: float32 logits, sigmoid scores; the choice adds a per-expert bias, keeps the
    `topk_group` groups whose two best experts score most, and takes the top k there (best first); the
    chosen experts' scores, renormalised, times `routed_scaling_factor`, weigh them."""
    def forward(hidden_states: torch.Tensor):
        rows = hidden_states.reshape(-1, module.hidden_dim).to(module.weight.device, torch.float32)
        logits = invariant_linear(rows, module.weight.float())
        scores = logits.sigmoid()
        choice = scores + module.e_score_correction_bias
        groups = choice.view(-1, module.num_group, module.num_experts // module.num_group)
        best_two = groups.topk(2, dim=-1)[0]
        kept = torch.topk(best_two[..., 0] + best_two[..., 1], module.topk_group, dim=-1)[1]
        mask = torch.zeros_like(best_two[..., 0], dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(-1, module.num_experts)
        chosen = torch.topk(choice, module.top_k, dim=-1)[1]
        top = scores.gather(1, chosen)
        if module.norm_topk_prob:
            top = top / (_slot_sum(top) + 1e-20)
        return logits, top * module.routed_scaling_factor, chosen
    return forward


def _topk_router_forward(module: nn.Module):
    def forward(hidden_states: torch.Tensor):
        rows = hidden_states.reshape(-1, module.hidden_dim)
        logits = invariant_linear(rows.to(module.weight.device), module.weight, module.bias)
        top, chosen = torch.topk(logits, module.top_k, dim=-1)
        return logits, torch.softmax(top, dim=1, dtype=top.dtype), chosen
    return forward


def _expert_linear(module: nn.Module, name: str, expert: int, rows: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert `expert`'s projection `name` (gate_up_proj, down_proj) of `rows`, with its bias if any."""
    weight = getattr(module, name)[expert]
    bias = getattr(module, f"{name}_bias", None)
    return invariant_linear(rows, weight.t() if transposed else weight, None if bias is None else bias[expert])


def _experts_forward(module: nn.Module, transposed: bool):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1, 1)
        mixed = hidden_states.new_zeros((tokens * k, hidden_states.shape[-1]))
        for expert in torch.unique(ids).tolist():
            pairs = (ids == expert).nonzero().squeeze(1)       # (token, slot) pairs routed to it
            gated = module._apply_gate(_expert_linear(module, "gate_up_proj", expert, hidden_states[pairs // k],
                                                      transposed))
            # (DeepSeek's weights are float32: the weighted rows are cast back, as transformers does)
            mixed[pairs] = (_expert_linear(module, "down_proj", expert, gated, transposed) * weights[pairs]).to(mixed.dtype)
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
        elif name in TOPK_ROUTERS:
            out.append((m, _topk_router_forward(m)))
        elif name in GROUPED_ROUTERS:
            out.append((m, _grouped_router_forward(m)))
        elif name in EXPERTS:
            out.append((m, _experts_forward(m, EXPERTS[name])))
    return out
