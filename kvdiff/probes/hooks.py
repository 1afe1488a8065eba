"""Attach a ProbeSink to a transformers model: module hooks plus an attention-function wrapper.

Module hooks follow a ProbeSpec; they are taps on the modules' forwards (probes/taps.py: torch's
own hooks cost more host time than a decode step's captures). q and k (after RoPE, as attention reads them) come from an
attention function registered with transformers' AttentionInterface, with the matching
AttentionMaskInterface entry (without it the mask arrives as None: silently non-causal). The
wrapper delegates to the model's previous implementation, looked up by name at call time, so
another wrapper installed before this one keeps working.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

import torch

from kvdiff.trace.format import dense_router_rows
from kvdiff.trace.points import MOE_POINTS
from kvdiff.trace.sink import ProbeIntegrityError, ProbeSink, Provenance
from kvdiff.probes.model_meta import experts_shape
from kvdiff.probes.taps import Taps
from kvdiff.probes.spec import ProbeRule, ProbeSpec, default_spec

log = logging.getLogger(__name__)


class ModelProbes:
    """Context manager hooking `sink` into `model`; it is also the sink the generation loop calls.

    The loop calls `begin_forward(positions)` before each model forward and `end_forward()` after;
    hooks capture at those positions. All hooks and the attention function are removed on exit.
    """

    def __init__(self, model: torch.nn.Module, sink: ProbeSink, spec: ProbeSpec | None = None):
        self.model = model
        self.sink = sink
        self.spec = spec or default_spec(model)
        self._taps = Taps()
        self._positions: list[int] | None = None
        self._attn_key: str | None = None
        self._previous_attn: str | None = None

    # -- attaching ---------------------------------------------------------------------------

    def __enter__(self) -> "ModelProbes":
        try:
            self._attach_modules()
            self._attach_attention()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _attach_modules(self) -> None:
        matched = {rule: 0 for rule in self.spec.rules}
        taps: dict[torch.nn.Module, tuple[list[Callable], list[Callable]]] = {}
        for rule, name, module, layer in self.spec.matches(self.model):
            matched[rule] += 1
            if not self.sink.wants(rule.point, layer):
                continue
            before, after = taps.setdefault(module, ([], []))
            if rule.kind == "input":
                before.append(self._input_hook(rule.point, layer))
            else:
                after.append(self._output_hook(rule, layer))
        for module, (before, after) in taps.items():
            self._taps.add(module, before, after)
        dense = self._attach_dense_layers()
        log.debug("attached probes to %d modules of %s", len(taps) + dense, type(self.model).__name__)
        unmatched = [f"{r.pattern!r} ({r.point})" for r, n in matched.items() if n == 0]
        if unmatched:
            raise ProbeIntegrityError(f"probe spec rule(s) {', '.join(unmatched)} match no module of "
                                      f"{type(self.model).__name__}: fix the patterns or pass spec=")

    def _attach_dense_layers(self) -> int:
        """In a model mixing dense and mixture-of-experts layers, a dense layer's MLP gives its
        router points `dense_router_rows` (no router ran there). Returns how many it tapped."""
        num_experts, per_token = experts_shape(self.model)       # a walk of the model up to its first router
        layers = self.model.model.layers[: self.model.config.num_hidden_layers] if num_experts else ()
        tapped = 0
        for layer, block in enumerate(layers):
            routed = hasattr(block.mlp, "gate") or hasattr(block.mlp, "router")     # gpt-oss's is `router`
            if routed or not any(self.sink.wants(p, layer) for p in MOE_POINTS):
                continue

            def hook(module, args, kwargs, output, layer=layer):
                logits, experts = dense_router_rows(output[0], num_experts, per_token)
                for point, rows in zip(MOE_POINTS, (logits, experts)):
                    if self.sink.wants(point, layer):
                        self.sink.capture(point, layer, rows.unsqueeze(0), self._at(output, point))

            self._taps.add(block.mlp, (), [hook])
            tapped += 1
        return tapped

    def _attach_attention(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        layers = range(self.model.config.num_hidden_layers)
        if not any(self.sink.wants(p, i) for p in self.spec.attention_points for i in layers):
            return
        previous = self.model.config._attn_implementation
        key = f"kvdiff_probe_{id(self)}"
        AttentionInterface.register(key, self._attention_function(previous))
        AttentionMaskInterface.register(key, lambda *a, **kw: ALL_MASK_ATTENTION_FUNCTIONS[previous](*a, **kw))
        self._attn_key, self._previous_attn = key, previous
        self.model.set_attn_implementation(key)

    def __exit__(self, exc_type, exc, tb) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self._taps.remove()
        if self._attn_key is not None:
            self.model.set_attn_implementation(self._previous_attn)
            AttentionInterface._global_mapping.pop(self._attn_key, None)
            AttentionMaskInterface._global_mapping.pop(self._attn_key, None)
            self._attn_key = None

    # -- hooks -------------------------------------------------------------------------------

    def _at(self, rows: torch.Tensor, what: str) -> list[int]:
        """The forward's positions, for `rows` (1, T, ...) of `what`: sinks take T rows with a
        leading batch dimension of one, which saves a device call per capture."""
        positions = self._positions
        if positions is None:
            raise ProbeIntegrityError(f"{what} fired outside a forward: call begin_forward before the model")
        if rows.shape[0] != 1:
            raise ProbeIntegrityError(f"{what}: probes record batch size 1, got a batch of {rows.shape[0]}")
        return positions

    def _input_hook(self, point: str, layer: int | None) -> Callable:
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.sink.capture(point, layer, x, self._at(x, point))

        return hook

    def _output_hook(self, rule: ProbeRule, layer: int | None) -> Callable:
        config, point, with_norm = self.model.config, rule.point, rule.kind == "norm"

        def hook(module, args, kwargs, output):
            out = rule.rows(output, config)
            positions = self._at(out, point)
            self.sink.capture(point, layer, out, positions)
            if with_norm:
                x = args[0] if args else kwargs["hidden_states"]
                self.sink.capture_norm(point, layer, x, out, self._at(x, point))

        return hook

    def _attention_function(self, previous: str) -> Callable:
        from transformers import AttentionInterface

        interface = AttentionInterface()
        layers = range(self.model.config.num_hidden_layers)
        q_layers, k_layers, sink_layers = (
            {i for i in layers if point in self.spec.attention_points and self.sink.wants(point, i)}
            for point in ("q", "k", "attn_sinks"))

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            layer = module.layer_idx
            positions = self._at(query, "attention")
            n = query.shape[2]
            if layer in q_layers:
                self.sink.capture("q", layer, query.transpose(1, 2), positions)
            if layer in k_layers:
                # With a cache, attention reads every cached key: the current rows are the last n.
                # MLA's: the RoPE key its heads share, the last columns of every head's key.
                rows = key[:, :1, -n:, module.qk_nope_head_dim:] if self.spec.latent_attention else key[:, :, -n:]
                self.sink.capture("k", layer, rows.transpose(1, 2), self._at(key, "k"))
            if layer in sink_layers:        # gpt-oss passes its sinks to the attention function
                self.sink.capture("attn_sinks", layer, kwargs["s_aux"].expand(1, n, -1), positions)
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            inner = interface.get_interface(previous, eager)
            return inner(module, query, key, value, attention_mask, *args, **kwargs)

        return attention

    # -- ProbeSink, for the generation loop --------------------------------------------------

    def wants(self, point: str, layer: int | None) -> bool:
        return self.sink.wants(point, layer)

    def begin_forward(self, positions: Sequence[int], reads_only: bool = False) -> None:
        self._positions = [int(p) for p in positions]
        self.sink.begin_forward(self._positions, reads_only=reads_only)

    def capture(self, point: str, layer: int | None, rows: torch.Tensor, positions: Sequence[int]) -> None:
        self.sink.capture(point, layer, rows, positions)

    def capture_norm(self, norm: str, layer: int | None, norm_input: torch.Tensor, norm_output: torch.Tensor,
                     positions: Sequence[int]) -> None:
        self.sink.capture_norm(norm, layer, norm_input, norm_output, positions)

    def provenance(self, positions: Sequence[int], source: Provenance) -> None:
        self.sink.provenance(positions, source)

    def capture_step(self, step: int, position: int, logits_row: torch.Tensor, token_id: int) -> None:
        self.sink.capture_step(step, position, logits_row, token_id)

    def end_forward(self) -> None:
        self._positions = None
        self.sink.end_forward()


def attach_probes(model: torch.nn.Module, sink: ProbeSink, spec: ProbeSpec | None = None) -> ModelProbes:
    """`with attach_probes(model, recorder) as probes: reference_generate(..., sink=probes)`."""
    return ModelProbes(model, sink, spec)
