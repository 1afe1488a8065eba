"""The HDF5 trace format: schema constants, the typed metadata, and lossless dtype coding.

Layout (docs/trace-format.md is the full description):

    /                        attrs: format, schema_version, complete (set last), metadata
    /input_ids /generated_ids /positions
    /layers/<i>/<point>                      rows indexed by global position
    /layers/<i>/norm_stats/<norm>/<stat>     float64, rows indexed by global position
    /final/<point>, /final/norm_stats/...    the same for final_norm and logits
    /norms/<i>/<norm>, /norms/final/<norm>   norm weights, attr eps
    /steps/<field>                           one row per generated step
    /provenance/<field>                      one row per position with known provenance
    /kv_only_positions                       positions holding k and v rows only (schema 2)
    /digests/positions                       digest traces (schema 3): positions holding digests
    /key_only_positions                      digest traces with key rows (schema 4): k and v rows only
    /digests/{layers/<i>|final}/hash|stats   per position, each point's hash, rms and max_abs (trace/digest.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvdiff.trace.points import FINAL_POINTS, READ_POINTS

from kvdiff.trace.points import ALL_POINTS, KNOWN_POINTS, MLA_POINTS, MOE_POINTS, POST_NORM_POINTS, SINK_POINTS

FORMAT_NAME = "kvdiff-trace"
SCHEMA_VERSION = 1            # every recorded position holds a row of every recorded point
KV_ONLY_SCHEMA_VERSION = 2    # some positions hold k and v only (read from a cache): a reader of 1 would misread them
DIGEST_SCHEMA_VERSION = 3     # digests of every row, full rows only in a window: a reader of 2 would see a partial trace
KEY_ROWS_SCHEMA_VERSION = 4   # a digest trace whose window's keys before it hold k and v only: a reader of 3 would misread them
DTYPE_ATTR = "kvdiff_dtype"          # the torch dtype a dataset's rows had when captured
FINAL_GROUP = "final"
DIGEST_GROUP = "digests"


@dataclass(frozen=True)
class ChunkRecord:
    """One row of the chunk table: a chunk's span of global positions and how it was cached."""

    name: str
    positions: tuple[int, int]              # first, last (inclusive) global position
    hash: str
    cache: str                              # "hit" | "miss"
    encoded_positions: tuple[int, int]      # first, last position RoPE encoded the chunk at

    def to_json(self) -> dict:
        return {"name": self.name, "positions": list(self.positions), "hash": self.hash,
                "cache": self.cache, "encoded_positions": list(self.encoded_positions)}

    @classmethod
    def from_json(cls, d: dict) -> "ChunkRecord":
        return cls(str(d["name"]), tuple(int(p) for p in d["positions"]), str(d["hash"]),
                   str(d["cache"]), tuple(int(p) for p in d["encoded_positions"]))


@dataclass(frozen=True)
class ModelDims:
    """The shapes a model's probe rows have (stored as one root attribute each)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    attn_scale: float
    num_experts: int = 0            # mixture of experts: experts per layer (0: a dense model)
    experts_per_token: int = 0      # experts the router chooses per token
    post_norms: int = 0             # 1: norms after attention and after the MLP too (Gemma 3), else 0
    latent_dim: int = 0             # multi-head latent attention: the cached latent's width (0: K/V cached)
    rope_dim: int = 0               # multi-head latent attention: the shared RoPE key's width
    sinks: int = 0                  # 1: every layer's attention has per-head sink logits (gpt-oss), else 0
    expert_groups: int = 0          # DeepSeek's routing: experts in this many groups, chosen by sigmoid score +
    groups_chosen: int = 0          # bias within the best `groups_chosen` (0: the top k of the logits)
    # each layer's sliding window (0: the layer attends every earlier position); () where no layer has one
    layer_windows: tuple[int, ...] = ()

    def window_of(self, layer: int | None) -> int | None:
        """The sliding window of `layer`'s attention (the keys a row sees, its own included), or None."""
        if layer is None or not self.layer_windows:
            return None
        return self.layer_windows[layer] or None

    def points(self) -> tuple[str, ...]:
        """The probe points a model of these dims has: the router's only with experts, the post-norms
        only with post-norms, kv_latent instead of v and z with latent attention."""
        mla = bool(self.latent_dim)
        return tuple(p for p in KNOWN_POINTS if (p in ALL_POINTS and not (mla and p in ("v", "z")))
                     or (p in MOE_POINTS and self.num_experts) or (p in POST_NORM_POINTS and self.post_norms)
                     or (p in MLA_POINTS and mla) or (p in SINK_POINTS and self.sinks))

    def point_shape(self, point: str) -> tuple[int, ...]:
        """Row shape of a probe point (rows are (T, *shape))."""
        if point == "kv_latent":
            return (self.latent_dim,)
        if point in ("k_pre_rope", "k") and self.latent_dim:
            return (self.num_kv_heads, self.rope_dim)
        if point == "router_logits":
            return (self.num_experts,)
        if point == "attn_sinks":
            return (self.num_heads,)
        if point == "experts":
            return (self.experts_per_token,)
        if point in ("q", "z"):
            return (self.num_heads, self.head_dim)
        if point in ("k_pre_rope", "k", "v"):
            return (self.num_kv_heads, self.head_dim)
        if point == "logits":
            return (self.vocab_size,)
        return (self.hidden_size,)


DENSE_EXPERT = -1.0      # the experts row of a dense layer: no expert


def rope_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE columns in rotate_half order, as traces hold them (pairs (i, i + d/2)): DeepSeek's
    interleaved pairs (0, 1), (2, 3), ... de-interleaved, evens then odds (a copy, bits unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if interleaved else x


def dense_router_rows(like: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits and experts rows for the tokens of `like` (T, ...) at a dense layer of a model
    that mixes dense and mixture-of-experts layers (DeepSeek-V3's first layers): no router ran, so
    every logit is 0 and every expert DENSE_EXPERT."""
    rows = like.shape[0]
    return (like.new_zeros((rows, num_experts), dtype=torch.float32),
            like.new_full((rows, top_k), DENSE_EXPERT, dtype=torch.float32))


@dataclass
class TraceMeta:
    """Everything a trace says about the run that produced it."""

    kvdiff_version: str
    model_name: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str                              # "float32" | "bfloat16" | "float16"
    device: str
    torch_version: str
    transformers_version: str
    strategy: str                           # "reference" for the continuous path
    numerics: str                           # "fast" | "exact"
    messages: list[dict]
    input_ids: np.ndarray
    dims: ModelDims
    points: tuple[str, ...]                 # recorded probe point names
    layers: tuple[int, ...]                 # recorded layer ids
    chunks: list[ChunkRecord] = field(default_factory=list)
    generated_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    text: str = ""
    schema_version: int = SCHEMA_VERSION
    # Positions whose K/V the run read from its cache without computing them: only k and v have
    # rows there (no other point, norm statistics or final point).
    kv_only_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # A digest trace's positions before its zoom window where the run computed every point but kept
    # only k and v (the keys attention read at the window's rows): computed, not read from a cache.
    key_only_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # "full": rows of `points` x `layers` at every recorded position. "digest": a digest
    # (trace/digest.py) of every row of `digest_points` x `digest_layers`, and full rows only
    # for `points` x `layers` at the positions of a zoom window (none in a first pass).
    trace_mode: str = "full"
    digest_points: tuple[str, ...] = ()
    digest_layers: tuple[int, ...] = ()

    # Scalar attributes stored one per HDF5 attribute, in this order (then the fields of `dims`).
    SCALARS = ("kvdiff_version", "model_name", "model_fingerprint", "tokenizer_fingerprint", "dtype",
               "device", "torch_version", "transformers_version", "strategy", "numerics", "text")
    SET_BY_RUN = ("text",)          # the scalars known only once the run has ended


@dataclass(frozen=True)
class StepRecords:
    """Per generated step: the chosen token, the top-k of its logits row and the top-1/top-2 margin."""

    step: np.ndarray          # (G,) int64
    position: np.ndarray      # (G,) int64: global position whose logits chose the token
    token_id: np.ndarray      # (G,) int64
    topk_ids: np.ndarray      # (G, k) int64
    topk_values: np.ndarray   # (G, k) float32 (logits upcast; exact for fp32/bf16/fp16)
    margin: np.ndarray        # (G,) float64: top-1 minus top-2 logit


@dataclass(frozen=True)
class ProvenanceRecords:
    """Per recorded position (aligned with TraceReader.positions): where its K/V came from."""

    chunk: list[str]            # "" where the path reported no provenance
    prefill_id: np.ndarray      # int64, -1 where unknown
    encoded_position: np.ndarray  # int64, -1 where unknown
    reused: np.ndarray          # bool


def point_group(layer: int | None) -> str:
    """HDF5 group holding the rows of `layer`'s points (None: the final points)."""
    return FINAL_GROUP if layer is None else f"layers/{layer}"


DIGEST_LAYOUT = "layer-axis"     # /digests' attribute `layout`: one dataset a table for every layer


def digest_path(final: bool, table: str, part: str) -> str:
    """Dataset of a digest table, of every digested layer (rows of layers x points) or of the
    final points (`final`): part "hash" (int64, a column per point) or "stats" (float32 rms and
    max_abs per point)."""
    return f"{DIGEST_GROUP}/{FINAL_GROUP if final else 'layers'}/{table}{part}"


def digest_tables(points: tuple[str, ...], layer: int | None) -> dict[str, tuple[str, ...]]:
    """A digest trace's tables of `layer` (None: the final points): table name -> its columns.
    A layer's k and v have a table of their own ("kv_"), which reads of cached rows write to,
    as they write the k and v rows of a full trace; the other points share table ""."""
    if layer is None:
        tables = {"": tuple(p for p in points if p in FINAL_POINTS)}
    else:
        layer_points = [p for p in points if p not in FINAL_POINTS]
        tables = {"": tuple(p for p in layer_points if p not in READ_POINTS),
                  "kv_": tuple(p for p in layer_points if p in READ_POINTS)}
    return {name: columns for name, columns in tables.items() if columns}


def digest_table_of(point: str) -> str:
    """The digest table holding `point`'s column."""
    return "kv_" if point in READ_POINTS else ""


def norm_weight_path(layer: int | None, norm: str) -> str:
    return f"norms/{FINAL_GROUP if layer is None else layer}/{norm}"


WEIGHTS_GROUP = "weights"
LATENT_WEIGHT = "kv_b_proj"     # multi-head latent attention: each head's K (without RoPE) and V from the latent


ROUTER_BIAS = "router_bias"      # DeepSeek's routing: the bias added to each expert's sigmoid score to choose


def latent_weight_path(layer: int) -> str:
    return f"{WEIGHTS_GROUP}/{layer}/{LATENT_WEIGHT}"


def router_bias_path(layer: int) -> str:
    return f"{WEIGHTS_GROUP}/{layer}/{ROUTER_BIAS}"


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 and so on."""
    return str(dtype).removeprefix("torch.")


def to_storage(rows: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy array holding the tensor's exact bits, and the torch dtype name to restore them.

    bfloat16 has no numpy/HDF5 type: its 16-bit patterns are stored as uint16.
    """
    rows = rows.detach()
    if rows.device.type != "cpu":
        rows = rows.cpu()
    if rows.dtype == torch.bfloat16:
        return rows.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    return rows.numpy(), dtype_name(rows.dtype)


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Rows as numpy: bfloat16 upcast to float32 bit-faithfully, other dtypes as stored."""
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return stored
