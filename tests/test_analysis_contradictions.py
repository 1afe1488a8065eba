"""No report of the planted-bug catalogue holds two contradicting diagnoses, or one its own proof refutes.

Every case of tests/catalogue.py (three engines, five architectures) is diffed as test_catalogue.py
does, and its diagnoses are checked pairwise (kvdiff.analysis.contradictions): a position_mismatch
beside a rope_mismatch or a cache_content_mismatch of the same rows, a missing_context beside an
attention_mismatch, two offsets or unattended spans for the same rows, numerical noise beside a
divergence; and each on its own: a missing_context or an explained attention_mismatch without the
recomputation that shows it or with one that leaves more than half of the difference, a
position_mismatch whose rotation fits no integer position, a claim without proof or confidence.
The synthetic cases are checked in tests/test_analysis_proofs.py.
"""

from __future__ import annotations

import pytest

from catalogue import CASES, VLLM, Catalogue, summary, vllm_available
from kvdiff.analysis.contradictions import contradictions


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    cat = Catalogue(tmp_path_factory.mktemp("contradictions"))
    yield cat
    cat.close()


def _marks(case) -> list:
    return [pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")] if case.engine == VLLM else []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_no_report_contradicts_itself(catalogue, case):
    report, _ = catalogue.run(case)
    found = contradictions(report["diagnoses"])
    assert not found, "; ".join(found) + " | " + "; ".join(summary(d) for d in report["diagnoses"])
