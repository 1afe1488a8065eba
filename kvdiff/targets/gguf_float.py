"""A float32 copy of a GGUF, so that llama.cpp runs the weights kvdiff's reference runs.

kvdiff's reference loads a GGUF dequantized into transformers (gguf's own dequantizer). llama.cpp
on the quantized file multiplies by the quantized weights, with its activations quantized too, so
every projection differs from the reference's by quantization, and a rule that needs the engine's
q, k and v to equal the reference's (attention's scale, mask, hidden keys) can prove nothing. The
copy holds the very values the reference holds, every metadata field of the source but the file
type; llama.cpp's float32 kernels then differ from the reference by summation order alone.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from kvdiff.engine.loading import cache_dir, file_sha256, fill_cache_atomically
from kvdiff.errors import ModelLoadError

log = logging.getLogger(__name__)


def float32_gguf(gguf: Path) -> Path:
    """The cached float32 copy of `gguf` (written on first use, keyed by the source's content)."""
    name = f"{gguf.stem}.F32.gguf"
    folder = cache_dir() / "gguf-f32" / file_sha256(gguf)[:24]
    return fill_cache_atomically(folder, lambda out: _write_float32(gguf, out / name)) / name


def _write_float32(source: Path, dest: Path) -> None:
    import gguf

    log.info("writing a float32 copy of %s for llama.cpp (one-off); cached for later runs", source.name)
    if not log.isEnabledFor(logging.DEBUG):                  # gguf's writer logs each file it writes
        logging.getLogger("gguf").setLevel(logging.WARNING)
    try:
        reader = gguf.GGUFReader(source)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{source} is not a readable GGUF file: {exc}") from exc
    _check_room(source, dest.parent, 4 * sum(int(t.n_elements) for t in reader.tensors))
    keys = gguf.Keys.General
    arch = reader.get_field(keys.ARCHITECTURE)
    if arch is None:
        raise ModelLoadError(f"{source} names no architecture ({keys.ARCHITECTURE})")
    writer = gguf.GGUFWriter(dest, arch.contents(), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == keys.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                                   # the writer writes these itself
        if field.name == keys.ALIGNMENT:
            writer.add_custom_alignment(field.contents())
        elif field.name == keys.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        else:
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    float32 = np.dtype(np.float32)
    for tensor in reader.tensors:           # ggml's dimensions are numpy's reversed
        writer.add_tensor_info(tensor.name, [int(n) for n in reversed(tensor.shape)], float32,
                               4 * int(tensor.n_elements))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:           # one tensor in memory at a time (an 8B model's are ~32 GB)
        try:
            weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(f"cannot make a float32 copy of {source.name}: its tensor {tensor.name} of type "
                                 f"{tensor.tensor_type.name} does not dequantize ({exc}); run --engine-weights native "
                                 "to test the GGUF as it is") from exc
        writer.write_tensor_data(np.ascontiguousarray(weights, dtype=float32))
    writer.close()


def _check_room(source: Path, folder: Path, needed: int) -> None:
    """Refuse before writing a float32 copy the cache's disk cannot hold (an 8B model's is ~32 GB)."""
    free = shutil.disk_usage(folder).free
    if free < needed * 1.02 + (64 << 20):
        raise ModelLoadError(
            f"the float32 copy of {source.name} that llama.cpp runs needs {needed / 1e9:.1f} GB in {folder.parent}, "
            f"which has {free / 1e9:.1f} GB free: free some space, set KVDIFF_CACHE to a larger disk, or run "
            "--engine-weights native (the GGUF's own weights, whose projections differ from the reference by "
            "quantization)")
    log.info("the float32 copy of %s takes %.1f GB", source.name, needed / 1e9)
