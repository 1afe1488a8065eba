"""`kvdiff compare --engine llama.cpp` through the registry's own open_target, with real llama-cpp-python
runs: the float32 copy of the GGUF made and run by default, and a setting of the GGUF overridden in
the engine. Apart from tests/test_target_llamacpp.py, whose engine stays open for its module: each
test here starts its own (~540 MB of float32 weights mapped)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from kvdiff.engine.loading import default_gguf_path  # noqa: E402
from kvdiff.errors import InputError  # noqa: E402
from kvdiff.run.compare import compare  # noqa: E402
from kvdiff.run.model_cache import ModelKey  # noqa: E402
from conftest import SEED_MESSAGES, SHARING_SYSTEM  # noqa: E402

pytestmark = pytest.mark.real_model

NEW = 6


@pytest.fixture(scope="module")
def gguf():
    return default_gguf_path()


@pytest.fixture(scope="module")
def models(gguf, default_model):
    return {ModelKey(str(gguf)): default_model}     # the reference: the same GGUF, dequantized (the session's copy)


def test_the_engine_runs_a_float32_copy_and_matches_the_reference(gguf, models, tmp_path):
    """No bug: llama.cpp on the float32 copy (made by the registry) is within tolerance of kvdiff's
    reference at every point, the tokens the same, no diagnosis either way."""
    result = compare(SEED_MESSAGES, engine="llama.cpp", model=str(gguf), warm=SHARING_SYSTEM, max_new_tokens=NEW,
                     out=tmp_path / "run", model_cache=models)
    report = result.report.to_json()
    engine, against = report["engine"], report["engine_vs_reference"]
    assert engine["weights"] == "float32" and engine["quantized"] is None and engine["cache_hit_tokens"] > 0
    assert engine["checkpoint"].endswith(".F32.gguf")
    assert against["tokens_identical"] and against["first_divergence"] is None, against
    assert [d["kind"] for d in against["diagnoses"]] == [] and report["diagnoses"] == []
    assert result.exit_code == 0


def test_a_setting_of_the_gguf_overridden_in_the_engine_is_named(gguf, models, tmp_path):
    """The engine started with its RMSNorm epsilon overridden (llama.cpp's own `kv_overrides`: 1e-2 for
    the GGUF's 1e-5), given as an engine option. Expected (written after an exploratory run of the
    same override): the attention norm at layer 0, position 0 the first operation against the
    reference, proved from its own input, and norm_consistency saying the norm itself is wrong there;
    (written before the fit ran on it) its rows fitting RMSNorm with eps 1e-2."""
    options = {"kv_overrides": {"llama.attention.layer_norm_rms_epsilon": 1e-2}}
    result = compare(SEED_MESSAGES, engine="llama.cpp", model=str(gguf), warm=SHARING_SYSTEM, max_new_tokens=NEW,
                     out=tmp_path / "run", model_cache=models, engine_options=options)
    report = result.report.to_json()
    assert report["engine"]["options"] == options
    against = report["engine_vs_reference"]
    op = against["first_operation"]
    assert (op["operation"], op["layer"], op["position"], op["proved"]) == ("attention norm", 0, 0, True), op
    norm = [d for d in against["diagnoses"] if d["kind"] == "norm_consistency"]
    assert norm and "the norm itself (weight, eps or kernel) is wrong" in norm[0]["evidence"], against["diagnoses"]
    assert norm[0]["candidate_form"]["form"] == "eps", norm[0]
    assert norm[0]["candidate_form"]["value"] == pytest.approx(1e-2, rel=1e-2), norm[0]


def test_flash_attention_is_told_apart_by_the_size_of_its_difference(gguf, models, tmp_path):
    """llama.cpp started with flash attention (`flash_attn=True`, which computes attention on float16
    copies of K and V): against the reference its attn_out moves by about float16's rounding while q,
    k and v match. Expected (written after an exploratory run): the same tokens, attention at layer 0
    the first operation, an attention_mismatch with no explanation whose evidence says the difference
    is the size of float16 rounding; without flash attention nothing (the first test)."""
    result = compare(SEED_MESSAGES, engine="llama.cpp", model=str(gguf), warm=SHARING_SYSTEM, max_new_tokens=NEW,
                     out=tmp_path / "run", model_cache=models, engine_options=["flash_attn=true"])
    against = result.report.to_json()["engine_vs_reference"]
    assert against["tokens_identical"]
    assert (against["first_operation"]["operation"], against["first_operation"]["layer"]) == \
        ("attention (softmax(q k^T) v)", 0)
    first = against["diagnoses"][0]
    assert (first["kind"], first["explanation"], first["rounding_size"]) == ("attention_mismatch", None, "float16")
    assert "as large as rounding to float16" in first["evidence"]


def test_a_context_too_small_for_the_request_is_one_clear_error(gguf, models, tmp_path):
    """`--engine-option n_ctx=16` for a longer prompt: refused before llama.cpp evaluates it, naming
    what the request needs and the option to raise (llama-cpp-python's own error was a numpy
    broadcast message); no run folder is left."""
    with pytest.raises(InputError, match=r"the request needs \d+ \+ 4 tokens of context and llama.cpp runs with 16: "
                                         r"give a larger --engine-option n_ctx"):
        compare(SEED_MESSAGES, engine="llama.cpp", model=str(gguf), warm=SHARING_SYSTEM, max_new_tokens=4,
                out=tmp_path / "run", model_cache=models, engine_options={"n_ctx": 16})
    assert not (tmp_path / "run").exists()


def test_an_option_llama_cpp_cannot_start_with_is_a_usage_error(gguf, models, tmp_path):
    """`--engine-option n_ctx=abc`: llama-cpp-python fails on the value's type ("'<' not supported ...",
    which kvdiff reported as an engine failure, exit 3); it is the user's option, named as such (exit 2)."""
    with pytest.raises(InputError, match=r"--engine-option: llama.cpp does not start with \{'n_ctx': 'abc'\}") as info:
        compare(SEED_MESSAGES, engine="llama.cpp", model=str(gguf), warm=SHARING_SYSTEM, max_new_tokens=4,
                out=tmp_path / "run", model_cache=models, engine_options={"n_ctx": "abc"})
    assert info.value.exit_code == 2 and not (tmp_path / "run").exists()
