"""The planted-bug catalogue (issue #27): one test per case of tests/catalogue.py.

Each case plants a bug in an engine under test (kvdiff's chunked engine, transformers continuous
batching, vLLM's CPU build), records the candidate trace, diffs it against the reference path and
checks report.json against the expectation written in the case table before the case first ran:
the first operation (operation, layer, position), the diagnoses that must be there and those the
bug contradicts. catalogue.KNOWN_WRONG keeps what kvdiff claims or used to claim wrongly, with the data;
the cases it still gets wrong (catalogue.STILL_WRONG) are strict xfails, any other wrong case fails.
"""

from __future__ import annotations

import pytest

from catalogue import CASES, KNOWN_WRONG, STILL_WRONG, VLLM, Catalogue, evaluate, vllm_available


def _marks(case) -> list:
    marks = []
    if case.id in STILL_WRONG:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[case.id]))
    if case.engine == VLLM:
        marks.append(pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"))
    return marks


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    cat = Catalogue(tmp_path_factory.mktemp("catalogue"))
    yield cat
    cat.close()


def test_the_catalogue_covers_what_issue_27_asks():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert len({c.arch for c in CASES}) >= 3 and len({c.engine for c in CASES}) >= 2
    assert set(KNOWN_WRONG) <= {c.id for c in CASES} and STILL_WRONG <= set(KNOWN_WRONG)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_planted_bug(catalogue, case):
    report, names = catalogue.run(case)
    verdict = evaluate(case, report, names)
    assert verdict.ok, verdict.explain()
