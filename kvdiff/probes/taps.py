"""Taps on modules' forwards: callables shown a module's inputs before it runs and its output after.

A tap is what a torch forward hook with kwargs is (`before(module, args, kwargs)`,
`after(module, args, kwargs, output)`; what it returns is ignored), without torch's hook
dispatch where it can be done without: a module with hooks leaves `_call_impl`'s fast path,
which costs ~2.5 us a call, and a decode step of the default model calls ~270 tapped modules.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch


class Taps:
    """Taps attached to modules until `remove()`.

    A module with no torch hooks gets its `forward` wrapped (an instance attribute, as
    accelerate's device hooks do). A module that has hooks gets torch hooks for its taps too,
    registered after its own, so that the taps see what those hooks return, as before."""

    def __init__(self) -> None:
        self._removers: list[Callable[[], None]] = []

    def add(self, module: torch.nn.Module, before: Sequence[Callable], after: Sequence[Callable]) -> None:
        """Run each of `before` ahead of `module`'s forward and each of `after` behind it, in order."""
        before, after = list(before), list(after)
        if module._forward_hooks or module._forward_pre_hooks:
            handles = [module.register_forward_pre_hook(tap, with_kwargs=True) for tap in before]
            handles += [module.register_forward_hook(tap, with_kwargs=True) for tap in after]
            self._removers += [handle.remove for handle in handles]
            return
        had, forward = "forward" in module.__dict__, module.forward

        @functools.wraps(forward)
        def tapped(*args, **kwargs):
            for tap in before:
                tap(module, args, kwargs)
            output = forward(*args, **kwargs)
            for tap in after:
                tap(module, args, kwargs, output)
            return output

        def remove() -> None:
            if module.__dict__.get("forward") is not tapped:    # wrapped again since: stay in its chain, inert
                before.clear(), after.clear()
            elif had:
                module.forward = forward
            else:
                del module.forward

        module.forward = tapped
        self._removers.append(remove)

    def remove(self) -> None:
        """Take every tap off, the last added first."""
        for remove in reversed(self._removers):
            remove()
        self._removers.clear()
