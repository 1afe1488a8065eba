"""The choices a user makes that every stage shares, each listed once: chunk strategy and
numerics. Values from a user are parsed here once (`parse`); stages receive the enums."""

from __future__ import annotations

from enum import Enum

from kvdiff.errors import InputError

DEFAULT_RECOMPUTE_RATIO = 0.15     # blend: share of a reused chunk's tokens recomputed with full context


class _Choice(str, Enum):
    """A string enum whose str() is its value (as the CLI, traces and reports write it)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | _Choice") -> "_Choice":
        """The member named `value`; an InputError lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"unknown {cls._what()} {value!r}: use one of {cls.names()}") from None

    @classmethod
    def names(cls) -> str:
        return ", ".join(m.value for m in cls)

    @classmethod
    def _what(cls) -> str:
        return cls.__name__.lower()


class Strategy(_Choice):
    """What a cached chunk's K/V is computed from (docs in kvdiff.engine.strategies)."""

    NONE = "none"
    PREFIX = "prefix"
    ISOLATED_LOCAL = "isolated-local"
    ISOLATED_GLOBAL = "isolated-global"
    REROTATE = "rerotate"
    BLEND = "blend"


class Numerics(_Choice):
    """fast: cascade attention, partial states merged; exact: batch-invariant, bitwise reproducible."""

    EXACT = "exact"
    FAST = "fast"

    @classmethod
    def _what(cls) -> str:
        return "numerics"


def check_recompute_ratio(ratio: float) -> float:
    """`ratio` as a float in [0, 1]; anything else (NaN included) is an InputError."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise InputError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InputError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
    return value


class TraceMode(_Choice):
    """digest: a hash and statistics of every row, full rows only around the first divergence
    (a zoom run); full: every row of every selected point."""

    DIGEST = "digest"
    FULL = "full"

    @classmethod
    def _what(cls) -> str:
        return "trace mode"
