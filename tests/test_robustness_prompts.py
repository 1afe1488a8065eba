"""Robustness, prompts: empty, odd or malformed conversations, and prompts longer than the context."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import kvdiff
from kvdiff.run.compare import compare
from kvdiff.conversation import build_messages
from kvdiff.trace import TraceWriter, open_trace
from robustness import MESSAGES, assert_error, assert_no_finished_run, cli, compare_args

# (id, file bytes, what the error line says)
BAD_MESSAGE_FILES = [
    ("malformed-json", b'[{"role": "user", "content": "hi"}', "is not valid JSON: Expecting ',' delimiter at line 1"),
    ("trailing-garbage", b'[{"role": "user", "content": "hi"}] x', "is not valid JSON: Extra data at line 1"),
    ("not-utf8", '[{"role": "user", "content": "café"}]'.encode("latin-1"), "is not UTF-8 text"),
    ("unknown-role", b'[{"role": "tool", "content": "x"}, {"role": "user", "content": "hi"}]',
     "message 0 has unknown role 'tool': use one of system, user, assistant"),
    ("not-a-list", b'"hello"', "a conversation must be a non-empty list of {role, content} messages"),
    ("empty-list", b'{"messages": []}', "a conversation must be a non-empty list"),
    ("extra-key", b'[{"role": "user", "content": "hi", "name": "x"}]', "message 0 must be an object with keys"),
    ("content-not-text", b'[{"role": "user", "content": 3}]', "message 0 content must be a string"),
    ("last-not-user", b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]',
     "the last message must be from the user"),
    ("whitespace-only", b'[{"role": "system", "content": " "}, {"role": "user", "content": "\\n\\t "}]',
     "the conversation is empty: give a non-empty prompt"),
    ("lone-surrogate", b'[{"role": "user", "content": "hi \\ud800"}]',
     "message 0 content holds U+D800 at character 3, which is not valid Unicode text"),
    ("nested-too-deep", b"[" * 100_000 + b"]" * 100_000, "is nested too deeply to be a list of messages"),
]


@pytest.mark.parametrize("data, message", [row[1:] for row in BAD_MESSAGE_FILES], ids=[row[0] for row in BAD_MESSAGE_FILES])
def test_bad_messages_file(tmp_path, data, message):
    path = tmp_path / "messages.json"
    path.write_bytes(data)
    assert_error(cli(*compare_args(tmp_path / "run", "--messages", path)), 2, message)
    assert not (tmp_path / "run").exists()


def test_messages_file_missing_or_a_folder(tmp_path):
    assert_error(cli(*compare_args(tmp_path / "run", "--messages", tmp_path / "nope.json")), 2,
                 "cannot read messages file", "No such file or directory")
    assert_error(cli(*compare_args(tmp_path / "run", "--messages", tmp_path)), 2, "Is a directory")


@pytest.mark.parametrize("prompt, message", [
    ("", "the conversation is empty: give a non-empty prompt"),
    ("  \n\t ", "the conversation is empty"),
    ("caf\udce9", "message 0 content holds U+DCE9 at character 3"),   # a non-UTF-8 byte in argv
], ids=["empty", "whitespace-only", "undecodable-argv"])
def test_empty_or_undecodable_prompt(tmp_path, prompt, message):
    result = cli("-q", "compare", "--model", "tiny-llama", "-p", prompt, "--out", tmp_path / "run")
    assert_error(result, 2, message)
    assert not (tmp_path / "run").exists()


def test_prompt_of_only_special_tokens_runs_like_any_other(tmp_path):
    """Special-token text is tokenized as the chat template does (as those tokens) on both paths."""
    messages = [{"role": "user", "content": "<|im_start|><|im_end|><|endoftext|>"}]
    result = compare(messages, model="tiny-llama", max_new_tokens=2, out=tmp_path / "run")
    assert result.exit_code == 0 and result.report.to_json()["tokens_identical"]
    assert result.report.to_json()["prompt"]["tokens"].count("<|im_end|>") == 2   # the content's and the template's


def test_nul_characters_in_the_prompt_and_the_generated_text(tmp_path):
    messages = [{"role": "user", "content": "What\x00 is the capital of France?"}]
    result = compare(messages, model="tiny-llama", max_new_tokens=2, out=tmp_path / "run")
    assert result.exit_code == 0
    with open_trace(result.reference_trace) as trace:
        meta = replace(trace.meta, text="a\x00b", points=("logits",), layers=(), generated_ids=np.zeros(0, np.int64),
                       trace_mode="full", digest_points=(), digest_layers=())
    with TraceWriter(tmp_path / "nul.h5", meta) as writer:   # a model may generate NUL: stored as U+2400
        writer.write_rows("final", "logits", [0], torch.zeros(1, meta.dims.vocab_size))
    with open_trace(tmp_path / "nul.h5") as trace:
        assert trace.meta.text == "a\u2400b"


@pytest.mark.parametrize("extra, message", [
    (["-p", "a " * 3000], "prompt of 30"),
    (["-n", "2047"], "plus max_new_tokens 2047 exceeds the model context of 2048"),
], ids=["prompt-longer-than-context", "generation-past-context"])
def test_prompt_longer_than_the_context_fails_before_recording(tmp_path, extra, message):
    result = cli(*compare_args(tmp_path / "run", *extra))
    line = assert_error(result, 2, message, "exceeds the model context of 2048: shorten the prompt or lower")
    assert "request" not in line
    assert_no_finished_run(tmp_path / "run")
    assert not (tmp_path / "run").exists()



def test_generate_and_record_past_the_context_fail_before_the_model_runs(tmp_path):
    result = cli("generate", "--model", "tiny-llama", "-p", "What is the capital of France?", "-n", "2047")
    assert_error(result, 2, "plus max_new_tokens 2047 exceeds the model context of 2048: shorten the prompt")
    model, tokenizer = kvdiff.load_model("tiny-llama")
    with pytest.raises(kvdiff.InputError, match="exceeds the model context of 2048"):
        kvdiff.record(model, tokenizer, MESSAGES, tmp_path / "t.h5", max_new_tokens=2047)
    assert list(tmp_path.iterdir()) == []

def test_conversation_with_an_assistant_turn_and_an_empty_system_message(tmp_path):
    messages = [{"role": "system", "content": ""}, MESSAGES[1], {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Germany?"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"messages": messages}), encoding="utf-8")
    result = cli(*compare_args(tmp_path / "run", "--messages", path))
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["skipped_messages"] == [{"index": 0, "role": "system", "reason": "empty message"}]
    assert [c["name"] for c in report["chunks"]][:3] == ["user", "assistant", "user#2"]
    assert np.array_equal(report["reference"]["token_ids"], report["candidate"]["token_ids"])


def test_messages_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "m.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(MESSAGES).encode("utf-8"))
    assert build_messages(None, None, path) == MESSAGES


def test_a_model_without_a_chat_template_is_one_line_before_any_run(tmp_path):
    """A base model's tokenizer has no chat template: before, `unexpected ValueError`, exit 3."""
    model, tokenizer = kvdiff.load_model("tiny-llama")
    tokenizer.chat_template = None
    folder = tmp_path / "base-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for command in (["compare", "--out", tmp_path / "run"], ["generate"]):
        result = cli(*command, "--model", folder, "-p", "hi", "-n", "2")
        assert_error(result, 2, f"the tokenizer of {folder} has no chat template",
                     "add a chat_template to its tokenizer_config.json")
    assert not (tmp_path / "run").exists()


def test_a_chat_template_refusing_the_conversation_is_an_input_error():
    """Templates raise for roles they do not take (Gemma's and Mistral's refuse a system message)."""
    from kvdiff.engine.chunks import split_conversation
    from kvdiff.errors import InputError

    _, tokenizer = kvdiff.load_model("tiny-llama")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    with pytest.raises(InputError, match="refused the conversation: System role not supported"):
        split_conversation(tokenizer, MESSAGES)


# ---- many messages: work linear in their count (issue #28) -------------------------------------------

def _count_renders(monkeypatch) -> list[int]:
    """The number of messages of each chat-template render the chunker asks for."""
    import kvdiff.engine.chunks as chunks

    sizes: list[int] = []
    render = chunks.render_chat

    def counted(tokenizer, messages, generation):
        sizes.append(len(messages))
        return render(tokenizer, messages, generation)

    monkeypatch.setattr(chunks, "render_chat", counted)
    return sizes


def test_splitting_many_messages_renders_each_a_bounded_number_of_times(monkeypatch):
    """Each message's chunk came from a render of every prefix of the conversation: 2,000
    one-character messages took 2 million message renders (8.7 s), 200,000 more than 300 s,
    before the context check refused them. Now a window of two or three messages gives each chunk."""
    from kvdiff.engine.chunks import split_conversation

    _, tokenizer = kvdiff.load_model("tiny-llama")
    messages = [{"role": "user", "content": "x"}] * 2000
    sizes = _count_renders(monkeypatch)
    chunked = split_conversation(tokenizer, messages)
    assert len(chunked.chunks) == 2001 and [c.name for c in chunked.chunks[:2]] == ["user", "user#2"]
    whole = len(messages) * 3           # the whole conversation: without and with the generation prompt
    assert sum(sizes) <= 6 * len(messages) + whole, sum(sizes)


def test_a_messages_file_of_twenty_thousand_messages_is_refused_by_the_context_check(tmp_path, monkeypatch):
    sizes = _count_renders(monkeypatch)
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"role": "user", "content": "x"}] * 20_000), encoding="utf-8")
    assert_error(cli(*compare_args(tmp_path / "run", "--messages", path)), 2,
                 "prompt of 140006 tokens plus max_new_tokens 2 exceeds the model context of 2048")
    assert sum(sizes) <= 10 * 20_000, sum(sizes)
    assert not (tmp_path / "run").exists()


NUMBERED = "{% for m in messages %}{{ loop.index }}. {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"


def test_a_template_that_numbers_messages_still_gets_exact_chunks_within_a_bound(monkeypatch):
    """A window renders message 5 as "2. ...": the windows' texts do not join to the whole render,
    so every prefix is rendered, as before, and at most MAX_PREFIX_RENDER_MESSAGES messages."""
    from kvdiff.engine.chunks import MAX_PREFIX_RENDER_MESSAGES, split_conversation
    from kvdiff.errors import InputError

    _, tokenizer = kvdiff.load_model("tiny-llama")
    tokenizer.chat_template = NUMBERED
    messages = [{"role": "user", "content": f"m{i}"} for i in range(12)]
    chunked = split_conversation(tokenizer, messages)
    assert [tokenizer.decode(c.token_ids) for c in chunked.chunks][10:] == ["11. m10\n", "12. m11\n", "A:"]
    monkeypatch.setattr("kvdiff.engine.chunks.MAX_PREFIX_RENDER_MESSAGES", 10)
    with pytest.raises(InputError, match=r"12 messages are more than the 10 kvdiff renders so; use chunk_size=N"):
        split_conversation(tokenizer, messages)
    assert MAX_PREFIX_RENDER_MESSAGES == 2048
