"""The rich terminal report: verdict, outputs side by side, heatmap, firsts, diagnoses, chunks.

Everything goes through the given Console. With NO_COLOR (console.no_color) the report uses no
text attributes either (bold, reverse), so it emits no ANSI codes at all; markers such as
`»token«` and the heatmap glyphs carry the meaning without colour.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvdiff.errors import InputError
from kvdiff.reports.blend import blend_errors_text
from kvdiff.reports.heatmap_text import heatmap_text
from kvdiff.reports.lines import digest_line, engine_line, fmt, hit_disagreement, quantized_note, recomputed_line
from kvdiff.analysis.report import Report
from kvdiff.reports.printable import printable


def _chunk_label(item: dict) -> str | None:
    """"chunk NAME" for an event or diagnosis that names its chunk; None for traces without chunks."""
    chunk = item.get("chunk")
    return None if chunk is None else f"chunk {printable(str(chunk), keep='')}"


def _ids_only(section: dict, tokens: list[str]) -> bool:
    """Whether `tokens` are the section's token ids as strings (a diff without a tokenizer)."""
    ids = section.get("token_ids")
    return bool(tokens) and isinstance(ids, list) and [str(i) for i in ids] == tokens


class _Report:
    """Renders one view; `plain` drops text attributes (NO_COLOR)."""

    def __init__(self, view: Report, console: Console) -> None:
        self.view = view
        self.console = console
        self.plain = console.no_color

    def attr(self, style: str) -> str:
        return "" if self.plain else style

    def table(self, *columns: str, title: str) -> Table:
        table = Table(title=Text(title), box=box.SIMPLE_HEAD, header_style=self.attr("bold"),
                      title_style=self.attr("bold"), title_justify="left")
        for column in columns:
            table.add_column(Text(printable(column)), overflow="fold")
        return table

    def verdict(self) -> Panel:
        view = self.view
        candidate = view.section("candidate")
        flip = view.first("first_token_divergence")
        ok = view.tokens_identical
        inputs = view.first_input_difference
        head = Text(view.verdict.upper(), style=self.attr("bold") + (" green" if ok else " red"))
        head.append(" — tokens identical" if ok else
                    f" — inputs differ from position {inputs}" if inputs is not None else
                    f" — tokens differ from step {flip.get('step')}" if flip else " — tokens differ")
        body = Text()
        operation = view.first("first_operation")
        if operation is not None:
            body.append("first breaks: " if operation.get("tier") == "divergent" else "bits first differ in: ",
                        style=self.attr("bold"))
            body.append(printable(f"{operation.get('operation')} at layer {operation.get('layer')}, position "
                                  f"{self.where(operation.get('position'))}"
                                  + (f" ({_chunk_label({'chunk': view.chunk_at(operation['position'])})})"
                                     if isinstance(operation.get("position"), int) and view.chunks else "")
                                  + (" — inputs match" if operation.get("proved") else " — not proved")) + "\n")
        top = view.top_diagnosis
        if top is not None:
            body.append("diagnosis: ", style=self.attr("bold"))
            body.append(printable(", ".join(filter(None, [str(top.get("kind")), _chunk_label(top),
                                                          f"positions {fmt(top.get('positions', '?'))}"]))) + "\n")
        body.append(printable(f"candidate: strategy {candidate.get('strategy', '?')}, "
                              f"numerics {candidate.get('numerics', '?')}", keep=""))     # a trace's text
        model = view.section("metadata").get("reference", {}).get("model_name")
        if model:
            body.append(f"   model: {printable(str(model), keep='')}")
        bit = view.first("first_bit_difference")
        if inputs is not None:
            body.append(f"\nthe traces are of different prompts: positions from {inputs} on are not compared")
        if view.recorded_with_different:
            body.append(f"\nrecorded with different {' and '.join(map(printable, view.recorded_with_different))}: "
                        "differences may come from them")
        body.append(f"\nbitwise identical through every probe{'' if inputs is None else f' before position {inputs}'}"
                    if bit is None else
                    f"\nfirst bit difference: layer {bit.get('layer')}, position {bit.get('position')}")
        against = view.section("engine_vs_reference")
        if against.get("first_divergence") is not None:
            body.append("\nthe engine's cold run against kvdiff's reference: ", style=self.attr("bold"))
            body.append(printable(self.breaks(against) + quantized_note(view.section("engine"))))
        return Panel(Group(head, body), title="kvdiff", title_align="left",
                     border_style="green" if ok else "red")

    def tokens(self, tokens: list[str], step: int | None, fallback: str, ids: bool = False) -> Text:
        """The tokens, the first divergent one marked; `ids`: they are token ids, which a space
        separates (text tokens carry their own spaces)."""
        if not tokens:
            return Text(printable(str(fallback)))
        text = Text()
        for i, token in enumerate(tokens):
            if ids and i:
                text.append(" ")
            if i == step:
                text.append(f"»{printable(token)}«", style=self.attr("bold reverse") + " red")
            else:
                text.append(printable(token), style="grey50" if step is not None and i > step else "")
        return text

    def outputs(self) -> Table:
        view = self.view
        flip = view.first("first_token_divergence")
        step = flip.get("step") if flip else None
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        candidate = view.section("candidate")
        table = self.table("reference", f"candidate ({candidate.get('strategy', '?')})",
                           title="outputs" + (f" (»…« first divergent token, step {step})"
                                              if step is not None else ""))
        table.columns[0].ratio = table.columns[1].ratio = 1
        table.expand = True
        reference = view.section("reference")
        table.add_row(self.tokens(view.reference_tokens, step, reference.get("text", ""),
                                  _ids_only(reference, view.reference_tokens)),
                      self.tokens(view.candidate_tokens, step, candidate.get("text", ""),
                                  _ids_only(candidate, view.candidate_tokens)))
        return table

    def where(self, position: Any) -> str:
        if not isinstance(position, int):
            return "?"
        return f"{position} {printable(repr(self.view.token_at(position)))}"

    def firsts(self) -> Table:
        table = self.table("event", "details", title="firsts")
        for label, key in (("first bit difference", "first_bit_difference"),
                           ("first tolerance breach", "first_divergence"),
                           ("first large divergence", "first_large_divergence")):
            event = self.view.first(key)
            if event is None:
                if key != "first_large_divergence":      # only where a rounding-sized breach came first
                    table.add_row(label, "none")
                continue
            tier = f"{event['tier']}, " if "tier" in event else ""
            table.add_row(label, Text(
                f"{event.get('tensor')} at layer {event.get('layer')}, position "
                f"{', '.join(filter(None, [self.where(event.get('position')), _chunk_label(event)]))}\n"
                f"{tier}largest |difference| {fmt(event.get('max_abs'))}, rel_diff {fmt(event.get('rel'))} (squared scale)"))
        flip = self.view.first("first_token_divergence")
        if flip is None:
            table.add_row("first token flip", "none")
        else:
            table.add_row("first token flip", Text(printable(
                f"step {flip.get('step')}: {flip.get('reference_token')!r} -> "
                f"{flip.get('candidate_token')!r}\n"
                f"top-1 margins: reference {fmt(flip.get('reference_margin'))}, "
                f"candidate {fmt(flip.get('candidate_margin'))}")))
        return table

    def engine(self) -> Table:
        """An engine under test: its cache hit, its own noise floor, each flip classified."""
        view = self.view
        engine, floor = view.section("engine"), view.section("noise_floor")
        table = self.table("engine under test", "details", title="engine (cold vs warm)")
        table.add_row(Text(printable(engine_line(engine))), Text(printable(
            f"warm run served {engine.get('cache_hit_tokens')} of {engine.get('prompt_tokens')} prompt tokens "
            f"from its cache (the engine's counter)" + hit_disagreement(engine))))
        table.add_row("noise floor", Text(
            "two cold runs: " + ("bitwise equal" if floor.get("bitwise_equal") else
                                 f"differ (logits max_abs {fmt(floor.get('max_abs_logit'))})") +
            ("" if floor.get("tokens_identical", True) else ", tokens differ")))
        flips = view.raw.get("flips") if isinstance(view.raw.get("flips"), list) else []
        for flip in (f for f in flips if isinstance(f, dict)):
            table.add_row(Text(f"flip: {printable(str(flip.get('kind')))}", style=self.attr("bold") + " yellow"),
                          Text(printable(
                              f"step {flip.get('step')}: {flip.get('reference_token')!r} -> "
                              f"{flip.get('candidate_token')!r}; cold margin {fmt(flip.get('reference_margin'))}, "
                              f"logits max_abs there {fmt(flip.get('logit_max_abs'))}")))
        against = view.section("engine_vs_reference")
        if against:
            flip = against.get("flip") if isinstance(against.get("flip"), dict) else {}
            table.add_row("vs kvdiff reference", Text(printable(
                ("tokens identical" if against.get("tokens_identical") else f"tokens differ; {fmt(flip.get('kind'))}")
                + "; " + self.breaks(against) + quantized_note(engine))))
        return table

    def breaks(self, section: dict) -> str:
        """Where a section's runs first part beyond tolerance, and the operation that breaks."""
        operation = section.get("first_operation") if isinstance(section.get("first_operation"), dict) else None
        first = section.get("first_divergence") if isinstance(section.get("first_divergence"), dict) else None
        if operation is not None and operation.get("tier") == "divergent":
            return (f"first breaks: {operation.get('operation')} at layer {operation.get('layer')}, position "
                    f"{self.where(operation.get('position'))}" + (" (inputs match)" if operation.get("proved")
                                                                   else " (not proved)"))
        if first is not None:
            return (f"first beyond tolerance: {first.get('tensor')} at layer {first.get('layer')}, position "
                    f"{self.where(first.get('position'))}")
        return "within tolerance everywhere"

    def diagnoses(self, diagnoses: list | None = None, title: str = "diagnoses") -> Table:
        table = self.table("diagnosis", "evidence", title=title)
        diagnoses = self.view.diagnoses if diagnoses is None else [d for d in diagnoses if isinstance(d, dict)]
        if not diagnoses:
            table.add_row("none", "")
        for diagnosis in diagnoses:
            extras = {k: v for k, v in diagnosis.items()
                      if k not in ("kind", "chunk", "positions", "evidence")}
            evidence = printable(str(diagnosis.get("evidence", "")))
            if extras:
                evidence += "\n" + ", ".join(f"{k}={fmt(v)}" for k, v in extras.items())
            kind = Text(printable(str(diagnosis.get("kind"))), style=self.attr("bold") + " yellow")
            kind.append("\n" + ", ".join(filter(None, [_chunk_label(diagnosis),
                                                      f"positions {fmt(diagnosis.get('positions', '?'))}"])))
            table.add_row(kind, Text(evidence))
        return table

    def chunk_table(self) -> Table:
        table = self.table("chunk", "positions", "hash", "cache", "encoded at", title="chunks")
        for chunk in self.view.chunks:
            span = (chunk.first, chunk.last)
            encoded = Text(fmt(chunk.encoded) if chunk.encoded else "?")
            if chunk.encoded and chunk.encoded != span:
                encoded.append(" ≠ positions", style="red")
            table.add_row(Text(printable(chunk.name, keep="")), fmt(span), Text(printable(chunk.hash[:8], keep="")),
                          Text(printable(chunk.cache, keep=""), style="green" if chunk.cache == "hit" else "yellow"),
                          encoded)
        return table

    def heatmap(self, point: str) -> Group:
        title = Text(f"heatmap: {point} (rel, layers x positions; chunk boundaries │)",
                     style=self.attr("bold"))
        return Group(title, heatmap_text(self.view, point, self.console.width))


def render_terminal(view: Report, console: Console, point: str | None = None) -> None:
    """Print the report of a run to `console`; `point` picks the heatmap's probe point.

    By default the heatmap shows the point of the first tolerance breach, else `k`.
    """
    chosen = point or view.default_point()
    if point is not None and point not in view.heatmaps:
        known = ", ".join(view.points()) or "none"
        raise InputError(f"no heatmap for probe point {point!r} in this report (have: {known})")
    parts = _Report(view, console)
    console.print(parts.verdict())
    console.print(parts.outputs())
    if chosen is not None:
        console.print(parts.heatmap(chosen))
    console.print(parts.firsts())
    if view.section("engine"):
        console.print(parts.engine())
    console.print(parts.diagnoses())
    against = view.section("engine_vs_reference").get("diagnoses")
    if isinstance(against, list) and against:
        console.print(parts.diagnoses(against, "diagnoses: the engine's cold run against kvdiff's reference"))
    if view.chunks:
        console.print(parts.chunk_table())
    recomputed = view.section("recomputed")
    if recomputed:
        console.print(Text(printable(recomputed_line(recomputed))))
    blend = blend_errors_text(view.raw.get("blend_errors"), view.chunk_at, parts.plain)
    if blend is not None:
        console.print(blend)
    digest = view.section("digest")
    if digest:
        console.print(Text(printable(digest_line(digest))))
