"""Localization by operation: the first operation whose inputs match and whose output differs.

Between consecutive probe points of a layer sits one operation (norm, projection, RoPE,
attention, residual add, MLP). At the first row that breaks tolerance (or, when none does, the
first row whose bits differ), the operation that produced it is named only when its inputs are
shown to be within tolerance there: each input's tier is read from the comparison (for
attention, `q` at the position and `k`/`v` at every compared position up to it). When an
input was not recorded or not compared, the answer is the span between the last point known to
match and the point that differs, and it says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvdiff.analysis.compare import Comparison, PointMap
from kvdiff.analysis.search import Location, dataflow_key
from kvdiff.analysis.tolerance import Tier

# point -> (the operation producing it, its inputs: (point, layer offset)); attention reads
# k and v at every earlier position too.
OPERATIONS: dict[str, tuple[str, tuple[tuple[str, int], ...]]] = {
    "resid_pre": ("hand-off from the previous layer", (("resid_post", -1),)),
    "attn_norm": ("attention norm", (("resid_pre", 0),)),
    "q": ("q projection (q-norm, RoPE)", (("attn_norm", 0),)),
    "k_pre_rope": ("k projection (k-norm)", (("attn_norm", 0),)),
    "k": ("RoPE on k", (("k_pre_rope", 0),)),
    "v": ("v projection", (("attn_norm", 0),)),
    "kv_latent": ("latent projection (kv_a_proj, kv_a_layernorm)", (("attn_norm", 0),)),
    "attn_sinks": ("attention sinks (the layer's learned per-head logits)", ()),
    "z": ("attention (softmax(q k^T) v)", (("q", 0), ("k", 0), ("v", 0))),
    "attn_out": ("attention (softmax(q k^T) v, o_proj)", (("q", 0), ("k", 0), ("v", 0))),
    "attn_post_norm": ("attention post-norm", (("attn_out", 0),)),
    "resid_mid": ("residual add after attention", (("resid_pre", 0), ("attn_out", 0))),
    "mlp_norm": ("MLP norm", (("resid_mid", 0),)),
    "router_logits": ("router", (("mlp_norm", 0),)),
    "experts": ("top-k expert choice", (("router_logits", 0),)),
    "mlp_out": ("MLP", (("mlp_norm", 0),)),
    "mlp_post_norm": ("MLP post-norm", (("mlp_out", 0),)),
    "resid_post": ("residual add after the MLP", (("resid_mid", 0), ("mlp_out", 0))),
    "final_norm": ("final norm", (("resid_post", 0),)),
    "logits": ("LM head", (("final_norm", 0),)),
}
# With norms after attention and the MLP (Gemma 3), the residual adds read the normed outputs.
POST_NORMED: dict[str, tuple[tuple[str, int], ...]] = {
    "resid_mid": (("resid_pre", 0), ("attn_post_norm", 0)),
    "resid_post": (("resid_mid", 0), ("mlp_post_norm", 0)),
}
# Where the traces hold attention's output before o_proj (z), attn_out is o_proj's alone.
O_PROJ = ("o_proj", (("z", 0),))
MATCHING = (Tier.BITWISE.label, Tier.NOISE.label)     # tiers within tolerance


@dataclass(frozen=True)
class InputCheck:
    """One input of the operation and how it compares where the operation read it."""

    point: str
    layer: int | None
    tier: str                    # worst tier over the rows read; "not compared" when unknown

    def to_json(self) -> dict:
        return {"point": self.point, "layer": self.layer, "tier": self.tier}


@dataclass(frozen=True)
class Operation:
    """The operation that first breaks, with the input checks that prove it."""

    name: str                    # "RoPE on k", ...; "between X and Y" when not proved
    layer: int | None
    position: int
    tensor: str                  # its output point
    tier: str                    # the output's tier there
    proved: bool                 # every input recorded and within tolerance, or (a norm) its recomputation fails
    inputs: list[InputCheck] = field(default_factory=list)
    recomputed: bool = False     # a norm whose output is not its own recomputation from its recorded input

    @property
    def proof(self) -> str:
        """One sentence: the inputs' tiers against the output's."""
        ins = ", ".join(f"{i.point}{'' if i.layer is None else f'@{i.layer}'} {i.tier}" for i in self.inputs)
        if self.recomputed:
            return (f"input {ins or 'none'}; output {self.tensor} {self.tier}, and not what the candidate's declared "
                    f"weight and eps give from its own recorded input")
        return f"inputs {ins or 'none'}; output {self.tensor} {self.tier}"

    def to_json(self) -> dict:
        return {"operation": self.name, "layer": self.layer, "position": self.position, "tensor": self.tensor,
                "tier": self.tier, "proved": self.proved, "proof": self.proof,
                "inputs": [i.to_json() for i in self.inputs]}


def _worst(pmap: PointMap, row: int, cols: np.ndarray) -> str:
    tiers = pmap.tier[row, cols] if cols.size else np.zeros(0, dtype=np.int8)
    if not cols.size or (tiers < 0).any():
        return "not compared"
    return Tier(int(tiers.max())).label


def _input_check(comparison: Comparison, point: str, layer: int | None, position: int,
                 every_earlier: bool) -> InputCheck:
    """The worst tier of `point` at `layer` over the rows the operation read."""
    pmap = comparison.final.get(point) if layer is None else comparison.points.get(point)
    if pmap is None or layer not in pmap.layers:
        return InputCheck(point, layer, "not compared")
    row = pmap.layers.index(layer)
    at = pmap.positions <= position if every_earlier else pmap.positions == position
    cols = np.flatnonzero(at)
    if every_earlier:           # cells no trace holds at earlier positions are skipped, not fatal
        cols = cols[pmap.tier[row, cols] >= 0]
    return InputCheck(point, layer, _worst(pmap, row, cols))


def _norm_first(comparison: Comparison, where: Location | None) -> Operation | None:
    """The first norm, in dataflow order and not after `where`, whose candidate output is not its
    recomputation from the candidate's own recorded input and declared weight and eps (where the
    reference's is): the norm computes otherwise, whether or not its output already leaves the two
    traces' tolerance there (another eps may move it by less, and attention after it by more)."""
    al = comparison.alignment
    best = None
    for check in comparison.norms:
        if check.cand_consistent is None or check.ref_consistent is None:
            continue
        # where both traces computed the norm (not past differing tokens, not at K/V read from a cache)
        bad = np.flatnonzero(~check.cand_consistent & check.ref_consistent & al.comparable & al.computed)
        if not bad.size:
            continue
        key = dataflow_key(comparison, int(al.positions[bad[0]]), check.layer, check.norm)
        if best is None or key < best[0]:
            best = (key, check, int(bad[0]))
    if best is None:
        return None
    key, check, col = best
    if where is not None and dataflow_key(comparison, where.position, where.layer, where.tensor) < key:
        return None
    name, ((source, _),) = OPERATIONS[check.norm]
    position = key[0]
    last = comparison.last_layer if comparison.last_layer is not None else comparison.layers[-1]
    inp = _input_check(comparison, source, check.layer if check.layer is not None else last,
                       position, False)
    tier = int(check.output_tier[col])
    return Operation(name, check.layer, position, check.norm, Tier(tier).label if tier >= 0 else "not compared", True,
                     [inp], recomputed=True)


def attention_point(comparison: Comparison) -> str:
    """The point holding attention's output: z (before o_proj) where both traces recorded it, else
    attn_out (after o_proj: attention and o_proj are then one operation)."""
    return "z" if "z" in comparison.points else "attn_out"


def first_operation(comparison: Comparison, where: Location | None) -> Operation | None:
    """The operation that produced `where` (the first breach, or first bit difference), checked; or an
    earlier norm that does not compute as the candidate declares it (`_norm_first`)."""
    norm = _norm_first(comparison, where)
    if norm is not None:
        return norm
    if where is None or where.tensor not in OPERATIONS:
        return None
    name, sources = OPERATIONS[where.tensor]
    if where.tensor in POST_NORMED and "attn_post_norm" in comparison.points:
        sources = POST_NORMED[where.tensor]
    attention = attention_point(comparison)
    if where.tensor == "attn_out" and attention == "z":
        name, sources = O_PROJ
    if where.tensor == attention and "attn_sinks" in comparison.points:
        sources = sources + (("attn_sinks", 0),)
    if "kv_latent" in comparison.points:      # latent attention: attention reads the latent, not v
        sources = tuple(("kv_latent", offset) if point == "v" else (point, offset) for point, offset in sources)
    layers = comparison.layers
    checks = []
    for point, offset in sources:
        if where.tensor == "final_norm":      # the model's last layer's output, where the comparison holds it
            layer = comparison.last_layer if comparison.last_layer is not None else (layers[-1] if layers else None)
        elif where.layer is None:
            layer = None
        else:
            index = layers.index(where.layer) + offset if where.layer in layers else -1
            if offset and (index < 0 or layers[index] != where.layer + offset):
                checks.append(InputCheck(point, where.layer + offset, "not compared"))
                continue
            layer = layers[index]
        checks.append(_input_check(comparison, point, layer, where.position,
                                   every_earlier=where.tensor == attention and point in ("k", "v", "kv_latent")))
    if where.tensor == "resid_pre" and where.layer == 0:
        name, checks = "embedding", []
    proved = all(c.tier in MATCHING for c in checks)
    if proved and where.tensor == "q":
        # q is recorded after RoPE only; k shows which of the two steps breaks.
        before, after = (_input_check(comparison, p, where.layer, where.position, False) for p in ("k_pre_rope", "k"))
        if before.tier in MATCHING and after.tier not in (*MATCHING, "not compared"):
            name, checks = "RoPE (on q and k)", checks + [before, after]
    if not proved and where.tensor in ("k", "v") and all(c.tier == "not compared" for c in checks):
        name = f"{where.tensor.upper()} read from the cache (computed where this trace does not show)"
    elif not proved:
        known = [c.point for c in checks if c.tier in MATCHING]
        name = f"between {', '.join(known) or 'earlier points'} and {where.tensor} ({name} or before)"
    return Operation(name, where.layer, where.position, where.tensor, where.tier, proved, checks)
