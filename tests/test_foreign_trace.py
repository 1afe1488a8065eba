"""A trace written by another engine with plain h5py, following docs/trace-format.md, is diffed.

The "engine" here is transformers' own forward (hidden states and its KV cache); nothing of
kvdiff's writer is used, so the test fails if the reader starts to need something the page
("Writing a trace from another engine") does not list.
"""

import json

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvdiff
from kvdiff.cli import app
from kvdiff.conversation import render_prompt_ids

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
STEPS = 6


@pytest.fixture(scope="module")
def tiny_llama():
    """A model of this module's own: transformers' `output_hidden_states` leaves hooks on it."""
    return kvdiff.load_model("tiny-llama")


def write_foreign_trace(path, model, tokenizer, *, points=("resid_pre", "k", "v", "logits"), kv_layout="phd"):
    """The required attributes and datasets only; K/V rows as (positions, kv heads, head_dim)."""
    prompt = render_prompt_ids(tokenizer, MESSAGES)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    fed = out[:, :-1]                                      # the last generated token is never fed back
    with torch.no_grad():
        forward = model(fed, output_hidden_states=True, use_cache=True)
    cfg, positions = model.config, fed.shape[1]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with h5py.File(path, "w") as f:
        f.attrs.update({
            "format": "kvdiff-trace", "schema_version": 1, "kvdiff_version": "-", "torch_version": "-",
            "transformers_version": "-", "model_name": "my-engine", "model_fingerprint": "my-weights",
            "tokenizer_fingerprint": "my-tokenizer", "dtype": "float32", "device": "cpu", "strategy": "my-engine",
            "numerics": "fast", "text": tokenizer.decode(generated, skip_special_tokens=True),
            "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads, "head_dim": head_dim, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "attn_scale": head_dim ** -0.5, "messages_json": json.dumps(MESSAGES),
            "chunks_json": "[]", "points": json.dumps(list(points)),
            "layers": np.arange(cfg.num_hidden_layers, dtype=np.int64),
        })
        f["input_ids"] = np.array(prompt, dtype=np.int64)
        f["generated_ids"] = np.array(generated, dtype=np.int64)
        f["positions"] = np.arange(positions, dtype=np.int64)
        for i in range(cfg.num_hidden_layers):
            cache = forward.past_key_values.layers[i]      # (batch, kv heads, positions, head_dim)
            rows = {"resid_pre": forward.hidden_states[i][0],
                    "k": cache.keys[0].transpose(0, 1) if kv_layout == "phd" else cache.keys[0],
                    "v": cache.values[0].transpose(0, 1) if kv_layout == "phd" else cache.values[0]}
            for point in set(points) & set(rows):
                f[f"layers/{i}/{point}"] = rows[point].numpy()
        f["final/logits"] = forward.logits[0].numpy()
        chosen = forward.logits[0, len(prompt) - 1:]
        top = torch.topk(chosen, 5)
        f["steps/step"] = np.arange(STEPS, dtype=np.int64)
        f["steps/position"] = np.arange(len(prompt) - 1, positions, dtype=np.int64)
        f["steps/token_id"] = np.array(generated, dtype=np.int64)
        f["steps/topk_ids"] = top.indices.numpy()
        f["steps/topk_values"] = top.values.numpy()
        f["steps/margin"] = (top.values[:, 0] - top.values[:, 1]).double().numpy()
        f.attrs["complete"] = True
    return generated


def test_a_trace_written_by_hand_from_another_engine_diffs_against_kvdiffs_reference(tmp_path, tiny_llama):
    model, tokenizer = tiny_llama
    reference, mine = tmp_path / "reference.h5", tmp_path / "mine.h5"
    generated = write_foreign_trace(mine, model, tokenizer)
    kvdiff.record(model, tokenizer, MESSAGES, reference, max_new_tokens=STEPS)

    div = kvdiff.diff(reference, mine)
    assert div.tokens_identical and div.candidate.strategy == "my-engine"
    assert list(div.candidate.generated_ids) == generated
    assert div.first_divergence is None                           # one forward against prefill + decode: noise at most
    assert sorted(div.comparison.points) == ["k", "resid_pre", "v"] and list(div.comparison.final) == ["logits"]
    assert {d.kind for d in div.diagnoses} <= {"numerical_noise"}

    result = CliRunner().invoke(app, ["diff", str(reference), str(mine), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["candidate"]["strategy"] == "my-engine"


def test_kv_rows_in_the_cache_layout_are_refused_naming_the_shape_to_give(tmp_path, tiny_llama):
    model, tokenizer = tiny_llama
    write_foreign_trace(tmp_path / "mine.h5", model, tokenizer, kv_layout="hpd")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "mine.h5")])
    assert result.exit_code == 2
    cfg = model.config
    positions = len(render_prompt_ids(tokenizer, MESSAGES)) + STEPS - 1
    expected = f"expected ({positions} or more, {cfg.num_key_value_heads}, {cfg.hidden_size // cfg.num_attention_heads})"
    assert "/layers/0/k has shape" in result.output and expected in result.output, result.output


@pytest.mark.parametrize("attribute", ["strategy", "attn_scale", "layers"])
def test_a_missing_root_attribute_is_named(tmp_path, tiny_llama, attribute):
    model, tokenizer = tiny_llama
    path = tmp_path / "mine.h5"
    write_foreign_trace(path, model, tokenizer)
    with h5py.File(path, "a") as f:
        del f.attrs[attribute]
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2 and attribute in result.output, result.output
