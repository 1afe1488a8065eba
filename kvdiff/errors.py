"""kvdiff's exception types. Each carries the exit code the CLI turns it into."""


class KvdiffError(Exception):
    """Base class: a failure kvdiff can explain in one line. Exit code 3 (runtime failure)."""

    exit_code = 3


class InputError(KvdiffError):
    """Bad input or usage: a wrong argument, a missing file, an unreadable model. Exit code 2."""

    exit_code = 2


class ModelLoadError(InputError):
    """A model could not be found or read."""


class UnsupportedModelError(InputError):
    """The model's architecture has no kvdiff adapter."""


class TokenizationBoundaryError(InputError):
    """Chunk tokens do not concatenate to the tokenization of the whole prompt."""


class TraceError(InputError):
    """A trace file is missing, foreign, truncated, incomplete or of a newer schema."""


class TraceWriteError(TraceError):
    """Writing a trace failed (disk full, file too large, an I/O error). Exit code 3."""

    exit_code = 3
