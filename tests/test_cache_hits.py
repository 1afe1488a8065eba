"""Runs that read chunks from the engine's cache: K/V-only positions in the trace, their diff, --warm.

A position whose K/V the engine read from its cache ran no forward in that request: the trace
holds its `k` and `v` (what attention read) and no other point. Before, such a run could not be
recorded at all (a repeated message under isolated-local was exit 3, "the probe did not fire").
"""

import json

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvdiff
from kvdiff.cli import app
from kvdiff.run.compare import compare
from kvdiff.engine import Engine
from kvdiff.engine.chunks import split_conversation
from kvdiff.errors import TraceError
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace import TraceWriter, open_trace

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
REPEATED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Hi"}]


def _chunk(report: dict, name: str) -> dict:
    return next(c for c in report["chunks"] if c["name"] == name)


def test_a_warm_prefix_run_reads_every_chunk_from_the_cache_and_stays_bitwise(tmp_path):
    result = compare(MESSAGES, model="tiny-llama", strategy="prefix", numerics="exact", warm=True,
                     max_new_tokens=5, out=tmp_path / "run", trace_mode="full")    # the full format's K/V-only rows
    report = result.report.to_json()
    assert report["verdict"] == "identical" and report["first_bit_difference"] is None
    assert {c["cache"] for c in report["chunks"]} == {"hit"}
    prompt = len(report["prompt"]["token_ids"])
    with open_trace(result.candidate_trace) as cand, open_trace(result.reference_trace) as ref:
        assert cand.meta.schema_version == 2 and ref.meta.schema_version == 1
        # every prompt position is read from the cache, but the last: it runs for the first logits
        assert cand.meta.kv_only_positions.tolist() == list(range(prompt - 1))
        assert ref.meta.kv_only_positions.size == 0
    heat = report["heatmaps"]
    assert heat["k"]["tiers"][0][:prompt] == ["bitwise"] * prompt          # the cache rows are compared
    assert heat["attn_out"]["tiers"][0][:prompt] == [None] * (prompt - 1) + ["bitwise"]
    assert report["final"]["logits"]["tiers"][:prompt] == [None] * (prompt - 1) + ["bitwise"]

    cold = compare(MESSAGES, model="tiny-llama", strategy="prefix", numerics="exact", max_new_tokens=5,
                   out=tmp_path / "cold", trace_mode="full")
    assert {c["cache"] for c in cold.report.to_json()["chunks"]} == {"miss"}
    with open_trace(cold.candidate_trace) as cand:
        assert cand.meta.schema_version == 1 and cand.meta.kv_only_positions.size == 0


def test_warm_with_another_conversation_hits_only_the_chunks_they_share(tmp_path):
    other = [MESSAGES[0], {"role": "user", "content": "What is the capital of Spain?"}]
    result = compare(MESSAGES, model="tiny-llama", strategy="prefix", numerics="exact", warm=other,
                     max_new_tokens=4, out=tmp_path / "run")
    report = result.report.to_json()
    assert [c["cache"] for c in report["chunks"]] == ["hit", "miss", "miss"]
    assert report["verdict"] == "identical" and report["first_bit_difference"] is None
    first, last = _chunk(report, "system")["positions"]
    with open_trace(result.candidate_trace) as cand:
        assert cand.meta.kv_only_positions.tolist() == list(range(first, last + 1))

    run = CliRunner().invoke(app, ["compare", "-m", "tiny-llama", "-p", "Hi", "--warm-with", str(tmp_path / "no.json"),
                                   "-o", str(tmp_path / "cli")])
    assert run.exit_code == 2 and "cannot read messages file" in run.output and not (tmp_path / "cli").exists()


def test_a_warm_run_recording_neither_k_nor_v_leaves_the_cached_positions_out(tmp_path):
    result = compare(MESSAGES, model="tiny-llama", warm=True, capture="resid_pre,logits", max_new_tokens=3,
                     out=tmp_path / "run", trace_mode="full")
    prompt = len(result.report.to_json()["prompt"]["token_ids"])
    with open_trace(result.candidate_trace) as cand:
        assert cand.meta.schema_version == 1 and cand.positions[0] == prompt - 1    # only computed positions
    assert result.report.to_json()["verdict"] == "identical"
    assert result.report.to_json()["alignment"]["only_reference"] == list(range(prompt - 1))


def test_a_repeated_message_is_read_from_the_cache_and_its_position_mismatch_found(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--messages", _write(tmp_path, REPEATED), "-m", "tiny-llama",
                                      "--strategy", "isolated-local", "-n", "4", "-o", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output                    # before: exit 3, "the probe did not fire"
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    again = _chunk(report, "user#2")
    assert again["cache"] == "hit" and _chunk(report, "user")["cache"] == "miss"
    start, end = again["positions"]
    found = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user#2"]
    assert len(found) == 1 and found[0]["offset"] == -start and found[0]["positions"] == [start, end]
    assert "read from the cache, v matches the reference" in found[0]["evidence"]
    assert report["heatmaps"]["q"]["tiers"][0][start:end + 1] == [None] * (end - start + 1)
    assert "kv only" in CliRunner().invoke(app, ["inspect", str(tmp_path / "run" / "candidate.h5")]).output


def test_a_cached_chunk_computed_without_its_context_is_a_missing_context(tmp_path):
    result = compare(MESSAGES, model="tiny-llama", strategy="isolated-global", warm=True, max_new_tokens=3,
                     out=tmp_path / "run")
    user = _chunk(result.report.to_json(), "user")
    assert user["cache"] == "hit"
    found = [d for d in result.report.to_json()["diagnoses"] if d["kind"] == "missing_context" and d.get("cached")]
    assert len(found) == 1 and found[0]["chunk"] == "user", result.report.to_json()["diagnoses"]
    assert found[0]["unattended"] == [0, user["positions"][0] - 1] and found[0]["layer"] == 1
    assert found[0]["positions"][0] == user["positions"][0] and 0 < found[0]["reference_attention_mass"] <= 1
    assert "read from the cache: their k and v match the reference at layer 0" in found[0]["evidence"]
    assert not [d for d in result.report.to_json()["diagnoses"] if d["kind"] in ("position_mismatch", "cache_content_mismatch")
                and d["chunk"] == "user"]


def _write(tmp_path, messages) -> str:
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    return str(path)


def test_a_stale_cache_slot_is_a_cache_content_mismatch_naming_where_its_rows_came_from(tmp_path, tiny_llama):
    model, tokenizer = tiny_llama
    chunked = split_conversation(tokenizer, MESSAGES)
    engine = Engine(model, tokenizer, strategy="prefix", numerics="exact")
    kvdiff.record(model, tokenizer, chunked.messages, tmp_path / "ref.h5", max_new_tokens=4,
                  fingerprint=engine.fingerprint)
    engine.generate([chunked.messages], max_new_tokens=1)
    entries = sorted(engine.registry._entries.values(), key=lambda e: e.encoded_start)
    system, user = entries[0], entries[1]
    wrong, right = user.slots[:3], system.slots[2:5]          # user's first rows overwritten by system's 2-4
    for layer in range(len(engine.pool.k)):
        engine.pool.k[layer][wrong] = engine.pool.k[layer][right]
        engine.pool.v[layer][wrong] = engine.pool.v[layer][right]
    recorder = TraceRecorder.for_model(model, tokenizer, chunked.messages, tmp_path / "cand.h5", strategy="prefix",
                                       fingerprint=engine.fingerprint, max_new_tokens=4)
    (out,) = engine.generate([chunked.messages], max_new_tokens=4, sinks={0: recorder})
    recorder.finish(out.token_ids, out.text, out.chunks)

    div = kvdiff.diff(tmp_path / "ref.h5", tmp_path / "cand.h5")
    stale = [d for d in div.diagnoses if d.kind == "cache_content_mismatch"]
    first = user.encoded_start
    assert len(stale) == 1 and stale[0].chunk == "user" and stale[0].positions == (first, first + 2)
    assert stale[0].details["source_positions"] == [2, 3, 4]
    assert "although the tokens are the same" in stale[0].evidence
    assert f"{first}<-2" in stale[0].evidence


def test_gate_cases_take_warm_as_a_boolean(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text("[[case]]\nname = 'warm'\nmodel = 'tiny-llama'\nprompt = 'Hello'\nmax_new_tokens = 3\nwarm = true\n")
    result = CliRunner().invoke(app, ["gate", str(cases), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    cases.write_text("[[case]]\nname = 'warm'\nprompt = 'Hello'\nwarm = 1\n")
    result = CliRunner().invoke(app, ["gate", str(cases), "--out", str(tmp_path / "p")])
    assert result.exit_code == 2 and "`warm` has the wrong type (int)" in result.output


# -- the trace format ------------------------------------------------------------------------


def _small_trace(path, kv_only, extra_row: bool = False):
    from test_trace import make_meta

    g = torch.Generator().manual_seed(0)
    with TraceWriter(path, make_meta()) as w:
        computed = [p for p in range(6) if p not in kv_only]
        for layer in (0, 1):
            w.write_rows(f"layers/{layer}", "k", range(6), torch.randn(6, 2, 8, generator=g))
            rows = computed + ([kv_only[0]] if extra_row else [])
            w.write_rows(f"layers/{layer}", "resid_pre", rows, torch.randn(len(rows), 32, generator=g))
        w.close(generated_ids=[], text="", kv_only_positions=kv_only)


def test_the_writer_records_kv_only_positions_under_schema_2_and_refuses_other_rows_there(tmp_path):
    _small_trace(tmp_path / "t.h5", [1, 2])
    with open_trace(tmp_path / "t.h5") as tr:
        assert tr.meta.schema_version == 2 and tr.meta.kv_only_positions.tolist() == [1, 2]
        assert tr.positions.tolist() == list(range(6))
    with pytest.raises(ProbeIntegrityError, match="resid_pre holds rows for positions 1, where only k and v are"):
        _small_trace(tmp_path / "u.h5", [1, 2], extra_row=True)
    assert not (tmp_path / "u.h5").exists()


@pytest.mark.parametrize("change, words", [
    (lambda f: f.attrs.__setitem__("schema_version", 1), "kv_only_positions needs schema 2, not 1"),
    (lambda f: f.__delitem__("kv_only_positions"), "a trace of schema 2 must hold kv_only_positions"),
    (lambda f: (f.__delitem__("kv_only_positions"), f.create_dataset("kv_only_positions", data=np.array([2, 1]))),
     "kv_only_positions must be strictly increasing"),
    (lambda f: (f.__delitem__("kv_only_positions"), f.create_dataset("kv_only_positions", data=np.array([9]))),
     "kv_only_positions holds positions that /positions does not"),
    (lambda f: f.attrs.__setitem__("schema_version", 5), r"has schema 5, newer than this kvdiff reads \(1 to 4\)"),
])
def test_the_reader_refuses_kv_only_positions_that_break_the_format(tmp_path, change, words):
    path = tmp_path / "t.h5"
    _small_trace(path, [1, 2])
    with h5py.File(path, "a") as f:
        change(f)
    with pytest.raises(TraceError, match=words):
        open_trace(path)


def test_keys_stored_otherwise_after_their_forward_are_the_engines_when_later_readers_differ(tmp_path, monkeypatch):
    """Red-team round 7, t89: rerotate's placed keys of layer 1 rotated one position too far. The
    forward that computed them read them right (its z matches), the later forwards that read the
    placed keys differ, outside the zoom window (by their digests): the keys are the engine's, not a
    recording. Before, only the window's readers were asked and the claim was called a recording."""
    import kvdiff.engine.runner as runner

    place = runner.ModelRunner.place

    def one_too_far(self, src, dst, delta):
        place(self, src, dst, delta)
        k, v = self.pool.rows(1, dst)
        cos, sin = self.adapter.rope(self.pool.k[0][:1], torch.ones_like(delta), self.adapter.layers[1].rope_kind)
        self.pool.write(1, dst, runner.rerotate_keys(k, cos.to(k.device), sin.to(k.device)), v)

    monkeypatch.setattr(runner.ModelRunner, "place", one_too_far)
    system = " ".join(f"Rule {i}: answer politely and briefly, in French." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    report = kvdiff.compare(messages, model="tiny-llama", strategy="rerotate", max_new_tokens=4,
                            out=tmp_path / "run").report.to_json()
    cc = [d for d in report["diagnoses"] if d["kind"] == "cache_content_mismatch" and d["layer"] == 1]
    assert cc and cc[0]["k_rotation"]["encoded_positions"][0] == cc[0]["positions"][0] + 1, cc
    assert "read_downstream" not in cc[0] and cc[0]["confidence"] == 1.0, cc
