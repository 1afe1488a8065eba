"""A small, exact decoder (Llama layout, random weights) that writes real kvdiff traces.

It is the analyzer's test bench: every probe point is computed as a real model computes it, and
the faults a chunked engine can make are switches on one run: RoPE at other positions
(`encoded`), attention that starts late (`context_start`), a stale K/V slot (`stale`), a norm
with the wrong epsilon (`norm_eps`), rounding-size noise (`jitter`). Greedy generation recomputes
the whole sequence each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvdiff.trace.points import LAYER_POINTS
from kvdiff.trace import ChunkRecord, ModelDims, TraceMeta, TraceWriter


@dataclass
class Faults:
    """What a candidate run does differently from the reference (all positions are global)."""

    encoded: dict[int, int] = field(default_factory=dict)        # position -> position RoPE uses
    context_start: dict[int, int] = field(default_factory=dict)  # position -> first position it attends to
    stale: dict[int, int] = field(default_factory=dict)          # position -> position whose K/V it holds
    norm_eps: dict[int, float] = field(default_factory=dict)     # layer -> eps its attn_norm uses
    jitter: float = 0.0                                          # z scaled by 1 + jitter (rounding-size noise)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: fp32 compute, then cast back."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """HF rotate_half RoPE of x (T, heads, d) at `positions` (T,)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return (x * cos + half * sin).to(x.dtype)


class SyntheticModel:
    """Random-weight decoder: `layers` x (RMSNorm, GQA attention with RoPE, RMSNorm, SiLU MLP)."""

    def __init__(self, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                 vocab: int = 64, rope_base: float = 10000.0, eps: float = 1e-5, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.layers, self.hidden, self.heads, self.kv_heads = layers, hidden, heads, kv_heads
        self.head_dim, self.vocab, self.base, self.eps = hidden // heads, vocab, rope_base, eps

        def w(*shape: int, s: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * s / shape[-1] ** 0.5

        self.embed = torch.randn(vocab, hidden, generator=g)
        d = self.head_dim
        self.weights = [dict(wq=w(heads * d, hidden), wk=w(kv_heads * d, hidden), wv=w(kv_heads * d, hidden),
                             wo=w(hidden, heads * d), up=w(2 * hidden, hidden), down=w(hidden, 2 * hidden),
                             n1=1 + 0.1 * torch.randn(hidden, generator=g), n2=1 + 0.1 * torch.randn(hidden, generator=g))
                        for _ in range(layers)]
        self.final_w = 1 + 0.1 * torch.randn(hidden, generator=g)
        self.lm_head = w(vocab, hidden, s=4.0)

    @property
    def attn_scale(self) -> float:
        return self.head_dim ** -0.5

    def forward(self, ids: list[int], faults: Faults) -> dict:
        """Every capture of one forward over `ids` (positions 0..T-1)."""
        T, d, H, KV = len(ids), self.head_dim, self.heads, self.kv_heads
        pos = torch.arange(T)
        enc = torch.tensor([faults.encoded.get(p, p) for p in range(T)])
        start = torch.tensor([faults.context_start.get(p, 0) for p in range(T)])
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= start[:, None])
        src = torch.tensor([faults.stale.get(p, p) for p in range(T)])
        out: dict = {"layers": [], "norms": []}
        x = self.embed[torch.tensor(ids)]
        for i, L in enumerate(self.weights):
            c = {"resid_pre": x}
            eps = faults.norm_eps.get(i, self.eps)
            h = c["attn_norm"] = rms_norm(x, L["n1"], eps)
            q = rope((h @ L["wq"].T).view(T, H, d), enc, self.base)
            k0 = (h @ L["wk"].T).view(T, KV, d)[src]
            v = (h @ L["wv"].T).view(T, KV, d)[src]
            k = rope(k0, enc, self.base)
            c.update(q=q, k_pre_rope=k0, k=k, v=v)
            kk, vv = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
            scores = torch.einsum("thd,shd->hts", q, kk) * self.attn_scale
            p = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
            z = c["z"] = torch.einsum("hts,shd->thd", p, vv) * (1 + faults.jitter)
            a = c["attn_out"] = z.reshape(T, H * d) @ L["wo"].T
            x = c["resid_mid"] = x + a
            h2 = c["mlp_norm"] = rms_norm(x, L["n2"], self.eps)
            m = c["mlp_out"] = torch.nn.functional.silu(h2 @ L["up"].T) @ L["down"].T
            x = c["resid_post"] = x + m
            out["layers"].append(c)
            out["norms"].append({"attn_norm": (c["resid_pre"], c["attn_norm"]), "mlp_norm": (c["resid_mid"], h2)})
        fn = rms_norm(x, self.final_w, self.eps)
        out["final"] = {"final_norm": fn, "logits": fn @ self.lm_head.T}
        out["final_norm_io"] = (x, fn)
        return out

    def generate(self, prompt: list[int], steps: int, faults: Faults) -> tuple[list[int], dict, list[tuple]]:
        """Greedy tokens, the captures of the last forward, and per-step (position, logits row).

        Runs on one thread: these matrices are tiny, and thread start-up dominates on a busy CPU.
        """
        ids, rows = list(prompt), []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(steps):
                cap = self.forward(ids, faults)
                logits = cap["final"]["logits"][-1]
                rows.append((len(ids) - 1, logits))
                ids.append(int(logits.argmax()))
            return ids[len(prompt):], self.forward(ids[:-1], faults), rows
        finally:
            torch.set_num_threads(threads)


def write_trace(model: SyntheticModel, path: str | Path, prompt: list[int], steps: int, *,
                strategy: str = "reference", faults: Faults | None = None,
                chunks: list[ChunkRecord] | None = None, provenance: list[tuple] | None = None,
                without_z: bool = False) -> Path:
    """Run the model and write its trace; `provenance`: (positions, chunk, prefill_id, encoded, reused);
    `without_z`: no z, as traces written before kvdiff recorded it."""
    faults = faults or Faults()
    generated, cap, rows = model.generate(prompt, steps, faults)
    positions = list(range(len(prompt) + steps - 1))
    layer_points = tuple(p for p in LAYER_POINTS if not (without_z and p == "z"))
    meta = TraceMeta(
        kvdiff_version="0.1.0", model_name="synthetic", model_fingerprint=f"synthetic:{model.layers}",
        tokenizer_fingerprint="ids", dtype="float32", device="cpu", torch_version=torch.__version__,
        transformers_version="none", strategy=strategy, numerics="fast", messages=[],
        input_ids=np.asarray(prompt, dtype=np.int64), dims=ModelDims(
            num_layers=model.layers, num_heads=model.heads, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
            hidden_size=model.hidden, vocab_size=model.vocab, attn_scale=model.attn_scale), points=layer_points + ("final_norm", "logits"),
        layers=tuple(range(model.layers)))
    with TraceWriter(path, meta) as w:
        for i, c in enumerate(cap["layers"]):
            for point in layer_points:
                w.write_rows(f"layers/{i}", point, positions, c[point])
            for norm, (x, y) in cap["norms"][i].items():
                w.write_norm(f"layers/{i}", norm, positions, x, y)
                w.write_norm_weight(i, norm, model.weights[i]["n1" if norm == "attn_norm" else "n2"], model.eps)
        for point, value in cap["final"].items():
            w.write_rows("final", point, positions, value)
        w.write_norm("final", "final_norm", positions, *cap["final_norm_io"])
        w.write_norm_weight(None, "final_norm", model.final_w, model.eps)
        for step, (p, logits) in enumerate(rows):
            top = logits.topk(5)
            w.append_steps([(step, p, generated[step])], top.indices.numpy(), top.values.numpy(),
                           [float(top.values[0] - top.values[1])])
        for spec in provenance or []:
            w.write_provenance(*spec)
        w.close(generated_ids=generated, text=" ".join(map(str, generated)), chunks=chunks or [])
    return Path(path)
