"""TraceRecorder: the ProbeSink that checks integrity and streams captures into a trace.

Longer than ~300 lines because the sink protocol is one state machine (forward brackets,
repeated decode layouts, K/V-only reads, the integrity check at each end): split, each half
would need the other's state.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from kvdiff.conversation import render_prompt_ids
from kvdiff.errors import InputError
from kvdiff.probes.digests import DigestTaker, changed_in_place
from kvdiff.probes.model_meta import build_meta, latent_weights, model_dims, norm_eps, norm_modules, router_biases
from kvdiff.trace.points import FINAL_NORMS, FINAL_POINTS, LAYER_NORMS, READ_POINTS
from kvdiff.probes.selection import Selection
from kvdiff.trace.ranges import format_ranges
from kvdiff.trace.sink import ProbeIntegrityError, Provenance
from kvdiff.probes.spec import ProbeSpec, default_spec
from kvdiff.trace.staging import StageLayout, version_of
from kvdiff.trace.format import ChunkRecord, ModelDims, point_group
from kvdiff.trace.writer import TraceWriter


STEPS_HELD = 64     # generated steps whose logits rows wait (on their device) for one top-k


@dataclass(frozen=True)
class _Target:
    """Where the captures of one (point, layer) go: the dataset (or norm statistics group) and row shape."""

    key: tuple[str, int | None]
    name: str | None              # None: outside a digest trace's window, so digested only
    shape: tuple[int, ...]
    size: int
    digest: bool = False          # a digest trace: the rows are digested (every row of every point)
    keys: bool = False            # kept at the window's key positions too (k and v)


@dataclass(frozen=True)
class _Repeat:
    """A complete one-position forward whose layout the next decode steps are expected to repeat:
    what fired, in order, and how the writer staged it."""

    reads_only: bool
    fired: list[tuple[str, int | None]]
    staged: StageLayout | None                  # None in a digest trace, whose steps stage nothing
    owners: list[tuple[str, int | None]]        # each logged tensor's (point, layer): a norm logs two
    digested: list[int]                         # digest trace: the logged tensors digested (not norm inputs)
    digest_sizes: list[int]                     # and their sizes


def _wrong_rows(point: str, layer: int | None, rows: torch.Tensor, positions: int,
                shape: tuple[int, ...]) -> ProbeIntegrityError:
    """The error for captured rows that do not hold the forward's positions: whole rows of another
    count (the engine or its adapter handed rows of other positions), or rows of another shape."""
    where, size = f"probe {point!r} of layer {layer}", math.prod(shape)
    if rows.numel() % size == 0 and (rows.dim() < 2 or tuple(rows.shape[-len(shape):]) == shape
                                     or rows.shape[-1] == size):
        return ProbeIntegrityError(f"{where}: {rows.numel() // size} rows captured for the forward's {positions} "
                                   "positions: the engine (or its adapter) handed rows of other positions than it "
                                   "bracketed (begin_forward's)")
    return ProbeIntegrityError(f"{where}: rows of shape {tuple(rows.shape)} do not hold {positions} positions of shape "
                               f"{shape} (the model's, from its config): what runs is not the model the trace "
                               "describes (another checkpoint, or settings that change its shapes, such as its KV heads)")


def _owners(fired: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """Each logged tensor's (point, layer), for captures logged in `fired` order: a norm logs two."""
    return [key for key in fired for _ in range(2 if key[0].startswith("stats:") else 1)]


def _repeat_of(reads_only: bool, fired: list[tuple[str, int | None]], staged: StageLayout | None,
               sizes: Callable[[tuple[str, int | None]], int] | None) -> _Repeat:
    """The layout of a complete one-position forward; `sizes` (a digested point's row size) in a
    digest trace."""
    owners = _owners(fired)
    digested = [] if sizes is None else [i for i, key in enumerate(owners) if not key[0].startswith("stats:")]
    return _Repeat(reads_only, fired, staged, owners, digested, [sizes(owners[i]) for i in digested])


@dataclass(frozen=True)
class _Learned:
    """What holds for every trace of one selection of one model's dims, learned by the first and
    kept for the next (a short request's trace paid ~1 ms for each again): where each (point,
    layer) goes (`TraceRecorder._resolve`), and the forwards' (reads only, fired) found complete."""

    targets: dict[tuple[str, int | None], _Target | None]
    complete: set[tuple[bool, tuple[tuple[str, int | None], ...]]]


LEARNED_SELECTIONS = 8      # the selections whose _Learned are kept (a compare run uses two or three)
LEARNED_LAYOUTS = 64        # the complete layouts kept a selection (a run has a few: prompt, reads, steps)
_learned: dict[tuple, _Learned] = {}


def _learned_for(selection: Selection, digested: Selection | None, dims: ModelDims) -> _Learned:
    """The _Learned of (`selection`, `digested`, `dims`), all values: the same for any recorder of them."""
    key = (selection, digested, dims)
    found = _learned.get(key)
    if found is None:
        if len(_learned) >= LEARNED_SELECTIONS:
            _learned.pop(next(iter(_learned)), None)
        found = _learned[key] = _Learned({}, set())
    return found


class TraceRecorder:
    """Implements ProbeSink: selected captures go to `writer` as they arrive.

    Integrity: between `begin_forward` and `end_forward` every declared (point, layer), and the
    statistics of every selected norm, must be captured exactly once.

    Decode steps: once a one-position forward was complete, a later one-position forward only
    logs its captures (their keys, tensors and version counters), and `end_forward` hands them
    to the writer together when they repeat that forward's layout, or one by one when they do not.
    A decode step hands over hundreds of captures; this keeps the work per capture to a few appends.
    """

    def __init__(self, writer: TraceWriter, dims: ModelDims, selection: Selection, top_k: int = 5,
                 digested: Selection | None = None, max_positions: int | None = None):
        """`selection`: the rows written in full. `digested`: in a digest trace, the rows digested
        (every position of its points and layers); `selection` is then its zoom window.
        `max_positions`: the prompt's tokens plus the most new ones, where known: a forward past them
        is refused as it begins."""
        self.writer = writer
        self.max_positions = max_positions
        self.dims = dims
        self.selection = selection
        self.top_k = top_k
        self.digested = digested
        self._declared = digested or selection              # what must fire in every forward
        self._window = np.array(sorted(selection.positions or ()), dtype=np.int64)     # the positions kept, if not all
        self._keys = np.array(sorted(selection.keys), dtype=np.int64)       # and those where k and v are kept too
        self._key_only: set[int] = set()              # computed positions where only k and v were kept
        self._keyed_for: Sequence[int] | None = None
        self._keyed_cache: tuple[np.ndarray, np.ndarray | None] = (np.zeros(0, np.int64), None)
        self._digests = None if digested is None else DigestTaker(writer, digested.points, digested.layers)
        self._positions: list[int] | None = None
        self._reads_only = False
        self._read_positions: set[int] = set()         # recorded in reads-only brackets (cache rows)
        self._computed_positions: set[int] = set()     # recorded in forwards that computed them
        self._run_end = 0                              # one past the last position of any forward
        self._window_kept = selection.positions is None    # whether the positions chosen kept a row yet
        self._fired: list[tuple[str, int | None]] = []      # what fired in this forward, in order
        self._checked: tuple[bool, list] | None = None     # (reads only, fired) of the last forward found complete
        self._learned = _learned_for(selection, digested, dims)
        self._targets = self._learned.targets
        self._kept_for: Sequence[int] | None = None
        self._kept_cache: tuple[np.ndarray, np.ndarray | None] = (np.zeros(0, np.int64), None)
        self._repeat: _Repeat | None = None
        self._logging: Sequence[int] | None = None       # the caller's positions while captures are logged
        self._logged: list[tuple[str, int | None]] = []
        self._log: list[torch.Tensor] = []
        self._log_versions: list[int | None] = []
        self._all_for: Sequence[int] | None = None
        self._all_cache = np.zeros(0, np.int64)
        self._digested_where_run = False      # this forward's digests came with take_digested
        self._digested_of: tuple[list, list] = ([], [])     # the last `fired` taken, and its points' keys
        self._steps: list[tuple[int, int, int, torch.Tensor]] = []     # generated steps and copies of their logits rows
        # steps whose top-k values and ids wait where they were taken, to come to the host together at the end
        self._step_topk: list[tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]] = []

    @classmethod
    def for_model(cls, model, tokenizer, messages: list[dict], path: str | os.PathLike, *,
                  strategy: str = "reference", numerics: str = "fast", input_ids: Sequence[int] | None = None,
                  capture: str | Iterable[str] | None = None, layers: str | Iterable[int] | None = None,
                  positions: str | Iterable[int] | None = None, spec: ProbeSpec | None = None,
                  compression: str | None = None, top_k: int = 5,
                  fingerprint: str | None = None, max_new_tokens: int | None = None,
                  trace_mode: str = "full", window_final: bool | None = None,
                  key_positions: str | Iterable[int] | None = None) -> "TraceRecorder":
        """A recorder writing a trace of `model` (any path: reference, engine) to `path`.

        `input_ids` default to the conversation rendered with the chat template. Norm weights and
        epsilons, those of the layers with full rows (and the final norm's with the final points),
        are found with `spec` (default: the architecture's built-in spec); with latent
        attention, each recorded layer's kv_b_proj is written too where kv_latent is captured, and
        with DeepSeek's routing its router bias where router_logits are.
        `max_new_tokens`, if known, sizes a short trace's file to its rows (`TraceWriter`).
        `trace_mode` "digest": every row of the `capture` points of every layer is digested, and
        `layers` x `positions` is the zoom window of full rows (default: none), with the final
        points when `window_final` (None: when the window holds the last layer), and k and v of its
        layers at `key_positions` too (the keys attention read at the window's rows).
        """
        dims = model_dims(model)
        digested = None
        if trace_mode == "digest":
            digested = Selection.parse(dims.num_layers, capture, None, None, dims.points())
            selection = digested.window(layers, positions, window_final, key_positions)
        else:
            selection = Selection.parse(dims.num_layers, capture, layers, positions, dims.points())
        ids = list(input_ids) if input_ids is not None else render_prompt_ids(tokenizer, messages)
        meta = build_meta(model, tokenizer, messages, ids, selection, dims, strategy, numerics, fingerprint)
        if digested is not None:
            meta.trace_mode, meta.digest_points, meta.digest_layers = trace_mode, digested.points, digested.layers
        writer = TraceWriter(path, meta, compression=compression,
                             max_positions=None if max_new_tokens is None else len(ids) + max_new_tokens,
                             window_positions=None if digested is None or selection.positions is None
                             else max(1, len(selection.positions)))
        final = any(p in FINAL_POINTS for p in selection.points)
        # a walk of the model: only where some norm's weight is kept
        norms = norm_modules(model, spec or default_spec(model)) if selection.layers or final else {}
        for (layer, norm), module in norms.items():
            if layer in selection.layers or (layer is None and final):
                writer.write_norm_weight(layer, norm, module.weight, norm_eps(module))
        if "kv_latent" in selection.points:      # what expands the latents into each head's K and V
            for layer, weight in latent_weights(model, selection.layers).items():
                writer.write_latent_weight(layer, weight)
        if "router_logits" in selection.points:      # what DeepSeek's choice adds to the router's scores
            for layer, bias in router_biases(model, selection.layers).items():
                writer.write_router_bias(layer, bias)
        return cls(writer, dims, selection, top_k, digested,
                   max_positions=None if max_new_tokens is None else len(ids) + max_new_tokens)

    # -- ProbeSink ---------------------------------------------------------------------------

    def wants(self, point: str, layer: int | None) -> bool:
        return self._declared.wants(point, layer)

    def begin_forward(self, positions: Sequence[int], reads_only: bool = False) -> None:
        if self._positions is not None:
            raise ProbeIntegrityError("begin_forward called twice without end_forward in between")
        if not len(positions):
            raise ProbeIntegrityError("begin_forward over no positions: bracket only a forward that computes (or "
                                      "reads) rows of this request, with their positions")
        self._positions = [int(p) for p in positions]
        if self.max_positions is not None and not 0 <= min(self._positions) <= max(self._positions) < self.max_positions:
            bad, self._positions = (min(self._positions), max(self._positions)), None
            raise ProbeIntegrityError(f"a forward over positions {bad[0]}-{bad[1]}, outside the request's 0-"
                                      f"{self.max_positions - 1} (its prompt and the most new tokens): the engine's "
                                      f"count of the tokens it holds is off")
        self._run_end = max(self._run_end, self._positions[-1] + 1)
        self._reads_only = reads_only
        self._kept_for = None
        if not self._window_kept:
            self._window_kept = bool(self._kept(positions)[0].size)
        kept = self._kept(positions)[0] if self._digests is None else np.asarray(positions, dtype=np.int64)
        (self._read_positions if reads_only else self._computed_positions).update(kept.tolist())
        if self._keys.size and not reads_only:
            self._key_only.update(self._at_keys(positions).tolist())
        self._fired = []
        self._logging = positions if self._repeats(positions, reads_only) else None

    def _repeats(self, positions: Sequence[int], reads_only: bool) -> bool:
        """Whether this forward's captures are logged, to be staged in the last complete
        one-position forward's layout: one position, kept by the selection, and captures that
        stay the same tensors to the end of the forward (no autograd, not in inference mode)."""
        repeat = self._repeat
        if repeat is None or len(positions) != 1 or repeat.reads_only != reads_only:
            return False
        if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return False
        kept, mask = self._kept(positions)
        if self._digests is not None:           # a digest trace's step outside its window: digests only
            return kept.size == 0 and not self._at_keys(positions).size and self._digests.keeps_by_reference
        return mask is None or bool(mask[0])

    def graph_digests(self, positions: Sequence[int]) -> Selection | None:
        """The points and layers digested when a forward at `positions` records digests only (a
        digest trace outside its zoom window, whose captures may wait by reference), so that a
        path may digest them together (or inside a CUDA graph's step) and hand them over with
        `take_digested`; None when the forward must be captured as it runs."""
        if self._digests is None or not self._digests.keeps_by_reference:
            return None
        return None if self._kept(positions)[0].size or self._at_keys(positions).size else self.digested

    def take_digested(self, fired: list[tuple[str, int | None]], hashes: torch.Tensor, stats: torch.Tensor) -> None:
        """A forward's captures, digested where they ran (`graph_digests`): `fired`, each
        capture's (point, layer) in order ("stats:" + the norm for a norm's), and `hashes` (T, n)
        and `stats` (T, n, 2) of its T positions' rows of its points, in that order. The same
        `fired` object each step saves comparing it again."""
        if self._positions is None or hashes.shape[:1] != (len(self._positions),):
            raise ProbeIntegrityError("take_digested takes the digests of a forward's rows inside its bracket, a "
                                      "row of them for each of begin_forward's positions")
        if self._fired or self._logged:
            raise ProbeIntegrityError("take_digested after captures of the same forward: a forward's captures are "
                                      "either digested where they ran or captured, not both")
        self._fired, self._logging, self._digested_where_run = fired, None, True
        if self._digested_of[0] is not fired:
            self._digested_of = (fired, [key for key in fired if not key[0].startswith("stats:")])
        self._digests.take_digested(self._digested_of[1], hashes, stats, np.asarray(self._positions, dtype=np.int64))

    def _kept(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Positions to keep and, when some are dropped, the boolean mask selecting their rows.
        The paths hand every capture of a forward the same positions object: computed once per
        forward for it."""
        if positions is self._kept_for:
            return self._kept_cache
        self._kept_for, self._kept_cache = positions, self._kept_now(positions)
        return self._kept_cache

    def _at_keys(self, positions: Sequence[int]) -> np.ndarray:
        """The positions of `positions` that are the window's key positions (none outside a window, nor
        in a forward past the last of them, as a decode step's: asked up to four times a forward)."""
        if not self._keys.size or min(positions) > self._keys[-1]:
            return self._keys[:0]
        return np.intersect1d(np.asarray(positions, dtype=np.int64), self._keys)

    def _kept_with_keys(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """`_kept` for k and v where the window keeps its keys: its positions and the key positions."""
        if positions is self._keyed_for:
            return self._keyed_cache
        pos = np.asarray(positions, dtype=np.int64)
        mask = np.isin(pos, self._window) | np.isin(pos, self._keys)
        self._keyed_for, self._keyed_cache = positions, (pos[mask], mask)
        return self._keyed_cache

    def _all_positions(self, positions: Sequence[int]) -> np.ndarray:
        """`positions` as int64, made once per forward (the paths hand every capture the same object)."""
        if positions is not self._all_for:
            self._all_for, self._all_cache = positions, np.asarray(positions, dtype=np.int64)
        return self._all_cache

    def _kept_now(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        pos = np.asarray(positions, dtype=np.int64)
        if self.selection.positions is None:
            return pos, None
        window = self._window
        mask = window[np.minimum(np.searchsorted(window, pos), window.size - 1)] == pos if window.size else \
            np.zeros(pos.size, dtype=bool)
        return pos[mask], mask

    def _resolve(self, point: str, layer: int | None) -> "_Target | None":
        """Where captures of (point, layer) go, or None when they are not selected; kept in
        `_targets`, which the capture methods read first."""
        key = (point, layer)
        name = point.removeprefix("stats:")
        full = self.selection.wants(name, layer)
        digest = self.digested is not None and self.digested.wants(name, layer)
        if not (full or digest):
            target = None
        elif point.startswith("stats:"):
            target = _Target(key, f"{point_group(layer)}/norm_stats/{point[6:]}" if full else None, (), 0)
        else:
            shape = self.dims.point_shape(point)
            target = _Target(key, f"{point_group(layer)}/{point}" if full else None, shape, math.prod(shape), digest,
                             full and self.selection.keeps_keys(name))
        self._targets[key] = target
        return target

    @staticmethod
    def _outside_forward(kind: str, name: str, layer: int | None) -> ProbeIntegrityError:
        return ProbeIntegrityError(f"{kind} {name!r} of layer {layer} captured outside a forward: "
                                   "call begin_forward first")

    def capture(self, point: str, layer: int | None, rows: torch.Tensor, positions: Sequence[int]) -> None:
        if positions is self._logging:
            self._logged.append((point, layer))
            self._log.append(rows)
            self._log_versions.append(version_of(rows))
            return
        key = (point, layer)
        target = self._targets[key] if key in self._targets else self._resolve(point, layer)
        if target is None:
            return
        if self._positions is None:
            raise self._outside_forward("probe", point, layer)
        self._fired.append(target.key)
        if rows.numel() != len(positions) * target.size:
            raise _wrong_rows(point, layer, rows, len(positions), target.shape)
        if target.digest:
            self._digests.take(point, layer, rows, self._all_positions(positions))
            if target.name is None:
                return
        pos, mask = self._kept_with_keys(positions) if target.keys else self._kept(positions)
        if pos.size == 0:
            return
        if mask is not None:
            rows = rows.reshape(len(positions), *target.shape)[torch.from_numpy(mask).to(rows.device)]
        self.writer.write_rows_at(target.name, pos, rows, (pos.size, *target.shape))

    def capture_norm(self, norm: str, layer: int | None, norm_input: torch.Tensor, norm_output: torch.Tensor,
                     positions: Sequence[int]) -> None:
        if positions is self._logging:
            self._logged.append(("stats:" + norm, layer))
            self._log += (norm_input, norm_output)
            self._log_versions += (version_of(norm_input), version_of(norm_output))
            return
        key = ("stats:" + norm, layer)
        target = self._targets[key] if key in self._targets else self._resolve(*key)
        if target is None:
            return
        if self._positions is None:
            raise self._outside_forward("norm", norm, layer)
        self._fired.append(target.key)
        if target.name is None:
            return
        x_rows = norm_input.numel() // max(norm_input.shape[-1], 1)
        y_rows = norm_output.numel() // max(norm_output.shape[-1], 1)
        if x_rows != len(positions) or y_rows != len(positions):
            raise ProbeIntegrityError(f"norm {norm!r} of layer {layer}: {x_rows} input and {y_rows} output "
                                      f"rows for {len(positions)} positions")
        pos, mask = self._kept(positions)
        if pos.size == 0:
            return
        x, y = norm_input, norm_output
        if mask is not None:
            keep = torch.from_numpy(mask)
            x = x.reshape(x_rows, -1)[keep.to(x.device)]
            y = y.reshape(y_rows, -1)[keep.to(y.device)]
        self.writer.write_norm_at(target.name, pos, x, y)

    def provenance(self, positions: Sequence[int], source: Provenance) -> None:
        pos, mask = self._kept(positions) if self._digests is None else (np.asarray(positions, dtype=np.int64), None)
        encoded = np.asarray(source.encoded_positions, dtype=np.int64)
        if encoded.size != len(positions):
            raise ProbeIntegrityError(f"provenance of chunk {source.chunk!r}: {encoded.size} encoded positions "
                                      f"for {len(positions)} positions")
        self.writer.write_provenance(pos, source.chunk, source.prefill_id,
                                     encoded if mask is None else encoded[mask], source.reused)

    def capture_step(self, step: int, position: int, logits_row: torch.Tensor, token_id: int) -> None:
        if logits_row.numel() != self.dims.vocab_size:
            raise ProbeIntegrityError(f"step {step}: a logits row of {logits_row.numel()} values, not the model's "
                                      f"vocabulary of {self.dims.vocab_size}: the engine (or its adapter) handed "
                                      "another row than the one that chose the token")
        # copied: the row may be a CUDA graph's output or an engine's logits buffer, rewritten next step
        self._steps.append((step, position, token_id, logits_row.detach().reshape(1, -1).clone()))
        if len(self._steps) >= STEPS_HELD:
            self._take_topk()

    def _take_topk(self) -> None:
        """One top-k of the held steps' logits rows, where they live; its values and ids stay there
        (reading them back would wait for the GPU, which a decode step then waits for)."""
        if not self._steps:
            return
        steps, self._steps = self._steps, []
        rows = torch.cat([s[3] for s in steps])
        values, ids = rows.topk(min(self.top_k, rows.shape[1]), dim=1)
        self._step_topk.append(([s[:3] for s in steps], values, ids))

    def _write_steps(self) -> None:
        """Hand every step's top-k and margin to the writer: the top-k taken so far come to the
        host in one copy (a few numbers a step)."""
        self._take_topk()
        if not self._step_topk:
            return
        taken, self._step_topk = self._step_topk, []
        steps = [s for held, _, _ in taken for s in held]
        values = torch.cat([v for _, v, _ in taken]).to("cpu", torch.float64).numpy()
        ids = torch.cat([i for _, _, i in taken]).cpu().numpy()
        margins = values[:, 0] - values[:, 1] if values.shape[1] > 1 else np.full(len(steps), np.inf)
        self.writer.append_steps(steps, ids, values, margins)

    def end_forward(self) -> None:
        if self._positions is None:
            raise ProbeIntegrityError("end_forward called outside a forward: call begin_forward first")
        if self._logging is not None and self._end_repeat():
            return
        if (self._reads_only, self._fired) != self._checked:      # decode steps repeat one layout: checked once
            self._check_fired()
        if self._digested_where_run:        # digests held by the DigestTaker: nothing staged, nothing to learn
            self._digested_where_run = False
            self._positions = None
            self.writer.commit()
            return
        kept = self._kept(self._positions)[0].size
        one_position = len(self._positions) == 1 and kept == (1 if self._digests is None else 0) \
            and not self._at_keys(self._positions).size
        self._positions = None
        if self._digests is not None:
            self._digests.end_forward()
        staged = self.writer.commit()
        if one_position:
            sizes = None if self._digests is None else (lambda key: self._targets[key].size)
            self._repeat = _repeat_of(self._reads_only, self._fired, staged, sizes) \
                if staged is not None or sizes is not None else None

    def _end_repeat(self) -> bool:
        """End a forward whose captures were logged: True when they repeat the layout and went to
        the writer together; False when they were handed to the capture methods one by one."""
        repeat, logging = self._repeat, self._logging
        logged, log, versions = self._logged, self._log, self._log_versions
        self._logging, self._logged, self._log, self._log_versions = None, [], [], []
        same = logged == repeat.fired
        owners = repeat.owners if same else _owners(logged)
        if not self._fired and same and (
                [rows.numel() for rows in log] == repeat.staged.numels if self._digests is None else
                [log[i].numel() for i in repeat.digested] == repeat.digest_sizes):
            self._fired = repeat.fired       # equal to `logged`, and what was checked: compared by identity
            if (self._reads_only, self._fired) != self._checked:
                self._check_fired()
            self._positions = None
            if self._digests is None:
                self.writer.commit_repeat(repeat.staged, log, versions, self._kept(logging)[0])
                return True
            self._digest_repeat(repeat, log, versions, self._all_positions(logging))
            return True
        for owner, rows, version in zip(owners, log, versions):
            if version is not None and rows._version != version:
                self.writer.abort()
                raise ProbeIntegrityError(
                    f"the model changed the captured rows of {owner[0]!r} at layer {owner[1]} in place before its "
                    "forward ended, so they were not copied: the trace was dropped; leave that point out of the "
                    "capture to record this model")
        pending = iter(log)
        for point, layer in logged:
            if point.startswith("stats:"):
                self.capture_norm(point[6:], layer, next(pending), next(pending), logging)
            else:
                self.capture(point, layer, next(pending), logging)
        return False

    def _digest_repeat(self, repeat: _Repeat, log: list[torch.Tensor], versions: list[int | None],
                       positions: np.ndarray) -> None:
        """Digest a repeated decode step's logged captures (norm statistics are kept only in the
        zoom window), all together where they are on one device."""
        changed = [i for i in repeat.digested if versions[i] is not None and log[i]._version != versions[i]]
        if changed:
            self.writer.abort()
            raise changed_in_place(*repeat.owners[changed[0]])
        keys, rows = [repeat.owners[i] for i in repeat.digested], [log[i] for i in repeat.digested]
        if not self._digests.take_repeat(keys, rows, int(positions[0])):
            for key, captured in zip(keys, rows):
                self._digests.take(*key, captured, positions)
            self._digests.end_forward()
        self.writer.commit()

    def _check_fired(self) -> None:
        """Every declared (point, layer) and selected norm's statistics fired exactly once (known
        for a layout an earlier trace of the same selection found complete)."""
        layout = (self._reads_only, tuple(self._fired))
        if layout in self._learned.complete:
            self._checked = (self._reads_only, self._fired)
            return
        where = format_ranges(self._positions)
        fired = Counter(self._fired)
        for point, layer in self._declared.declared():
            if self._reads_only and point not in READ_POINTS:
                continue
            keys = [(point, layer)] + ([("stats:" + point, layer)] if point in LAYER_NORMS + FINAL_NORMS else [])
            for key in keys:
                count = fired[key]
                what = "norm statistics of" if key[0].startswith("stats:") else "probe"
                if count == 0:
                    raise ProbeIntegrityError(
                        f"{what} {point!r} did not fire at layer {layer} in the forward over positions {where}: "
                        "check the probe spec matches the model's modules, or, for an engine's adapter, that it "
                        "captures every point it declares in every forward (its `points`)")
                if count > 1:
                    raise ProbeIntegrityError(f"{what} {point!r} fired {count} times at layer {layer} in one forward "
                                              f"over positions {where}: a module is called more than once")
        self._checked = (self._reads_only, self._fired)
        if len(self._learned.complete) >= LEARNED_LAYOUTS:
            self._learned.complete.clear()
        self._learned.complete.add(layout)

    # -- finishing ---------------------------------------------------------------------------

    def finish(self, generated_ids: Sequence[int], text: str, chunks: Sequence[ChunkRecord] = ()) -> str:
        """Close the trace with the generation's outcome; returns the trace path."""
        if self._positions is not None:
            self.writer.abort()
            raise ProbeIntegrityError("finish called inside a forward: call end_forward first")
        if self.selection.layers and not self._window_kept:
            self.writer.abort()
            raise InputError(f"positions {format_ranges(sorted(self.selection.positions))} hold no row of this run, "
                             f"whose positions are 0-{self._run_end - 1}: choose positions within them")
        records_kv = bool(self._declared.layers) and any(p in self._declared.points for p in READ_POINTS)
        kv_only = sorted(self._read_positions - self._computed_positions) if records_kv else []
        keeps_keys = bool(self.selection.layers) and any(self.selection.keeps_keys(p) for p in READ_POINTS)
        key_only = sorted(self._key_only) if keeps_keys else []
        self._write_steps()
        if self._digests is not None:
            self._digests.flush()
        return str(self.writer.close(generated_ids=list(generated_ids), text=text, chunks=list(chunks),
                                     kv_only_positions=kv_only, key_only_positions=key_only))

    def abort(self) -> None:
        """Drop the trace (no file is left at its path)."""
        self.writer.abort()

