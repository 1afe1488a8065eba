"""llama.cpp (llama-cpp-python, in this process) as an engine under test, for Llama-architecture GGUFs.

The engine runs the GGUF it is handed: by default (`open_target`) a float32 copy of the model's GGUF
(`kvdiff.targets.gguf_float`) holding the reference's own values, so that its tensors differ from
the reference's by llama.cpp's summation order alone; with native weights a quantized GGUF, whose
kernels move every projection from the reference's by quantization, not by a bug. Requests go
through `Llama.generate`, whose prompt cache keeps the longest common prefix of the previous
sequence (`Llama.n_tokens` when it first evaluates: the hit count) and evaluates the rest.

Probe points come from llama.cpp's graph-evaluation callback (`cb_eval`), which hands each named
graph tensor after it is computed: `embd` / `l_out-{i-1}` -> resid_pre, `attn_norm-i`,
`Qcur-i` (the ROPE node) -> q, `Kcur-i` (the projection) -> k_pre_rope and (the ROPE node) -> k,
`Vcur-i` -> v, `kqv_out-i` -> z, `attn_out-i`, `ffn_inp-i` -> resid_mid, `ffn_norm-i` -> mlp_norm, `ffn_out-i` ->
mlp_out, `l_out-i` -> resid_post, `result_norm` -> final_norm, `result_output` -> logits (every row:
the context outputs all rows). A row's position is its place in the sequence (`Llama.n_tokens` before
its batch, plus its index); the batch's `pos`, what RoPE encodes, goes into provenance. q and k of a GGUF with
"normal" RoPE (adjacent pairs; the converter permuted the weights) are put back in the checkpoint's
half-split head layout, as transformers un-permutes them. The KV cache is float32 (llama.cpp's
default is f16, which would also round q inside attention), so `q`, `k` and `v` are what attention
reads. Weight repacking (extra buffer types) is off: native builds crash in its AMX path.
K/V of prompt positions kept from an earlier request are read from the engine's own sequence state
(`llama_state_seq_get_data`) once the request's first forward has written its own rows (what that
forward's attention read, so a write landing on a kept cell shows) and recorded in a `reads_only`
bracket; the engine does not tell which cache cell holds them, so their provenance names no forward
(prefill_id -1).

Longer than ~300 lines because the ctypes side (ggml's tensor accessors, the callback, the parser of
llama.cpp's sequence-state layout) belongs to this one adapter.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from kvdiff.errors import InputError, KvdiffError
from kvdiff.targets.protocol import TargetInfo, TargetRun, computed_provenance, refuse_fixed
from kvdiff.trace.points import ALL_POINTS, LAYER_POINTS
from kvdiff.trace.sink import ProbeSink, Provenance

log = logging.getLogger(__name__)

INSTALL_HINT = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36 (builds from source, ~25 min)'
LAYER_NAMES = {"attn_norm": "attn_norm", "Qcur": "q", "Kcur": "k", "Vcur": "v", "kqv_out": "z", "attn_out": "attn_out",
               "ffn_inp": "resid_mid", "ffn_norm": "mlp_norm", "ffn_out": "mlp_out", "l_out": "resid_post"}
FINAL_NAMES = {"embd": "resid_pre", "result_norm": "final_norm", "result_output": "logits"}
STATE_MAGIC = 0xAF143CD8                 # llama-context.cpp's io_magic, first in a sequence state
VIEW_OPS = {"RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "NONE"}         # share a computed tensor's data

# A tap sees (tensor name, ggml op, rows (T, ...) in the engine's layout, positions) once the engine
# computed them, and may return rows the engine goes on with instead (tests plant bugs so).
Tap = Callable[[str, str, np.ndarray, list], "np.ndarray | None"]


class _TensorHead(ctypes.Structure):        # the leading fields of ggml.h's struct ggml_tensor
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


@dataclass
class CacheState:
    """One sequence's KV cache as the engine saves it: cell positions and, per layer, writable views
    K (cells, kv_heads * head_dim) and V (cells, kv_heads * head_dim) into `raw` (engine layout)."""

    raw: bytearray
    positions: np.ndarray
    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)


# what llama_decode's return codes mean (llama.h), appended to llama-cpp-python's message
DECODE_ERRORS = {"llama_decode returned -1": " (llama.cpp refused the batch as invalid: its tokens, positions or "
                                             "sequence ids, such as positions that do not follow the sequence's last "
                                             "cached one)",
                 "llama_decode returned 1": " (no room in the KV cache for the batch)",
                 "llama_decode returned 2": " (the decode was aborted)"}

# llama_cpp.Llama arguments kvdiff's recording depends on, and why: refused as engine options
FIXED_ARGS = {"model_path": "the reference's GGUF", "logits_all": "every position's logits are recorded",
              "type_k": "the target reads K and V as float32", "type_v": "the target reads K and V as float32",
              "verbose": "llama.cpp's own log lines stay off kvdiff's output"}


class LlamaCppTarget:
    """A llama.cpp engine (llama-cpp-python's `Llama`) on a GGUF, greedy, recording through `cb_eval`.
    `llm` (the Llama) and `taps` are open so tests can plant bugs through the engine's own hooks."""

    points: tuple[str, ...] = ALL_POINTS

    def __init__(self, gguf: Path, n_ctx: int = 2048, n_threads: int | None = None,
                 llama_args: Mapping[str, Any] | None = None):
        gguf = Path(gguf)
        if not gguf.is_file():
            raise InputError(f"{gguf}: no such GGUF file")
        refuse_fixed(llama_args, FIXED_ARGS, "llama.cpp")
        settings = {"n_ctx": n_ctx, "n_batch": 512, "n_ubatch": 512, "n_threads": n_threads,
                    "n_threads_batch": n_threads, **(llama_args or {})}
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as lib
            from llama_cpp._ctypes_extensions import load_shared_library
        except ImportError as exc:
            raise InputError(f"llama.cpp is not installed: {INSTALL_HINT}") from exc
        self.lib, self.taps, self._fwd, self._run, self._error = lib, [], None, None, None
        self._ggml = ggml = load_shared_library("ggml-base", Path(llama_cpp.__file__).parent / "lib")
        for name, res, args in (("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
                                ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
                                ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
                                ("ggml_backend_tensor_get", None, [ctypes.c_void_p] * 2 + [ctypes.c_size_t] * 2),
                                ("ggml_backend_tensor_set", None, [ctypes.c_void_p] * 2 + [ctypes.c_size_t] * 2)):
            getattr(ggml, name).restype, getattr(ggml, name).argtypes = res, args
        self._cb = lib.ggml_backend_sched_eval_callback(self._eval)
        try:
            with _default_params(lib, self._cb):
                self.llm = llama_cpp.Llama(str(gguf), logits_all=True, type_k=0, type_v=0,    # GGML_TYPE_F32
                                           verbose=False, **settings)
        except (TypeError, ValueError) as exc:
            if not llama_args:
                raise KvdiffError(f"llama.cpp failed: {exc}") from exc
            raise InputError(f"--engine-option: llama.cpp does not start with {dict(llama_args)}: {exc}") from exc
        except Exception as exc:
            raise KvdiffError(f"llama.cpp failed: {exc}") from exc
        arch = self.llm.metadata.get("general.architecture")
        if arch != "llama":
            self.close()
            raise InputError(f"{gguf}: architecture {arch!r} is not supported by the llama.cpp target "
                             "(it reads the tensors of llama.cpp's llama graph: Llama-architecture GGUFs only)")
        model = self.llm.model
        self.num_layers = lib.llama_model_n_layer(model)
        self.num_heads, self.num_kv_heads = lib.llama_model_n_head(model), lib.llama_model_n_head_kv(model)
        self.head_dim = lib.llama_model_n_embd(model) // self.num_heads
        self.unpermute = lib.llama_model_rope_type(model) == lib.LLAMA_ROPE_TYPE_NORM
        self._names = {f"{base}-{i}": (base, i) for base in LAYER_NAMES for i in range(self.num_layers)}
        self._names.update({name: (name, None) for name in FINAL_NAMES})
        self.llm.eval = self._evaluate(self.llm.eval)
        self.llm._ctx.decode = self._decode(self.llm._ctx.decode)
        desc = ctypes.create_string_buffer(128)
        lib.llama_model_desc(model, desc, len(desc))         # "llama 135M Q4_1": the weights' type last
        weights = desc.value.decode(errors="replace").split()[-1:] or ["?"]
        self.info = TargetInfo("llama.cpp", llama_cpp.__version__, gguf,
                               None if weights[0] == "F32" else weights[0])
        log.info("llama.cpp %s target on %s: %d layers", llama_cpp.__version__, gguf, self.num_layers)

    # -- the engine's hooks -----------------------------------------------------------------------

    def _evaluate(self, inner):
        """Llama.eval: its first call in a request starts after the prefix the engine kept."""
        def evaluate(tokens):
            run = self._run
            if run is not None and run.hit is None:
                run.hit = int(self.llm.n_tokens)
                if run.sink is not None and run.hit:
                    run.kept = self.read_cache()
            return inner(tokens)
        return evaluate

    def _decode(self, inner):
        """LlamaContext.decode: one engine forward, bracketed with the batch's own positions."""
        def decode(batch):
            # The rows' places in the sequence: the tokens the engine holds before this batch
            # (Llama.n_tokens); the batch's `pos` is what RoPE encodes them at.
            b, start = batch.batch, int(self.llm.n_tokens)
            self._fwd = _Forward(list(range(start, start + b.n_tokens)), [int(b.pos[i]) for i in range(b.n_tokens)])
            self._error = None
            try:
                inner(batch)
                if self._error is not None:
                    raise self._error
            finally:
                fwd, self._fwd = self._fwd, None
            run = self._run
            if run is not None and run.sink is not None:
                self._emit_forward(run, fwd)
                if run.forwards == 0 and run.hit:
                    self._emit_reads(run)
                run.forwards += 1
        return decode

    def _eval(self, t, ask, user_data) -> bool:
        """cb_eval: asked for each graph node, then handed the ones we asked for, computed."""
        fwd = self._fwd
        if fwd is None or not (self.taps or (self._run is not None and self._run.sink is not None)):
            return False
        try:
            name = self._ggml.ggml_get_name(t).decode()
            if name not in self._names:
                return False
            op = self._ggml.ggml_op_desc(t).decode()
            base, layer = self._names[name]
            # a view shares a computed tensor's data: only kqv_out (flash attention's output reshaped) is one
            if (op in VIEW_OPS and base != "kqv_out") or not self._ggml.ggml_is_contiguous(t):
                return False
            if ask:
                return True
            head = _TensorHead.from_address(t)
            if head.type != 0:                  # every tensor we map is float32 on the CPU backend
                raise KvdiffError(f"llama.cpp tensor {name} ({op}) is not float32 (ggml type {head.type})")
            rows = np.empty([n for n in reversed(head.ne[:4])], np.float32).reshape(len(fwd.positions), -1)
            self._ggml.ggml_backend_tensor_get(t, rows.ctypes.data, 0, rows.nbytes)
            for tap in self.taps:
                new = tap(name, op, rows, fwd.positions)
                if new is not None:
                    rows = np.ascontiguousarray(new, np.float32).reshape(rows.shape)
                    self._ggml.ggml_backend_tensor_set(t, rows.ctypes.data, 0, rows.nbytes)
            point = FINAL_NAMES.get(base) or LAYER_NAMES[base]
            if base == "Kcur" and op != "ROPE":
                point = "k_pre_rope"
            elif base == "Qcur" and op != "ROPE":
                return True                     # the query before RoPE is no probe point
            fwd.rows[(point, 0 if base == "embd" else layer)] = rows
            return True
        except BaseException as exc:            # no exception may cross into C: kept, raised after decode
            self._error = self._error or exc
            return False                        # stops this graph's computation

    # -- recording --------------------------------------------------------------------------------

    def _shaped(self, point: str, rows: np.ndarray) -> torch.Tensor:
        """Rows (T, ...) in kvdiff's layout: heads split, RoPE pairs un-interleaved."""
        if point in ("q", "k_pre_rope", "k", "v"):
            rows = rows.reshape(rows.shape[0], -1, self.head_dim)
            if point != "v" and self.unpermute:             # (.., d/2, 2) pairs -> two halves
                rows = rows.reshape(*rows.shape[:2], -1, 2).swapaxes(-1, -2).reshape(rows.shape)
        return torch.from_numpy(np.ascontiguousarray(rows))

    def _emit_forward(self, run: "_Run", fwd: "_Forward") -> None:
        sink, pos, rows = run.sink, fwd.positions, fwd.rows
        for i in range(1, self.num_layers):
            if ("resid_post", i - 1) in rows:
                rows[("resid_pre", i)] = rows[("resid_post", i - 1)]
        sink.begin_forward(pos)
        computed_provenance(sink, pos, fwd.encoded, run.prompt_len, run.forwards)
        last = self.num_layers - 1
        norms = {"attn_norm": "resid_pre", "mlp_norm": "resid_mid", "final_norm": "resid_post"}
        for layer, point in [(i, p) for i in range(self.num_layers) for p in LAYER_POINTS] + \
                            [(None, "final_norm"), (None, "logits")]:
            key = (point, layer)
            if not sink.wants(point, layer) or key not in rows:
                continue                        # a point that did not come: the sink names it
            sink.capture(point, layer, self._shaped(point, rows[key]), pos)
            inp = (norms.get(point), last if layer is None else layer)
            if inp in rows:
                sink.capture_norm(point, layer, torch.from_numpy(rows[inp]), torch.from_numpy(rows[key]), pos)
        sink.end_forward()

    def _emit_reads(self, run: "_Run") -> None:
        """The reads-only bracket of the kept prefix: K/V as the engine's sequence state holds them
        after the request's first forward; a kept position that left the cache during it (evicted,
        so attention did not read it) as the state held it before."""
        after, before = self.read_cache(), run.kept
        now, then = (_cells_below(state, run.hit) for state in (after, before))
        gone = sorted(set(then) - set(now))
        missing = sorted(set(range(run.hit)) - set(now) - set(gone))
        if missing:
            raise KvdiffError(f"llama.cpp kept {run.hit} prompt tokens but its cache holds no row of position"
                              f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
                              f"{'...' if len(missing) > 8 else ''}")
        if gone:
            log.warning("llama.cpp: kept positions %s left the cache during the request's first forward; recorded "
                        "as the cache held them before it", gone[:8])
        cached = list(range(run.hit))
        present = [p for p in cached if p in now]
        sink = run.sink
        sink.begin_forward(cached, reads_only=True)
        sink.provenance(cached, Provenance("cache", -1, cached, True))
        for layer in range(self.num_layers):
            for point in ("k", "v"):
                if sink.wants(point, layer):
                    rows = np.empty((run.hit, getattr(after, point)[layer].shape[1]), np.float32)
                    rows[present] = getattr(after, point)[layer][[now[p] for p in present]]
                    rows[gone] = getattr(before, point)[layer][[then[p] for p in gone]]
                    sink.capture(point, layer, self._shaped(point, rows), cached)
        sink.end_forward()

    # -- the engine's sequence state --------------------------------------------------------------

    def read_cache(self, seq_id: int = 0) -> CacheState:
        """Sequence `seq_id`'s KV cache from `llama_state_seq_get_data`, laid out as llama_context's
        state_seq_get_data (magic, seq id) and llama_kv_cache::state_write write it: streams, cells
        (pos, seq ids), then K of each layer, then V of each layer (transposed when the cache is)."""
        lib, ctx = self.lib, self.llm.ctx
        size = lib.llama_state_seq_get_size(ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        raw = bytearray(memoryview(buf)[:lib.llama_state_seq_get_data(ctx, buf, size, seq_id)])
        off = 0

        def take(fmt: str):
            nonlocal off
            values = struct.unpack_from("<" + fmt, raw, off)
            off += struct.calcsize("<" + fmt)
            return values if len(values) > 1 else values[0]

        magic, _, streams = take("IiI")                     # llama_context's io magic, the seq id
        if magic != STATE_MAGIC or streams != 1:
            raise KvdiffError(f"llama.cpp sequence state (magic {magic:#x}, {streams} streams) is not the one "
                              "the llama.cpp target reads")
        cells = take("I")
        state = CacheState(raw, np.zeros(cells, np.int64))
        if cells == 0:
            return state
        for c in range(cells):
            state.positions[c], n_seq = take("iI")
            off += 4 * n_seq
        v_trans, layers = take("II")
        for part in ("k", "v"):
            for _ in range(layers):
                if (kind := take("i")) != 0:
                    raise KvdiffError(f"llama.cpp cache of ggml type {kind}: the llama.cpp target reads float32")
                if part == "v" and v_trans:
                    width = take("II")[1]
                    view = np.frombuffer(raw, np.float32, width * cells, off).reshape(width, cells).T
                else:
                    width = take("Q") // 4
                    view = np.frombuffer(raw, np.float32, width * cells, off).reshape(cells, width)
                getattr(state, part).append(view)
                off += view.nbytes
        return state

    def write_cache(self, state: CacheState, seq_id: int = 0) -> None:
        """Load a (possibly edited) `read_cache` state back into the engine's sequence `seq_id`."""
        buf = (ctypes.c_uint8 * len(state.raw)).from_buffer(state.raw)
        if self.lib.llama_state_seq_set_data(self.llm.ctx, buf, len(state.raw), seq_id) != len(state.raw):
            raise KvdiffError("llama.cpp did not load the sequence state")

    # -- Target -----------------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        """Greedy decoding of `prompt_ids`; records into `sink` when one is given."""
        ids = [int(i) for i in prompt_ids]
        room = min(self.llm.n_ctx(), len(self.llm.input_ids))      # llama-cpp-python's buffer: the n_ctx asked for
        if len(ids) + max_new_tokens > room:
            raise InputError(f"the request needs {len(ids)} + {max_new_tokens} tokens of context and llama.cpp runs "
                             f"with {room}: give a larger --engine-option n_ctx")
        run = self._run = _Run(sink, len(ids))
        vocab = self.lib.llama_model_get_vocab(self.llm.model)
        tokens, steps = [], []
        try:
            stream = self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
            for token in stream if max_new_tokens > 0 else ():
                row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), (self.llm.n_vocab(),))
                steps.append((len(ids) - 1 + len(tokens), torch.from_numpy(row.copy())))   # the row it sampled
                tokens.append(int(token))
                if len(tokens) >= max_new_tokens or self.lib.llama_vocab_is_eog(vocab, token):
                    break
            stream.close()
        except Exception as exc:
            self.reset_cache()                  # the next request starts cold on a clean cache
            if isinstance(exc, KvdiffError):    # the sink's own error, or one raised in cb_eval
                raise
            raise KvdiffError(f"llama.cpp failed: {exc}{DECODE_ERRORS.get(str(exc), '')}") from exc
        finally:
            self._run = None
        margins = []
        for step, ((position, row), token) in enumerate(zip(steps, tokens)):
            top = row.topk(2).values
            margins.append(float(top[0] - top[1]))
            if sink is not None:
                sink.capture_step(step, position, row, token)
        hit = run.hit or 0
        log.info("llama.cpp: %d prompt tokens, %d kept from the previous sequence, %d generated", len(ids), hit,
                 len(tokens))
        text = self.llm.detokenize(tokens).decode("utf-8", errors="replace")
        return TargetRun(tokens, text, hit, margins)

    def reset_cache(self) -> None:
        """Forget the kept sequence and clear the engine's KV cache, so the next request is cold."""
        self.llm.reset()
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)

    def close(self) -> None:
        """Free the engine (model, context, batch)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.close()
        self.taps = []


def _cells_below(state: CacheState, hit: int) -> dict[int, int]:
    """Position -> cell of the sequence state's cells holding positions below `hit`."""
    return {int(p): c for c, p in enumerate(state.positions) if p < hit}


class _Forward:
    def __init__(self, positions: list[int], encoded: list[int]):
        self.positions, self.encoded, self.rows = positions, encoded, {}     # rows: (point, layer) -> (T, ...)


class _Run:
    def __init__(self, sink: ProbeSink | None, prompt_len: int):
        self.sink, self.prompt_len, self.hit, self.forwards = sink, prompt_len, None, 0    # hit: kept prefix
        self.kept: CacheState | None = None         # the sequence state as the first forward found it


@contextlib.contextmanager
def _default_params(lib, callback):
    """While `Llama` starts: its context gets `cb_eval` (llama-cpp-python has no argument for it) and
    its model `use_extra_bufts=False` (native builds crash in AMX batched matmuls on some CPUs)."""
    model_defaults, context_defaults = lib.llama_model_default_params, lib.llama_context_default_params

    def with_fields(defaults, **fields):
        def params():
            p = defaults()
            for name, value in fields.items():
                setattr(p, name, value)
            return p
        return params

    lib.llama_model_default_params = with_fields(model_defaults, use_extra_bufts=False)
    lib.llama_context_default_params = with_fields(context_defaults, cb_eval=callback)
    try:
        yield
    finally:
        lib.llama_model_default_params, lib.llama_context_default_params = model_defaults, context_defaults
