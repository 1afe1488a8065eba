"""Per-token statistics of a norm module, the numbers a trace keeps for each selected norm."""

from __future__ import annotations

import torch

from kvdiff.trace.points import NORM_STATS


def norm_statistics(norm_input: torch.Tensor, norm_output: torch.Tensor) -> torch.Tensor:
    """Per-row fp64 statistics over the last dim, one row per NORM_STATS name (input RMS, mean,
    population variance and max-abs of the input, RMS of the output): (5, T) float64, computed
    where the input lives."""
    x = norm_input.detach().reshape(-1, norm_input.shape[-1]).to(torch.float64)
    y = norm_output.detach().reshape(-1, norm_output.shape[-1]).to(x.device, torch.float64)
    variance, mean = torch.var_mean(x, -1, correction=0)
    stats = {
        "input_rms": x.square().mean(-1).sqrt(),
        "mean": mean,
        "variance": variance,
        "max_abs": x.abs().amax(-1),
        "output_rms": y.square().mean(-1).sqrt(),
    }
    return torch.stack([stats[name] for name in NORM_STATS])
