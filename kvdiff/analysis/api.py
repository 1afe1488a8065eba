"""`kvdiff.diff`: align -> compare -> search -> diagnose (-> attribute), over two or three traces."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from typing import Callable, Mapping

import numpy as np

from kvdiff.analysis.align import align
from kvdiff.analysis.attribution import attribute
from kvdiff.analysis.chunks import ChunkLookup
from kvdiff.analysis.compare import Comparison, compare
from kvdiff.analysis.contradictions import consistent
from kvdiff.analysis.diagnose_cache import diagnose_cache_content
from kvdiff.analysis.diagnose_cache_layers import diagnose_cache_layers
from kvdiff.analysis.diagnose_context import diagnose_missing_context, diagnose_missing_context_in_cache
from kvdiff.analysis.diagnose_experts import diagnose_expert_flip
from kvdiff.analysis.diagnose_norms import diagnose_norms
from kvdiff.analysis.diagnose_operation import diagnose_operation
from kvdiff.analysis.diagnose_position import diagnose_position_mismatch
from kvdiff.analysis.diagnose_tokens import (diagnose_logits, diagnose_noise, diagnose_non_finite, diagnose_sampling,
                                              diagnose_step_logits, diagnose_tokenization)
from kvdiff.analysis.diagnosis import DiagnosisInputs
from kvdiff.analysis.divergence import Divergence, recorded_with_different
from kvdiff.analysis.operation import first_operation
from kvdiff.analysis.digests import check_window, digest_comparison, with_window
from kvdiff.analysis.read_check import checked_reads
from kvdiff.analysis.search import (all_maps, first_bit_difference, first_large_divergence, first_non_finite,
                                    first_tolerance_breach, location)
from kvdiff.analysis.tolerance import Tier, Tolerance, Tolerances
from kvdiff.errors import InputError
from kvdiff.trace import TraceReader, open_trace

log = logging.getLogger(__name__)

TracePath = str | os.PathLike


def _token_text(tokenizer) -> Callable[[int], str]:
    if tokenizer is None:
        return str
    return lambda i: tokenizer.decode([int(i)])


def _check_same_model(ref: TraceReader, cand: TraceReader) -> None:
    """Refuse traces of differently shaped models; warn when the weights or the tokenizers differ
    (`recorded_with_different`), since every difference may then come from them."""
    for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "num_experts",
                 "experts_per_token"):
        a, b = getattr(ref.meta.dims, name), getattr(cand.meta.dims, name)
        if a != b:
            raise InputError(f"{cand.path} and {ref.path} come from different models ({name} {b} vs {a}): "
                             f"diff traces of the same model")
    for what in recorded_with_different(ref.meta, cand.meta):
        name = "model_fingerprint" if what == "weights" else "tokenizer_fingerprint"
        # the fingerprints are a trace's text: quoted with repr, so that control characters are
        # escapes in any log a caller configured, not only in the CLI's
        log.warning("%s and %s were recorded with different %s (%s %r vs %r): differences may come from them",
                    cand.path, ref.path, what, name, getattr(cand.meta, name), getattr(ref.meta, name))


def _check_baseline(baseline: TraceReader, cand: TraceReader) -> None:
    """Attribution reads the baseline as the candidate's engine with reuse off: refuse another run."""
    if baseline.meta.strategy != "none" or baseline.meta.numerics != cand.meta.numerics:
        raise InputError(f"baseline {baseline.path} was recorded with strategy {baseline.meta.strategy}, numerics "
                         f"{baseline.meta.numerics}; attribution needs the candidate's engine with strategy none, "
                         f"numerics {cand.meta.numerics} (`kvdiff compare --strategy none --numerics "
                         f"{cand.meta.numerics}` writes one as candidate.h5)")


def _compare(ref: TraceReader, cand: TraceReader, tolerances: Mapping[str, Tolerance] | None,
             text: Callable[[int], str]) -> tuple[Comparison, Comparison]:
    """(the comparison of the traces' full rows, of every row): the same for full traces; for
    digest traces, the zoom window's rows, and every row's digest with the window written over."""
    _check_same_model(ref, cand)
    if ref.meta.trace_mode != cand.meta.trace_mode:
        raise InputError(f"{ref.path} is a {ref.meta.trace_mode} trace and {cand.path} a {cand.meta.trace_mode} "
                         "one: diff two traces of the same trace mode")
    steps = ref.steps, cand.steps
    alignment = align(ref.meta, cand.meta, ref.positions, cand.positions, *steps, text)
    tols = Tolerances.for_dtypes(ref.meta.dtype, cand.meta.dtype, overrides=tolerances)
    rows = compare(ref, cand, alignment, tols)
    if ref.meta.trace_mode == "full":
        return rows, rows
    check_window(ref)
    check_window(cand)
    whole = align(ref.meta, cand.meta, ref.digest_positions, cand.digest_positions, *steps, text, rows=False)
    return rows, with_window(digest_comparison(ref, cand, whole, tols), rows)


def _recomputed(cand: TraceReader, chunks: ChunkLookup) -> dict | None:
    """blend: the placed positions its selective recompute computed again, and of how many."""
    if cand.meta.strategy != "blend":
        return None
    positions, placed = chunks.recomputed(int(cand.meta.input_ids.size))
    return {"positions": positions, "placed": placed, "share": len(positions) / placed if placed else None,
            "counted_over": "every position of every chunk placed from the cache (system prompt included)"}


def _diff_open(ref: TraceReader, cand: TraceReader, baseline: TraceReader | None,
               tolerances: Mapping[str, Tolerance] | None, tokenizer) -> Divergence:
    if baseline is not None:
        _check_baseline(baseline, cand)
    text = _token_text(tokenizer)
    cmp, whole = _compare(ref, cand, tolerances, text)
    chunks = ChunkLookup.of(cand)
    first_bit = first_bit_difference(whole, chunks)
    first_div = first_tolerance_breach(whole, chunks)
    window_div = first_tolerance_breach(cmp, chunks)     # the rows the diagnoses read: the zoom window's
    # a bit difference of unknown size (outside a zoom window) may breach: numerical noise is not proved
    unsized = any((m.tier == Tier.DIFFERENT).any() for m in all_maps(whole))
    inputs = DiagnosisInputs(ref, cand, cmp, chunks, text)
    diagnoses = (diagnose_tokenization(inputs) + diagnose_sampling(inputs) + diagnose_logits(inputs, whole)
                 + diagnose_step_logits(inputs, whole)
                 + diagnose_non_finite(inputs, first_non_finite(cmp, chunks))
                 + diagnose_cache_content(inputs) + diagnose_cache_layers(inputs) + diagnose_position_mismatch(inputs)
                 + diagnose_missing_context(inputs) + diagnose_missing_context_in_cache(inputs)
                 + diagnose_expert_flip(inputs))
    rope_claimed = any(d.kind in ("position_mismatch", "rope_mismatch") for d in diagnoses)
    diagnoses = (diagnoses + diagnose_operation(inputs, window_div, rope_claimed) + diagnose_norms(inputs)
                 + ([] if unsized else diagnose_noise(inputs, first_bit, first_div)))
    diagnoses = consistent(checked_reads(inputs, diagnoses, whole))     # of two contradicting claims, the stronger
    diagnoses.sort(key=lambda d: d.positions[0] if d.positions else -1)
    td = whole.alignment.first_token_divergence
    token_loc = None
    if td is not None and "logits" in whole.final:
        col = np.flatnonzero(whole.alignment.positions == td.position)
        token_loc = location(whole, chunks, whole.final["logits"], 0, int(col[0])) if col.size else None
    div = Divergence(
        reference=ref.meta, candidate=cand.meta, comparison=whole, tokens_identical=whole.alignment.tokens_identical,
        first_bit_difference=first_bit, first_divergence=first_div, first_token_divergence=td,
        first_token_location=token_loc, diagnoses=diagnoses, chunks=list(cand.meta.chunks),
        token_strings={"prompt": [text(i) for i in ref.meta.input_ids],
                       "reference": [text(i) for i in ref.meta.generated_ids],
                       "candidate": [text(i) for i in cand.meta.generated_ids]},
        chunk_of={int(p): chunks.chunk_of(int(p)) for p in whole.alignment.positions},
        first_operation=first_operation(cmp, window_div or first_bit_difference(cmp, chunks)),
        recomputed=_recomputed(cand, chunks), first_large_divergence=first_large_divergence(whole, chunks, first_div))
    if baseline is not None:
        base = _compare(ref, baseline, tolerances, text)[1]
        base_chunks = ChunkLookup.of(baseline)
        threshold, cand_loc = ("tolerance breach", first_div) if first_div is not None else ("bit difference", first_bit)
        base_bit = first_bit_difference(base, base_chunks)
        base_loc = first_tolerance_breach(base, base_chunks) if first_div is not None else base_bit
        div.attribution = attribute(cand_loc, div.tokens_identical, base_loc, base_bit,
                                    base.alignment.tokens_identical, len(cmp.layers), threshold)
    log.info("diff: tokens %s, first divergence %s, %d diagnoses, %.1f MB compared",
             "identical" if div.tokens_identical else "differ", first_div, len(diagnoses), whole.bytes_compared / 1e6)
    return div


def diff(reference: TracePath, candidate: TracePath, *, baseline: TracePath | None = None,
         tolerances: Mapping[str, Tolerance] | None = None, tokenizer=None) -> Divergence:
    """Diff a candidate trace against a reference trace (and optionally an engine baseline trace
    with strategy none, for attribution). `tolerances` overrides the dtype defaults per point;
    `tokenizer` turns token ids into strings in the verdict and the report."""
    with ExitStack() as stack:
        ref = stack.enter_context(open_trace(reference))
        cand = stack.enter_context(open_trace(candidate))
        base = stack.enter_context(open_trace(baseline)) if baseline is not None else None
        return _diff_open(ref, cand, base, tolerances, tokenizer)
