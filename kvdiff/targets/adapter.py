"""An engine under test through the user's own adapter: `--engine FILE.py:FACTORY` or
`--engine MODULE:FACTORY` (Python: `engine=` a factory), with no change to kvdiff.

The factory is called with an `EngineStart` and returns a `Target` (`protocol.py`). What it
returns is the user's code: it is checked once here (its `info` and `points`), and every call
kvdiff makes of it is checked as it returns (a `TargetRun` whose counts fit the request); an
exception of its own becomes one KvdiffError naming the adapter, its traceback in the log.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvdiff.errors import InputError, KvdiffError
from kvdiff.targets.protocol import Target, TargetInfo, TargetRun
from kvdiff.trace.points import parse_points
from kvdiff.trace.sink import ProbeSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStart:
    """What an adapter's factory gets: kvdiff's loaded model and tokenizer (the reference's),
    the checkpoint folder they were loaded from (None for a built-in tiny model) and the
    `--engine-option` settings, as given."""

    model: Any
    tokenizer: Any
    checkpoint: Path | None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterEngine:
    """An engine under test through an adapter: where it came from and its factory."""

    source: str
    factory: Callable[[EngineStart], Target]

    def __str__(self) -> str:
        return self.source

    @property
    def label(self) -> str:
        """A name for the run's folder: the factory's module and name, as a file name can hold them."""
        where, _, name = self.source.rpartition(":")
        stem = Path(where).stem if where.endswith(".py") else where.rpartition(".")[2]
        return "".join(c if c.isalnum() or c in "-_" else "-" for c in f"{stem}-{name}")


def load_adapter(source: str) -> AdapterEngine:
    """The factory named by `FILE.py:NAME` or `MODULE:NAME`; each way it can fail is an InputError."""
    where, _, name = source.rpartition(":")
    if not where or not name.isidentifier():
        raise InputError(f"engine adapter {source!r}: give FILE.py:FACTORY or MODULE:FACTORY")
    try:
        if where.endswith(".py"):
            module = _module_from_file(Path(where), source)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except ModuleNotFoundError as exc:
        raise InputError(f"engine adapter {source!r}: no module {exc.name!r} (give a .py file, or put the "
                         "module's folder on PYTHONPATH)") from None
    except Exception as exc:      # the user's module failing as it loads
        log.debug("importing engine adapter %s", source, exc_info=True)
        raise InputError(f"engine adapter {source!r}: loading {where} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InputError(f"engine adapter {source!r}: {where} has no function or class {name!r}")
    return AdapterEngine(source, factory)


def _module_from_file(path: Path, source: str):
    if not path.is_file():
        raise InputError(f"engine adapter {source!r}: file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"kvdiff_adapter_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def start_adapter(engine: AdapterEngine, start: EngineStart) -> Target:
    """The adapter's target for `start`, checked."""
    target = _calling(engine.source, "its factory", lambda: engine.factory(start))
    return CheckedTarget(target, engine.source)


def _calling(source: str, what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except KvdiffError:
        raise
    except Exception as exc:
        log.debug("engine adapter %s: %s failed", source, what, exc_info=True)
        raise KvdiffError(f"engine adapter {source}: {what} failed: {type(exc).__name__}: {exc} "
                          "(-v shows where)") from None


class CheckedTarget:
    """The adapter's target, with what it gives kvdiff checked; a Target itself."""

    def __init__(self, target: Any, source: str):
        self._target, self._source = target, source
        info = getattr(target, "info", None)
        if not isinstance(info, TargetInfo):
            raise InputError(f"engine adapter {source}: its target's `info` must be a "
                             f"kvdiff.targets.protocol.TargetInfo, not {type(info).__name__}")
        points = getattr(target, "points", None)
        if isinstance(points, str) or not isinstance(points, (tuple, list)) or not points:
            raise InputError(f"engine adapter {source}: its target's `points` must be a tuple of probe point names "
                             "(kvdiff.trace.points), at least one")
        missing = [m for m in ("generate", "reset_cache", "close") if not callable(getattr(target, m, None))]
        if missing:
            raise InputError(f"engine adapter {source}: its target has no {', '.join(missing)} method")
        self.info, self.points = info, parse_points(list(points))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        run = _calling(self._source, "generate",
                       lambda: self._target.generate(prompt_ids, max_new_tokens, sink))
        problem = _run_problem(run, len(prompt_ids), max_new_tokens)
        if problem:
            raise KvdiffError(f"engine adapter {self._source}: generate returned {problem}")
        return run

    def reset_cache(self) -> None:
        _calling(self._source, "reset_cache", self._target.reset_cache)

    def close(self) -> None:
        _calling(self._source, "close", self._target.close)


def _run_problem(run: Any, prompt: int, max_new_tokens: int) -> str | None:
    """What is wrong with what a target's generate returned, or None."""
    if not isinstance(run, TargetRun):
        return f"a {type(run).__name__}, not a kvdiff.targets.protocol.TargetRun"
    ids = run.token_ids
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "token_ids that are not a list of ints"
    if not 0 < len(ids) <= max_new_tokens:
        return f"{len(ids)} tokens for a request of at most {max_new_tokens} (and at least one)"
    if not isinstance(run.text, str):
        return f"text of type {type(run.text).__name__}, not str"
    hit = run.cache_hit_tokens
    if not isinstance(hit, int) or isinstance(hit, bool) or not 0 <= hit <= prompt:
        return f"cache_hit_tokens {hit!r}, not a count of the request's {prompt} prompt tokens"
    return None
