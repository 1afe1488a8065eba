"""Splitting a model across the GPUs of one host: the device maps kvdiff hands to accelerate, and
the per-GPU memory budget that decides where the split falls."""

from __future__ import annotations

import re

import torch

from kvdiff.errors import InputError, ModelLoadError

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
MEMORY_SIZE = re.compile(r"[0-9]+(\.[0-9]+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")


def check_device_map(device_map: str | None, gpu_memory: str | None = None) -> None:
    """A device map kvdiff passes to accelerate needs a known strategy and more than one GPU's worth
    of CUDA; a per-GPU budget needs a device map and a size accelerate reads (`20GiB`, `500MB`)."""
    if gpu_memory is not None and device_map is None:
        raise InputError(f"a per-GPU memory budget ({gpu_memory}) only applies to a model split with --device-map")
    if gpu_memory is not None and not MEMORY_SIZE.fullmatch(gpu_memory):
        raise InputError(f"per-GPU memory budget {gpu_memory!r} is not a size: write it like 20GiB or 500MB")
    if device_map is None:
        return
    if device_map not in DEVICE_MAPS:
        raise InputError(f"unknown device map {device_map!r}: use one of {', '.join(DEVICE_MAPS)}")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device map {device_map!r} splits a model across GPUs, but no CUDA GPU is visible: "
                             "drop --device-map")


def gpu_budget(gpu_memory: str | None) -> dict[int, str] | None:
    """accelerate's `max_memory`: the same budget on every visible GPU, or None for its default."""
    return {gpu: gpu_memory for gpu in range(torch.cuda.device_count())} if gpu_memory else None


def check_all_on_gpus(model, folder) -> None:
    """A split model kvdiff runs lives on GPUs only: accelerate offloads to the CPU or the disk what
    the budget cannot hold, which would run each step through host copies."""
    off_gpu = sorted({str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()
                      if str(where) in ("cpu", "disk")})
    if off_gpu:
        raise ModelLoadError(f"the model in {folder} does not fit the GPUs' budget: accelerate put part of it on "
                             f"{' and '.join(off_gpu)}; raise the per-GPU memory or use more GPUs")
