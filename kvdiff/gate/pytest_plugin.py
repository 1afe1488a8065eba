"""pytest plugin: a `kvdiff` fixture that asserts an engine's tokens match the reference.

Enabled automatically once kvdiff is installed (entry point `pytest11`). Reports of failing
checks are written under `--kvdiff-report-dir` (default: pytest's tmp path of the test).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvdiff.engine.conversation import Messages


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvdiff")
    group.addoption("--kvdiff-report-dir", default=None,
                    help="folder for kvdiff divergence reports of failing checks")


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
        """Run kvdiff's engine with `options` (strategy, numerics, model, ...) against the reference.

        Fails with the divergence summary and the report folder when the tokens differ.
        """
        from kvdiff.compare import compare

        result = compare(messages, out=self._next_dir(), model_cache=self.models, **options)
        if not result.divergence.tokens_identical:
            pytest.fail(f"kvdiff: {result.summary}\nreport: {result.out_dir}", pytrace=False)
        return result

    def assert_tokens_match(self, messages: Messages, token_ids: list[int], *, model, tokenizer,
                            max_new_tokens: int | None = None) -> None:
        """Assert a user's engine produced `token_ids` for `messages`, as the reference does.

        The reference is kvdiff's continuous greedy path on the same model; on a mismatch the
        failure names the first differing step and both tokens, and the reference trace is
        written into the report folder for `kvdiff diff` against the engine's own trace.
        """
        import kvdiff
        from kvdiff.engine.reference import reference_generate

        steps = max_new_tokens or max(1, len(token_ids))
        reference = reference_generate(model, tokenizer, messages, max_new_tokens=steps)
        if list(reference.token_ids) == list(token_ids):
            return
        step = next((i for i, (a, b) in enumerate(zip(reference.token_ids, token_ids)) if a != b),
                    min(len(reference.token_ids), len(token_ids)))
        folder = self._next_dir()
        folder.mkdir(parents=True, exist_ok=True)
        trace = kvdiff.record(model, tokenizer, messages, folder / "reference.h5", max_new_tokens=steps)

        def show(ids, i):
            return repr(tokenizer.decode([ids[i]])) if i < len(ids) else "<end>"

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
