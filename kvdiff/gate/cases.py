"""Gate case files: TOML `[[case]]` tables, validated into typed cases before anything runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvdiff.conversation import Messages, build_messages, validate_messages
from kvdiff.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_OPTION_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "strategy": str,
    "numerics": str,
    "max_new_tokens": int,
    "chunk_size": int,
    "recompute_ratio": (int, float),
    "dtype": str,
    "device": str,
    "capture": str,
    "layers": str,
    "trace_mode": str,
    "zoom_layers": int,
    "zoom_positions": int,
    "warm": bool,
    "engine": str,
    "engine_weights": str,
    "engine_options": dict,
}
_CONVERSATION_KEYS = {"name", "system", "prompt", "messages"}
# the gate's own keys: `against_reference` also fails an engine case whose tokens differ from kvdiff's reference
_GATE_TYPES: dict[str, type] = {"against_reference": bool}


@dataclass
class GateCase:
    """One gate case: a conversation and the compare options it runs with; `against_reference`: an
    engine under test must also generate kvdiff's reference tokens, not only its own cold ones."""

    name: str
    messages: Messages
    options: dict = field(default_factory=dict)
    against_reference: bool = False


def _case_from_table(index: int, table: dict) -> GateCase:
    where = f"case {index + 1}"
    if not isinstance(table, dict):
        raise InputError(f"{where} is not a table: write it as [[case]]")
    unknown = set(table) - _CONVERSATION_KEYS - set(_OPTION_TYPES) - set(_GATE_TYPES)
    if unknown:
        known = ", ".join(sorted(_CONVERSATION_KEYS | set(_OPTION_TYPES) | set(_GATE_TYPES)))
        raise InputError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}: known keys are {known}")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"{where} needs a non-empty string `name`")
    where = f"case {name!r}"
    for key, kind in {**_OPTION_TYPES, **_GATE_TYPES}.items():
        if key in table and (not isinstance(table[key], kind) or (isinstance(table[key], bool) and kind is not bool)):
            raise InputError(f"{where}: `{key}` has the wrong type ({type(table[key]).__name__})")
    try:
        if "messages" in table:
            if "prompt" in table or "system" in table:
                raise InputError("give either `messages` or `prompt`/`system`, not both")
            messages = validate_messages(table["messages"])
        else:
            for key in ("prompt", "system"):
                if key in table and not isinstance(table[key], str):
                    raise InputError(f"`{key}` must be a string")
            messages = build_messages(table.get("prompt"), table.get("system"))
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    options = {key: table[key] for key in _OPTION_TYPES if key in table}
    against = table.get("against_reference", False)
    if against and options.get("engine", "kvdiff") == "kvdiff":
        raise InputError(f"{where}: `against_reference` needs an engine under test (engine = \"transformers\", "
                         "\"vllm\", \"llama.cpp\" or an adapter's \"FILE.py:FACTORY\"); kvdiff's own engine is always compared with the reference")
    return GateCase(name=name, messages=messages, options=options, against_reference=against)


def load_cases(path: Path) -> list[GateCase]:
    """Read and validate a gate case file; every problem is an InputError naming the case."""
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")  # a byte-order mark (Windows editors) is fine
    except FileNotFoundError:
        raise InputError(f"case file {path} not found") from None
    except OSError as exc:
        raise InputError(f"cannot read case file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"case file {path} is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"case file {path} is not valid TOML: {exc}") from None
    extra = set(data) - {"case"}
    if extra:
        raise InputError(f"case file {path} has unknown top-level key(s) {', '.join(sorted(extra))}: only [[case]] tables")
    tables = data.get("case")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"case file {path} holds no [[case]] tables")
    cases = [_case_from_table(i, t) for i, t in enumerate(tables)]
    names = [c.name for c in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"case file {path}: duplicate case name(s) {', '.join(duplicates)}")
    return cases
