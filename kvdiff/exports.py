"""Lazy package exports: a package names what it exports and the module of each, and a module
loads on first use, so that importing the package (or a light submodule of it) stays cheap."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: an export is imported from its module on first use and kept
    in the package; any other name is an AttributeError."""
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
