import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

import kvdiff
from kvdiff.engine.loading import fill_cache_atomically
from kvdiff.engine.reference import reference_generate
from kvdiff.errors import InputError, ModelLoadError, UnsupportedModelError

from conftest import SEED_PROMPT

GEO_SYSTEM = "You are a helpful assistant."


def test_tiny_families_load_template_and_generate_deterministically(tiny_model):
    model, tokenizer = tiny_model
    messages = [{"role": "system", "content": GEO_SYSTEM}, {"role": "user", "content": SEED_PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    first = reference_generate(model, tokenizer, messages, max_new_tokens=8)
    second = reference_generate(model, tokenizer, messages, max_new_tokens=8)
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) >= 1


def test_tiny_models_are_rebuilt_bit_identically():
    a, _ = kvdiff.load_model("tiny-qwen3")
    b, _ = kvdiff.load_model("tiny-qwen3")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_tiny_families_have_their_architecture_features():
    qwen2, _ = kvdiff.load_model("tiny-qwen2")
    qwen3, _ = kvdiff.load_model("tiny-qwen3")
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")
    assert 2 <= qwen3.config.num_hidden_layers <= 4


@pytest.mark.real_model
def test_default_model_answers_paris(default_model):
    model, tokenizer = default_model
    assert model.config.num_hidden_layers == 30
    messages = [{"role": "system", "content": GEO_SYSTEM}, {"role": "user", "content": SEED_PROMPT}]
    out = reference_generate(model, tokenizer, messages, max_new_tokens=24)
    assert "Paris" in out.text


@pytest.mark.real_model
def test_second_load_of_default_model_is_fast(default_model):
    start = time.perf_counter()
    kvdiff.load_model("smollm2-135m")
    assert time.perf_counter() - start < 3.0


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        kvdiff.load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        kvdiff.load_model(str(tmp_path))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        kvdiff.load_model(str(tmp_path))


def test_unknown_dtype_and_device_are_input_errors():
    with pytest.raises(ModelLoadError, match="dtype"):
        kvdiff.load_model("tiny-llama", dtype="float8")
    with pytest.raises(ModelLoadError, match="device"):
        kvdiff.load_model("tiny-llama", device="tpu")


def test_a_device_map_or_gpu_budget_the_machine_cannot_honour_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="use one of auto, balanced"):
        kvdiff.load_model(str(tmp_path), device_map="everywhere")
    with pytest.raises(InputError, match="only applies to a model split with --device-map"):
        kvdiff.load_model(str(tmp_path), gpu_memory="20GiB")
    with pytest.raises(InputError, match="write it like 20GiB"):
        kvdiff.load_model(str(tmp_path), device_map="auto", gpu_memory="twenty gigs")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA GPU is visible"):
            kvdiff.load_model(str(tmp_path), device_map="auto", gpu_memory="1.5GiB")


def _slow_fill(target: str, marker: str) -> str:
    def build(out: Path) -> None:
        for i in range(20):
            (out / f"part{i}").write_text(marker * 1000)
            time.sleep(0.01)

    return str(fill_cache_atomically(Path(target), build))


def test_two_processes_filling_the_cache_never_leave_it_half_written(tmp_path):
    target = tmp_path / "models" / "key"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(_slow_fill, [(str(target), "a"), (str(target), "b")])
    assert results == [str(target), str(target)]
    parts = sorted(p.name for p in target.iterdir())
    assert len(parts) == 20
    contents = {p.read_text() for p in target.iterdir()}
    assert len(contents) == 1  # all files from one filler, never a mix
    assert [p.name for p in target.parent.iterdir()] == ["key"]  # no temporary folder left


def test_model_loading_is_offline(tiny_llama):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
