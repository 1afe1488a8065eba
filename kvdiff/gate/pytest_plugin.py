"""pytest plugin: a `kvdiff` fixture that asserts an engine's tokens match the reference.

Enabled automatically once kvdiff is installed (entry point `pytest11`). Reports of failing
checks are written under `--kvdiff-report-dir` (default: pytest's tmp path of the test).
"""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Sequence

import pytest

from kvdiff.conversation import Messages
from kvdiff.errors import InputError


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvdiff")
    group.addoption("--kvdiff-report-dir", default=None,
                    help="folder for kvdiff divergence reports of failing checks")


def generated_ids(token_ids: object, prompt_ids: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """An engine's generated ids as ints, from a list, a tuple, or an array or tensor of one row.

    InputError for anything else, for ids outside `0..vocab_size-1` (a tokenizer cannot decode
    them: 10**12 raised a bare OverflowError), and for ids that begin with the whole prompt (the
    full output of transformers' `generate`): those could never match the generated tokens.
    """
    if hasattr(token_ids, "tolist"):             # numpy array or torch tensor
        token_ids = token_ids.tolist()
    if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list):
        if len(token_ids) != 1:
            raise InputError(f"token_ids holds {len(token_ids)} rows: pass the generated ids of this one conversation")
        token_ids = token_ids[0]
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise InputError(f"token_ids must be the generated token ids (a list of ints, or an array or tensor "
                         f"of one row), got {type(token_ids).__name__}")
    try:
        ids = [operator.index(i) for i in token_ids]
    except TypeError:
        bad = next(i for i in token_ids if not hasattr(i, "__index__"))
        raise InputError(f"token_ids must hold ints, got {bad!r}") from None
    if vocab_size is not None:
        outside = next(((step, i) for step, i in enumerate(ids) if not 0 <= i < vocab_size), None)
        if outside is not None:
            raise InputError(f"token_ids holds {outside[1]} at step {outside[0]}, outside the model's vocabulary "
                             f"0..{vocab_size - 1}: pass the token ids your engine generated")
    prompt = list(prompt_ids)
    if len(ids) > len(prompt) and ids[:len(prompt)] == prompt:
        raise InputError(f"token_ids begins with the prompt's {len(prompt)} tokens: pass only the generated "
                         f"ones (of transformers' generate, output[0, {len(prompt)}:])")
    return ids


class KvdiffChecker:
    """What the `kvdiff` fixture hands a test."""

    def __init__(self, report_root: Path, test_name: str) -> None:
        self._root = report_root
        self._test = re.sub(r"[^A-Za-z0-9._-]+", "_", test_name)
        self._count = 0
        self.models: dict = {}

    def _next_dir(self) -> Path:
        self._count += 1
        return self._root / f"{self._test}-{self._count}"

    def assert_identical(self, messages: Messages, **options):
        """Run kvdiff's engine with `options` (strategy, numerics, model, warm, ...) against the reference.

        Fails with the divergence summary and the report folder when the tokens differ. A check
        that passes leaves no folder (the result's report stays in memory).
        """
        from kvdiff.run.compare import compare
        from kvdiff.gate.runner import remove_tree

        result = compare(messages, out=self._next_dir(), model_cache=self.models, **options)
        if not result.divergence.tokens_identical:
            pytest.fail(f"kvdiff: {result.summary}\nreport: {result.out_dir}", pytrace=False)
        remove_tree(result.out_dir)
        return result

    def assert_tokens_match(self, messages: Messages, token_ids: Sequence[int], *, model, tokenizer,
                            max_new_tokens: int | None = None) -> None:
        """Assert a user's engine generated `token_ids` for `messages`, as the reference does.

        `token_ids`: the generated ids only (a list, or an array or tensor of one row). The
        reference is kvdiff's continuous greedy path on the same model; on a mismatch the
        failure names the first differing step and both tokens, and the reference trace is
        written into the report folder for `kvdiff diff` against the engine's own trace.
        """
        from kvdiff.conversation import render_prompt_ids, validate_messages
        from kvdiff.engine.reference import reference_generate
        from kvdiff.run.record import record

        messages = validate_messages(messages)
        vocab = max(int(getattr(model.config, "vocab_size", 0) or 0), len(tokenizer))
        token_ids = generated_ids(token_ids, render_prompt_ids(tokenizer, messages), vocab)
        steps = max_new_tokens or max(1, len(token_ids))
        reference = reference_generate(model, tokenizer, messages, max_new_tokens=steps)
        if list(reference.token_ids) == token_ids:
            return
        step = next((i for i, (a, b) in enumerate(zip(reference.token_ids, token_ids)) if a != b),
                    min(len(reference.token_ids), len(token_ids)))
        folder = self._next_dir()
        folder.mkdir(parents=True, exist_ok=True)
        trace = record(model, tokenizer, messages, folder / "reference.h5", max_new_tokens=steps)

        def show(ids, i):
            return f"{ids[i]} {tokenizer.decode([ids[i]])!r}" if i < len(ids) else "<end>"

        pytest.fail(
            f"kvdiff: tokens differ at step {step}: reference {show(reference.token_ids, step)} vs "
            f"engine {show(token_ids, step)}\nreference: {reference.text!r}\n"
            f"reference trace: {trace} (diff it against your engine's trace with `kvdiff diff`)",
            pytrace=False,
        )


@pytest.fixture
def kvdiff(request, tmp_path) -> KvdiffChecker:
    """Assert chunked / cached generation matches the reference; reports go to --kvdiff-report-dir."""
    root = request.config.getoption("--kvdiff-report-dir")
    return KvdiffChecker(Path(root) if root else tmp_path / "kvdiff-reports", request.node.name)
