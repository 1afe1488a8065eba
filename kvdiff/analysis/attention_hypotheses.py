"""The family of attention hypotheses attention_fit scores, and how it is searched: hidden keys
(single keys and spans around the first tested row), each row's chunk alone, the next key, every
later key of the forward, a sliding window, the row's own key hidden, the causal mask offset, keys
never written to the cache (read as zeros, or not attended), K/V written one slot away, K and V
swapped, the KV heads tiled; the softmax scale, a logit soft-cap and a sliding window of any size
fitted by a grid and golden-section search; the finalists scored on every tested row."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvdiff.analysis.attention_fit import QUICK_ROWS, AttentionTest, Hypothesis, Score, causal, in_window

# Keys (and span ends) tried as hidden ones: every earlier key up to this many, else a chosen set.
ALL_KEYS_UP_TO = 96
# The largest soft-cap fitted: beyond it tanh is linear over any score a model makes (no cap).
SOFTCAP_HI = 200.0


def hidden_keys(lo: int, hi: int) -> Callable[[int, int], np.ndarray]:
    return lambda row, n: causal(row, n) & ~((np.arange(n) >= lo) & (np.arange(n) <= hi))


def span_text(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def hidden_span(lo: int, hi: int) -> Hypothesis:
    return Hypothesis("hidden", f"positions {span_text(lo, hi)} not attended", hidden_keys(lo, hi), hidden=(lo, hi))



def key_candidates(first: int, extra: list[int]) -> list[int]:
    """Keys before the first tested row that may be hidden: all of them for short prompts; else the
    ones next to it, the first, chunk boundaries (`extra`) and 24 spread over the rest."""
    if first <= ALL_KEYS_UP_TO:
        return list(range(first))
    spread = np.linspace(0, first - 1, 24).round().astype(int).tolist()
    picked = {0, first - 1, first - 2, first - 3, *spread, *(e for e in extra if 0 <= e < first)}
    return sorted(picked)


def hypotheses(first: int, boundaries: list[int], chunk_start: Callable[[int], int | None],
               same_forward: Callable[[int, int], bool], forward_end: Callable[[int], int],
               heads: tuple[int, int] = (1, 1), differing: np.ndarray | None = None,
               sinks: bool = False, window: int | None = None) -> list[Hypothesis]:
    """Every hypothesis but the fitted ones (scale, soft-cap): the reference's attention, hidden keys
    (one key, spans ending before the first tested row, spans from 0), each row's chunk alone, the next
    key visible, every later key of the row's forward visible (`forward_end(row)`: one past its
    forward's last row), sliding windows, the row's own key hidden, the causal mask offset by m, keys
    never written to the cache (`unwritten_keys`), K and V swapped, and (`heads`: query and KV heads)
    the KV heads tiled over the query heads, and, where the query heads that differ (`differing`) are
    one KV head's, those reading another KV head; where the rows have attention sinks (`sinks`), the
    sinks left out of the softmax; where the layer has a sliding window (`window`: every hypothesis
    but the windows of their own is tested within it), every earlier position attended without it."""
    if window is None:
        out = [Hypothesis("standard", "every earlier position attended, as the reference does", causal)]
    else:
        out = [Hypothesis("standard", f"every earlier position within the layer's sliding window of {window} attended, "
                          "as the model does", causal),
               Hypothesis("no window", f"every earlier position attended: the layer's sliding window of {window} not "
                          "applied", causal, own_window=True)]
    keys = key_candidates(first, boundaries)
    spans = {(j, j) for j in keys} | {(a, first - 1) for a in keys} | {(0, b) for b in keys}
    out += [hidden_span(lo, hi) for lo, hi in sorted(spans)]

    def alone(row: int, n: int) -> np.ndarray:
        start = chunk_start(row)
        return causal(row, n) & (np.arange(n) >= (start if start is not None else 0))

    out.append(Hypothesis("chunk alone", "each row attending only its own chunk", alone))

    def next_key(row: int, n: int) -> np.ndarray:
        vis = causal(row, n)
        if n > row + 1 and same_forward(row, row + 1):
            vis[row + 1] = True
        return vis

    out.append(Hypothesis("next key", "each row also attending the next position (computed in the same forward)",
                          next_key))
    out.append(Hypothesis("not causal", "each row also attending every later position of its forward (the mask is "
                          "not causal)", lambda row, n: np.ones(n, bool), reach=forward_end))
    out.append(Hypothesis("own key hidden", "each row attending every earlier position but not its own (the mask's "
                          "diagonal hidden: < where <= is meant)", lambda row, n: np.arange(n) < max(row, 1)))
    out += [window_hypothesis(w) for w in window_candidates(first)]
    for m in sorted({2, 3, 4, first, *(b for b in boundaries if 1 < b < first)} - {0, 1}):
        out.append(Hypothesis("lagged mask", f"each row attending only the keys up to {m} positions before its own (the "
                              f"causal mask offset by {m}, as one built from positions counted from another start)",
                              lambda row, n, m=m: np.arange(n) <= row - m, lag=m))
    out += unwritten_keys(first, boundaries)
    out += shifted_writes(first, forward_end)
    out.append(Hypothesis("kv swapped", "K and V in each other's place where attention read them (scores from v, "
                          "values from k)", causal, swapped=True))
    if sinks:
        out.append(Hypothesis("no sinks", "every earlier position attended without the heads' sink logits in the "
                              "softmax (the attention sinks left out)", causal, sinks=None))
    query, kv = heads
    if 1 < kv < query:
        out.append(Hypothesis("kv heads", f"query head h reading KV head h mod {kv} (the KV heads tiled) where the "
                              f"model gives each KV head {query // kv} consecutive query heads", causal,
                              kv_heads=tuple(h % kv for h in range(query))))
    return out + other_kv_head(query, kv, differing)


def other_kv_head(query: int, kv: int, differing: np.ndarray | None) -> list[Hypothesis]:
    """Where the query heads that differ are exactly KV head g's: those reading KV head g' instead,
    for each other g' (g's rows written or read in g''s place)."""
    per = query // max(kv, 1)
    if differing is None or kv < 2 or len({int(h) // per for h in differing}) != 1:
        return []
    g = int(differing[0]) // per
    if sorted(int(h) for h in differing) != list(range(g * per, (g + 1) * per)):
        return []
    return [Hypothesis("kv heads", f"query heads {g * per}-{(g + 1) * per - 1} reading KV head {other} where the model "
                       f"gives them KV head {g} (KV head {other}'s K/V written or read in {g}'s place)", causal,
                       kv_heads=tuple(other if h // per == g else h // per for h in range(query)))
            for other in range(kv) if other != g]


def unwritten_keys(first: int, boundaries: list[int]) -> list[Hypothesis]:
    """Keys whose cache rows were never written, from position f on (the first tested row, the one
    before it, or a chunk's start up to it: a decode chunk's, where its first rows stay within
    tolerance): read as zero rows (K and V), the row's own key too or not, or not attended at all
    (the rows attend the keys before f and their own). A decode step whose K/V never reach the cache
    gives one of these from the first decode position."""
    out = []
    for f in sorted({first - 1, first, *(b for b in boundaries if 0 < b < first)} - {0, -1}):
        out.append(Hypothesis("zeroed", f"the keys from position {f} on, each row's own included, read as zero rows "
                              f"(K and V): their cache rows never written", causal,
                              zeroed=lambda row, n, f=f: (np.arange(n) >= f) & (np.arange(n) <= row), since=f,
                              own_zeroed=True))
        out.append(Hypothesis("zeroed", f"the keys from position {f} on before each row's own read as zero rows (K and "
                              f"V): their cache rows never written, the row's own key attended as computed", causal,
                              zeroed=lambda row, n, f=f: (np.arange(n) >= f) & (np.arange(n) < row), since=f))
        out.append(Hypothesis("not cached", f"the keys from position {f} on before each row's own not attended: their "
                              f"K/V never reached the cache, the row's own key attended as computed",
                              lambda row, n, f=f: causal(row, n) & ~((np.arange(n) >= f) & (np.arange(n) < row)),
                              since=f))
    return out


def shifted_writes(first: int, forward_end: Callable[[int], int]) -> list[Hypothesis]:
    """Each row's K/V written one slot away from its own from row f on (row r at slot r + s, an
    off-by-one slot mapping or write index): attention reads at slot j the row j - s, once that
    row was computed (by the end of the reading row's forward), else a zero row (a slot never
    written). f is the first tested row; for s = -1 also the row before (its own output may have
    stayed within tolerance), tried first: its write lands on the cached slot before it, which the
    cache read back after the forward shows, so where both predict the same the data back the
    earlier. For s = +1 the row before f would only trade the zero row and its neighbour's places,
    which attention cannot see."""
    out = []
    for f, s in [(f, -1) for f in sorted({max(first - 1, 1), first})] + [(first, 1)]:
        def moved(row: int, f: int = f, s: int = s) -> np.ndarray:
            slots = np.arange(row + 1)
            src = np.where(slots >= min(f, f + s), slots - s, slots)
            written = (src >= f) & (src < forward_end(row)) | (src < f) & (slots < min(f, f + s))
            return np.where(written, src, -1)

        where = "before" if s < 0 else "after"
        out.append(Hypothesis("shifted writes", f"each row's K/V from position {f} on written one cache slot {where} "
                              f"its own (slot r {s:+d}): attention reads another row's K/V in each slot from "
                              f"{min(f, f + s)} on, and a slot never written as a zero row", causal,
                              since=f, moved=moved, shift=s))
    return out


BLOCK_SIZES = (16, 32, 64)     # cache blocks a block table maps, where another block may be read in one's place


def moved_blocks(first: int) -> list[Hypothesis]:
    """One cache block read in another's place (a block table entry naming another block of the
    sequence): for each block size B, key slots jB..jB+B-1 before the first tested row's block hold
    the rows iB..iB+B-1 of another block i (every block of the row's keys), at every tested row."""
    out = []
    for size in BLOCK_SIZES:
        blocks = (first + 1) // size          # whole blocks every tested row reads
        for dst in range(blocks):
            for src in range(blocks + 1):
                if src == dst:
                    continue

                def moved(row: int, size: int = size, dst: int = dst, src: int = src) -> np.ndarray:
                    order = np.arange(row + 1)
                    held = order[dst * size:(dst + 1) * size]
                    order[dst * size:(dst + 1) * size] = src * size + (held - dst * size)
                    return order

                slots, rows = (dst * size, dst * size + size - 1), (src * size, src * size + size - 1)
                out.append(Hypothesis("moved block", f"cache slots {slots[0]}-{slots[1]} holding the rows of positions "
                                      f"{rows[0]}-{rows[1]} (a block table naming another block of {size})", causal,
                                      moved=moved, block=(size, slots, rows)))
    return out


def sliding_window(w: int) -> Callable[[int, int], np.ndarray]:
    return lambda row, n: causal(row, n) & in_window(row, n, w)


def window_candidates(first: int) -> list[int]:
    """Sliding windows that hide a key from the first tested row: the one whose first such row it is
    (a cold run's first divergent row), its neighbours, and the powers of two below it."""
    powers = [1 << k for k in range(1, max(first, 2).bit_length()) if 1 << k < first]
    return sorted({w for w in (first - 1, first, first + 1, *powers) if 1 <= w <= first})


def fit_scale(test: AttentionTest, lo: float = 0.25, hi: float = 4.0) -> Score:
    """The softmax scale factor that explains the rows best (`_fitted`)."""
    return _fitted(test, lambda s: Hypothesis("scale", f"softmax scale x{s:.4g}", causal, scale=float(s)), lo, hi)


def fit_sinks(test: AttentionTest, lo: float = 1 / 64, hi: float = 64.0) -> Score:
    """The factor on the heads' sink logits that explains the rows best (`_fitted`), where they have sinks."""
    return _fitted(test, lambda f: Hypothesis("sinks scaled", f"the heads' sink logits scaled by {f:.4g}", causal,
                                               sinks=float(f)), lo, hi)


def fit_softcap(test: AttentionTest, lo: float = 0.5, hi: float = SOFTCAP_HI) -> Score:
    """The logit soft-cap c (scaled scores s -> c * tanh(s / c), as Gemma 2 and engines' `softcap`
    compute them) that explains the rows best (`_fitted`)."""
    return _fitted(test, lambda c: Hypothesis("softcap", f"attention scores soft-capped at {c:.4g} (c * tanh(s / c))",
                                               causal, softcap=float(c)), lo, hi)


def window_hypothesis(w: int) -> Hypothesis:
    return Hypothesis("window", f"each row attending only its own and the {w - 1} positions before it (a sliding "
                      f"window of {w})", sliding_window(w), window=w, own_window=True)


def fit_window(test: AttentionTest) -> Score:
    """The sliding window that explains the rows best, of any size up to the last tested row: a
    geometric grid on a few rows brackets it, a golden-section search over the integers between the
    best's neighbours refines it (a window far off either way hides or shows keys it should not)."""
    last = int(test.rows.max())
    quick = test.on(test.rows, QUICK_ROWS)
    grid = np.unique(np.geomspace(1, max(last, 1), 24).round().astype(int))
    residual = {int(w): quick.score(window_hypothesis(int(w))).residual for w in grid}
    i = int(np.argmin([residual[int(w)] for w in grid]))
    a, b = int(grid[max(i - 1, 0)]), int(grid[min(i + 1, grid.size - 1)])

    def at(w: int) -> float:
        if w not in residual:
            residual[w] = quick.score(window_hypothesis(w)).residual
        return residual[w]

    while b - a > 2:
        c, d = a + (b - a) // 3, b - (b - a) // 3
        if at(c) <= at(d):
            b = d
        else:
            a = c
    best = min(range(a, b + 1), key=at)
    return test.score(window_hypothesis(best))


def _fitted(test: AttentionTest, make: Callable[[float], Hypothesis], lo: float, hi: float) -> Score:
    """The value in [lo, hi] whose hypothesis `make(value)` explains the rows best: a grid on a few
    rows brackets it, golden-section search (in log space) on all of them refines it."""
    grid = np.geomspace(lo, hi, 25)
    quick = test.on(test.rows, QUICK_ROWS)
    i = int(np.argmin([quick.score(make(s)).residual for s in grid]))
    a, b = np.log(grid[max(i - 1, 0)]), np.log(grid[min(i + 1, grid.size - 1)])
    g = (np.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    sc, sd = test.score(make(np.exp(c))), test.score(make(np.exp(d)))
    for _ in range(14):
        if sc.residual < sd.residual:
            b, d, sd = d, c, sc
            c = b - g * (b - a)
            sc = test.score(make(np.exp(c)))
        else:
            a, c, sc = c, d, sd
            d = a + g * (b - a)
            sd = test.score(make(np.exp(d)))
    return min(sc, sd, key=lambda s: s.residual)


def finalists(test: AttentionTest, family: list[Hypothesis], keep: int = 6) -> list[Hypothesis]:
    """The hypotheses worth scoring on every tested row: the `keep` best on a few rows, and always the
    reference's attention and each chunk alone (the comparisons a verdict names)."""
    if test.rows.size <= QUICK_ROWS or len(family) <= keep:
        return family
    quick = test.on(test.rows, QUICK_ROWS)
    ranked = sorted(range(len(family)), key=lambda i: quick.score(family[i]).residual)[:keep]
    chosen = set(ranked) | {i for i, h in enumerate(family) if h.name in ("standard", "chunk alone")}
    return [family[i] for i in sorted(chosen)]
