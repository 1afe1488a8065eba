"""An engine kvdiff does not ship, tested through an adapter of the user's (`--engine FILE.py:FACTORY`):
the example prompt-cache engine (examples/), bugs planted in it, and every way an adapter can be wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvdiff.cli import app
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine.loading import load_model
from kvdiff.errors import InputError, KvdiffError
from kvdiff.run.compare import compare

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ADAPTER = f"{EXAMPLES / 'prompt_cache_adapter.py'}:open_target"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TARGET = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
OTHER = [SYSTEM, {"role": "user", "content": "Name a colour."}]       # shares the system prompt and user header
SHARED = 15             # tiny-llama's tokens of TARGET and OTHER in common
OTHER_THE = [SYSTEM, {"role": "user", "content": "What the capital is?"}]     # parts from TARGET at " the"


@pytest.fixture
def engine_class():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from prompt_cache_engine import PromptCacheEngine
        yield PromptCacheEngine
    finally:
        sys.path.remove(str(EXAMPLES))


def _run(tmp_path, warm=True, **kw):
    return compare(TARGET, engine=ADAPTER, model="tiny-llama", max_new_tokens=6, warm=warm, out=tmp_path / "run", **kw)


def test_an_adapter_of_your_own_engine_runs_cold_and_warm_and_against_the_reference(tmp_path):
    result = _run(tmp_path)
    report = result.report.to_json()
    assert result.exit_code == 0 and report["tokens_identical"]
    assert report["engine"]["name"] == "prompt-cache" and report["engine"]["cache_hit_tokens"] == 29
    assert report["engine"]["cached_positions_recorded"] == 29
    assert report["engine"]["prompt_tokens"] == 30 and report["noise_floor"]["bitwise_equal"]
    against = report["engine_vs_reference"]
    assert against["tokens_identical"] and against["first_divergence"] is None
    assert report["diagnoses"] == [] and report["first_divergence"] is None


def test_rows_after_the_hit_encoded_one_position_on_are_a_position_mismatch(tmp_path, engine_class, monkeypatch):
    """A planted bug in the engine: the first forward after a cache hit counts positions from one past its start."""
    forward = engine_class.forward

    def planted(self, token_ids, start):
        return forward(self, token_ids, start + 1 if 0 < start and len(token_ids) > 1 else start)

    monkeypatch.setattr(engine_class, "forward", planted)
    report = _run(tmp_path, warm=OTHER).report.to_json()
    assert report["engine"]["cache_hit_tokens"] == SHARED
    first = report["first_operation"]
    assert (first["operation"], first["layer"], first["position"]) == ("RoPE (on q and k)", 0, SHARED)
    shift = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch"]
    assert [(d["positions"], d["offset"]) for d in shift] == [([SHARED, 29], 1)]
    assert not {d["kind"] for d in report["diagnoses"]} & {"missing_context", "cache_content_mismatch"}


def test_a_cached_row_of_another_token_is_a_cache_content_mismatch_at_that_row(tmp_path, engine_class, monkeypatch):
    """A planted bug in the engine: the first token that differs from the cached request's counts as shared,
    so its row of the earlier request (OTHER_THE's " the" at SHARED + 1) is read as this one's. TARGET has
    " the" one position on: the row is that token's K/V computed at SHARED + 1, not a copy of TARGET's row."""
    def planted(self, prompt_ids):
        common = 0
        for cached, new in zip(self.cached_ids, prompt_ids[:-1]):
            common += 1
            if cached != new:
                break
        if self.cache is None or common == 0:
            self.cache, common = DynamicCache(), 0
        elif common < self.cache.get_seq_length():
            self.cache.crop(common - self.cache.get_seq_length())
        self.cached_ids = self.cached_ids[:common]
        return common

    from transformers import DynamicCache

    monkeypatch.setattr(engine_class, "reuse", planted)
    report = _run(tmp_path, warm=OTHER_THE).report.to_json()
    stale_at = SHARED + 1
    assert report["engine"]["cache_hit_tokens"] == stale_at + 1
    first = report["first_operation"]
    assert (first["operation"].split(" (")[0], first["layer"], first["position"]) == ("K read from the cache", 0, stale_at)
    stale = [d for d in report["diagnoses"] if d["kind"] == "cache_content_mismatch"]
    assert [d["positions"] for d in stale] == [[stale_at, stale_at]]
    model, tokenizer = load_model("tiny-llama")
    other, target = render_prompt_ids(tokenizer, OTHER_THE), render_prompt_ids(tokenizer, TARGET)
    assert other[:stale_at] == target[:stale_at] and other[stale_at] == target[stale_at + 1] != target[stale_at]
    assert stale[0]["other_tokens"] == [other[stale_at]] and stale[0]["computed_at"] == [stale_at]
    assert stale[0]["source_positions"] == [None]       # v alone equals TARGET's row of " the": k does not
    assert not {d["kind"] for d in report["diagnoses"]} & {"missing_context", "position_mismatch"}


def _adapter_file(tmp_path, body: str) -> str:
    path = tmp_path / "my_adapter.py"
    path.write_text("from pathlib import Path\nfrom kvdiff.targets.protocol import TargetInfo, TargetRun\n" + body)
    return f"{path}:open_target"


GOOD_TARGET = """
class T:
    info = TargetInfo("mine", "1", Path("."))
    points = ("resid_pre",)
    def generate(self, prompt_ids, max_new_tokens, sink=None):
        return RUN
    def reset_cache(self): pass
    def close(self): pass
"""


@pytest.mark.parametrize("engine, error, message", [
    ("my_adapter", InputError, "unknown engine 'my_adapter'"),
    ("nowhere.py:open_target", InputError, "file nowhere.py does not exist"),
    ("no_such_module_kvdiff:open_target", InputError, "no module 'no_such_module_kvdiff'"),
    ("{file}:other", InputError, "has no function or class 'other'"),
    ("{file}:", InputError, "give FILE.py:FACTORY or MODULE:FACTORY"),
])
def test_an_adapter_that_cannot_be_found_is_one_clear_error(tmp_path, engine, error, message):
    engine = engine.format(file=_adapter_file(tmp_path, "def open_target(start):\n    return None\n").rpartition(":")[0])
    with pytest.raises(error, match=message):
        compare(TARGET, engine=engine, model="tiny-llama", out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("body, error, message", [
    ("raise RuntimeError('boom')\n", InputError, r"loading .*my_adapter.py failed: RuntimeError: boom"),
    ("def open_target(start):\n    raise ValueError('no GPU')\n", KvdiffError, "its factory failed: ValueError: no GPU"),
    ("def open_target(start):\n    return 3\n", InputError, "`info` must be a kvdiff.targets.protocol.TargetInfo"),
    (GOOD_TARGET.replace('("resid_pre",)', '"resid_pre"') + "def open_target(start):\n    return T()\n",
     InputError, "`points` must be a tuple of probe point names"),
    (GOOD_TARGET.replace('("resid_pre",)', '("resid",)') + "def open_target(start):\n    return T()\n",
     InputError, "unknown probe point"),
    (GOOD_TARGET + "RUN = None\ndef open_target(start):\n    return T()\n", KvdiffError,
     "generate returned a NoneType, not a kvdiff.targets.protocol.TargetRun"),
    (GOOD_TARGET + "RUN = TargetRun([1], '', 99)\ndef open_target(start):\n    return T()\n", KvdiffError,
     r"generate returned cache_hit_tokens 99, not a count of the request's \d+ prompt tokens"),
    (GOOD_TARGET + "RUN = TargetRun([1.5], '', 0)\ndef open_target(start):\n    return T()\n", KvdiffError,
     "generate returned token_ids that are not a list of ints"),
])
def test_an_adapter_that_is_wrong_is_one_clear_error(tmp_path, body, error, message):
    with pytest.raises(error, match=message):
        compare(TARGET, engine=_adapter_file(tmp_path, body), model="tiny-llama", out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_cli_takes_an_adapter_and_answers_a_broken_one_in_one_line(tmp_path):
    engine = _adapter_file(tmp_path, "def open_target(start):\n    raise ValueError('no GPU')\n")
    result = CliRunner().invoke(app, ["compare", "--engine", engine, "--model", "tiny-llama", "--prompt", "hi",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 3          # the engine failed, as when vLLM or llama.cpp does
    assert result.output.strip().splitlines() == [f"kvdiff: error: engine adapter {engine}: its factory failed: "
                                                  "ValueError: no GPU (-v shows where)"]


def test_a_factory_given_from_python_gets_the_model_and_the_options(tmp_path):
    seen = {}

    def factory(start):
        seen.update(options=start.options, model=start.model, tokenizer=start.tokenizer)
        raise ValueError("stop here")

    with pytest.raises(KvdiffError, match="its factory failed: ValueError: stop here"):
        compare(TARGET, engine=factory, model="tiny-llama", engine_options=["n_slots=2"], out=tmp_path / "run")
    assert seen["options"] == {"n_slots": 2} and isinstance(seen["model"], torch.nn.Module)


def test_a_gate_case_runs_an_adapted_engine(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text(f'[[case]]\nname = "prompt cache"\nsystem = "{SYSTEM["content"]}"\nprompt = "Hi there."\n'
                     f'model = "tiny-llama"\nmax_new_tokens = 4\nengine = "{ADAPTER}"\nagainst_reference = true\n')
    result = CliRunner().invoke(app, ["-q", "gate", str(cases), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "o").exists()


def test_a_whole_prompt_hit_answered_from_stale_logits_is_a_logits_mismatch(tmp_path, engine_class, monkeypatch):
    """A planted bug (red-team e1): when the cache holds the whole prompt, the engine skips the forward
    and samples its first token from the logits its last forward left. kvdiff crashed ("-1 is not a
    valid Tier"); every row it compares is equal, so only the first token's logits can tell."""
    forward, reuse, last = engine_class.forward, engine_class.reuse, {}

    def kept_forward(self, token_ids, start):
        logits = last["logits"] = forward(self, token_ids, start)
        return logits

    def whole_prompt_reuse(self, prompt_ids):        # the last prompt token may match too
        return reuse(self, list(prompt_ids) + [-1])

    def generate(self, prompt_ids, max_new_tokens):
        hit = self.reuse(list(prompt_ids))
        logits = last["logits"] if hit == len(prompt_ids) else self.forward(list(prompt_ids)[hit:], hit)
        tokens = []
        for step in range(max_new_tokens):
            position = len(prompt_ids) + step - 1
            tokens.append(int(logits[-1].argmax()))
            self.on_token(step, position, logits[-1], tokens[-1])
            if step < max_new_tokens - 1:
                logits = self.forward([tokens[-1]], position + 1)
        return Generation(tokens, hit)

    from prompt_cache_engine import Generation

    monkeypatch.setattr(engine_class, "forward", kept_forward)
    monkeypatch.setattr(engine_class, "reuse", whole_prompt_reuse)
    monkeypatch.setattr(engine_class, "generate", generate)
    report = _run(tmp_path, warm=True).report.to_json()
    prompt = report["engine"]["prompt_tokens"]
    assert report["engine"]["cache_hit_tokens"] == prompt and not report["tokens_identical"]
    (found,) = [d for d in report["diagnoses"] if d["kind"] == "logits_mismatch"]
    assert found["positions"] == [prompt - 1, prompt - 1] and found["step"] == 0 and found["computed_row"] is False
    assert report["diagnoses"][report["top_diagnosis"]]["kind"] == "logits_mismatch"


def test_a_hit_count_the_recording_does_not_show_is_said(tmp_path, monkeypatch):
    # An adapter that reports 8 cached tokens more than its reads bracket recorded (red-team round 5, t40).
    from kvdiff.reports.lines import hit_disagreement
    from kvdiff.run import engine_compare

    opened = engine_compare.open_target

    def open_overcounting(*args, **kwargs):
        target = opened(*args, **kwargs)
        generate = target.generate

        def overcounted(*a, **k):
            run = generate(*a, **k)
            run.cache_hit_tokens += 8 if run.cache_hit_tokens else 0
            return run

        target.generate = overcounted
        return target

    monkeypatch.setattr(engine_compare, "open_target", open_overcounting)
    engine = _run(tmp_path).report.to_json()["engine"]
    assert (engine["cache_hit_tokens"], engine["cached_positions_recorded"]) == (37, 29)
    assert "records 29 positions read from it" in hit_disagreement(engine)
