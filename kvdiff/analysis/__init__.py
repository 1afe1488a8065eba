"""Diff analyzer: align two traces, tier every row, find the first divergence, and diagnose it."""

from kvdiff.analysis.api import diff
from kvdiff.analysis.diagnosis import Diagnosis
from kvdiff.analysis.divergence import Divergence
from kvdiff.analysis.search import Location
from kvdiff.analysis.tolerance import Tier, Tolerance, Tolerances, parse_tolerance

__all__ = ["diff", "Diagnosis", "Divergence", "Location", "Tier", "Tolerance", "Tolerances", "parse_tolerance"]
