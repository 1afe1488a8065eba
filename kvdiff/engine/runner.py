"""The model runner: one forward over row groups of several requests, with paged KV and probes.

A row group (row_group.py) is a run of rows of one request: their tokens, global and encoded
positions, the slots their K/V are written to, and the key segments they attend to. Each layer
first writes every group's K/V, then runs attention, so a group may read KV that another group
computes in the same forward. Probes hand the captures to the groups' sinks as they are made
(row_probes.py), or digest them together where the sinks record digests only (digest_probes.py).
"""

from __future__ import annotations

import torch

from kvdiff.engine.adapters import Adapter, apply_rope
from kvdiff.engine.attention_plan import ForwardAttention, KeySet, key_sets
from kvdiff.engine import rope_kernel
from kvdiff.engine.digest_probes import DigestProbes, forward_selection
from kvdiff.engine.kv_cache import BlockPool
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.row_probes import RowProbes, sink_views
from kvdiff.engine.strategies import rerotate_keys
from kvdiff.trace.format import dense_router_rows
from kvdiff.trace.points import MOE_POINTS


class ModelRunner:
    """Runs the model's modules through an Adapter with the engine's attention and KV cache.

    Call it with gradients off (Engine.generate does: inference mode, or no_grad when probes
    record, so that their captures keep version counters and need no copy; see probes/staging.py).
    """

    def __init__(self, adapter: Adapter, pool: BlockPool, exact: bool):
        self.adapter = adapter
        self.pool = pool
        self.exact = exact
        # exact decode rows read the paged pool in one kernel (gpu_kernels.paged_attention) on CUDA,
        # where the pool holds K and V as attention reads them at a power-of-two head width
        self.paged_exact = (exact and pool.device.type == "cuda" and pool.holds_kv
                            and adapter.head_dim & (adapter.head_dim - 1) == 0)
        # on CUDA q and k are rotated in one kernel each, where the adapter uses apply_rope for both
        # (exact numerics: where the kernel keeps apply_rope's bits, rope_kernel.rounds_like_torch)
        self.fused_rope = (pool.device.type == "cuda" and rope_kernel.available
                           and type(adapter).rotate_q is Adapter.rotate_q)
        routers = [layer.router for layer in adapter.layers if layer.router is not None]
        self.experts_shape = (int(routers[0].num_experts), int(routers[0].top_k)) if routers else None

    def _keys(self, groups: list[RowGroup], window: int | None) -> list[KeySet]:
        """The keys each group reads under `window` (tests/catalogue.py plants masks here)."""
        return key_sets(groups, window, self.exact, self.pool.device)

    def place(self, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor) -> None:
        """Copy cached K/V rows from slots `src` to `dst` on every layer, K rotated by `delta` positions."""
        k0 = self.pool.k[0]
        rotations = {kind: self.adapter.rope(k0[:1], delta, kind) for kind in self.adapter.rope_kinds}
        for i, layer in enumerate(self.adapter.layers):
            k, v = self.pool.rows(i, src)
            cos, sin = rotations[layer.rope_kind]
            self.pool.write(i, dst, rerotate_keys(k, cos.to(k.device), sin.to(k.device)), v)

    def forward(self, groups: list[RowGroup], num_layers: int | None = None) -> list[torch.Tensor | None]:
        """Run the groups through the model; the float32 logits row of each group that asks for one."""
        a = self.adapter
        dev = self.pool.device
        spans, start = [], 0
        for g in groups:
            spans.append(slice(start, start + len(g.token_ids)))
            start += len(g.token_ids)
        tokens = torch.tensor([t for g in groups for t in g.token_ids], device=dev)
        positions = [p for g in groups for p in g.positions]
        encoded = torch.tensor([p for g in groups for p in g.encoded], device=dev)
        attention = ForwardAttention.build(groups, spans, a.windows, self._keys, self.exact, dev, self.paged_exact)
        if attention.decode_slots is not None:
            read = write_slots = attention.decode_slots
            write_rows = None
        else:
            # which rows write is known on the host (RowGroup.writes): no device read to find them
            read = torch.cat([g.read_slots for g in groups])
            writing = [g.write_slots for g in groups if g.writes]
            write_slots = torch.cat(writing) if writing else read[:0]
            write_rows = None if len(writing) == len(groups) else torch.tensor(
                [i for g, s in zip(groups, spans) if g.writes for i in range(s.start, s.stop)], dtype=torch.long,
                device=dev)
        x = a.embed_tokens(tokens)
        ropes = {kind: a.rope(x, encoded, kind) for kind in a.rope_kinds}
        probes = self._probes(groups, spans, positions)
        probes.begin()
        x = self.layers(x, ropes, attention, write_slots, write_rows, read, probes, num_layers)
        logits = self._final(x, groups, spans, probes) if num_layers is None else [None] * len(groups)
        probes.end()
        return logits

    @staticmethod
    def _probes(groups: list[RowGroup], spans: list[slice], positions: list[int]) -> RowProbes | DigestProbes:
        """The forward's probes: its captures digested together where every sink records the
        same digests only (a digest trace outside its zoom window) and some sink has several rows
        (a prompt's); else handed over as made (a sink logs a decode step's one row, and digests
        it in the layout of the steps before: probes/recorder.py)."""
        views = sink_views(groups, spans, positions)
        several = any(view.span.stop - view.span.start > 1 for view in views)
        selection = forward_selection(views) if several else None
        if selection is None:
            return RowProbes(views, len(positions))
        return DigestProbes(selection, len(positions), views)

    def layers(self, x: torch.Tensor, ropes: dict, attention: ForwardAttention, write_slots: torch.Tensor,
               write_rows: torch.Tensor | None, read_slots: torch.Tensor, probes: RowProbes | DigestProbes,
               num_layers: int | None = None) -> torch.Tensor:
        """The decoder layers over embedded rows x: each writes the K/V of rows `write_rows` (None:
        every row) to `write_slots`, attends by `attention`, and shows probes the K/V at each row's
        `read_slots`. Makes no host-to-device copy and
        reads nothing back when no probe records, so a decode step can run it inside a CUDA graph
        (decode_graph.py)."""
        a = self.adapter
        layers = a.layers[: num_layers or len(a.layers)]
        for i, layer in enumerate(layers):
            if x.device != layer.device:   # a model split across GPUs: follow its layers
                x = x.to(layer.device)
                write_rows = write_rows.to(layer.device) if write_rows is not None else None
                attention = attention.to(layer.device)
            probes.capture("resid_pre", i, x)
            h = layer.input_layernorm(x)
            probes.capture("attn_norm", i, h)
            probes.norm("attn_norm", i, x, h)
            cos, sin = ropes[layer.rope_kind]
            if cos.device != x.device:     # the rotary module may sit on another GPU than the layer
                cos, sin = ropes[layer.rope_kind] = cos.to(x.device), sin.to(x.device)
            q, k, v = a.qkv(layer, h)
            probes.capture("k_pre_rope", i, k)
            if self.fused_rope and q.stride(-1) == 1 and k.stride(-1) == 1 and (
                    not self.exact or rope_kernel.rounds_like_torch(q, k, cos, sin)):
                q, k = rope_kernel.rotate(q, cos, sin, self.exact), rope_kernel.rotate(k, cos, sin, self.exact)
            else:
                q, k = a.rotate_q(q, cos, sin), apply_rope(k, cos, sin)
            if write_rows is None:
                self.pool.write(i, write_slots, k, v)
            elif write_rows.numel():
                self.pool.write(i, write_slots, k[write_rows], v[write_rows])
            o = attention.attend(self.pool, i, layer.window, q, a.scaling, layer.sinks)
            if layer.sinks is not None:
                probes.capture("attn_sinks", i, layer.sinks.detach().expand(q.shape[0], -1))
            probes.capture("q", i, q)
            probes.read(self.pool, i, read_slots, a.value_point)
            o = o.reshape(o.shape[0], -1)
            probes.capture("z", i, o)
            attn_out = layer.o_proj(o)
            probes.capture("attn_out", i, attn_out)
            if layer.attn_post_norm is not None:
                attn_out = self._post_norm("attn_post_norm", i, layer.attn_post_norm, attn_out, probes)
            x = x + attn_out
            probes.capture("resid_mid", i, x)
            h = layer.post_attention_layernorm(x)
            probes.capture("mlp_norm", i, h)
            probes.norm("mlp_norm", i, x, h)
            m = self._dense(i, layer, h, probes) if layer.router is None else self._experts(i, layer, h, probes)
            probes.capture("mlp_out", i, m)
            if layer.mlp_post_norm is not None:
                m = self._post_norm("mlp_post_norm", i, layer.mlp_post_norm, m, probes)
            x = x + m
            probes.capture("resid_post", i, x)
        return x

    def unprobed_layers(self, x: torch.Tensor, ropes: dict, attention: ForwardAttention,
                        slots: torch.Tensor) -> torch.Tensor:
        """`layers` for a decode step no probe records: row i writes its K/V to `slots[i]`."""
        return self.layers(x, ropes, attention, slots, None, slots, RowProbes([], 0))

    @staticmethod
    def _post_norm(point: str, i: int, norm, rows: torch.Tensor, probes: RowProbes | DigestProbes) -> torch.Tensor:
        """A norm of a sublayer's output before its residual add (Gemma 3), probed."""
        out = norm(rows)
        probes.capture(point, i, out)
        probes.norm(point, i, rows, out)
        return out

    @staticmethod
    def _experts(i: int, layer, h: torch.Tensor, probes: RowProbes | DigestProbes) -> torch.Tensor:
        """A mixture-of-experts layer: the router chooses each row's experts, the experts mix (and
        DeepSeek's shared expert adds its output)."""
        router_logits, weights, chosen = layer.router(h)
        probes.capture("router_logits", i, router_logits)
        if probes.active and probes.wants("experts", i):
            probes.capture("experts", i, chosen.float())
        out = layer.experts(h, chosen, weights)
        return out if layer.shared_experts is None else out + layer.shared_experts(h)

    def _dense(self, i: int, layer, h: torch.Tensor, probes: RowProbes | DigestProbes) -> torch.Tensor:
        """A dense MLP; in a model mixing it with mixture-of-experts layers, its router points get
        `dense_router_rows`."""
        if probes.active and self.experts_shape and any(probes.wants(p, i) for p in MOE_POINTS):
            for point, rows in zip(MOE_POINTS, dense_router_rows(h, *self.experts_shape)):
                probes.capture(point, i, rows)
        return layer.mlp(h)

    def _final(self, x: torch.Tensor, groups: list[RowGroup], spans: list[slice], probes: RowProbes | DigestProbes):
        """The float32 logits row of each group that asks for one; the final points of the rows the
        probes record."""
        final = self.adapter.final_norm.weight.device
        probed = probes.final_rows()
        if len(probed) == x.shape[0]:       # every row (a probed prompt's): no gather, no index of thousands
            order, index = list(range(x.shape[0])), None
            inp = x.to(final)
        else:
            rows = probed | {s.stop - 1 for g, s in zip(groups, spans) if g.logits}
            if not rows:
                return [None] * len(groups)
            order = sorted(rows)
            index = {r: n for n, r in enumerate(order)}
            inp = x.index_select(0, torch.tensor(order, device=x.device)).to(final)
        normed = self.adapter.final_norm(inp)
        logits = self.adapter.lm_head(normed.to(self.adapter.lm_head.weight.device)).float()
        probes.final(order, inp, normed, logits)
        out = [logits[s.stop - 1 if index is None else index[s.stop - 1]] if g.logits else None
               for g, s in zip(groups, spans)]
        if len(order) > sum(g.logits for g in groups):
            # the probes' rows: a 32k-token prompt's are GBs, which a view of one row would keep
            out = [None if row is None else row.clone() for row in out]
        return out
