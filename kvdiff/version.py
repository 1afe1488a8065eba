"""The kvdiff version, recorded in every trace."""

__version__ = "0.1.0"
