"""The float32 copy of a GGUF that llama.cpp runs by default: the reference's values, the source's metadata."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvdiff.errors import ModelLoadError
from kvdiff.targets.gguf_float import float32_gguf

Q = gguf.GGMLQuantizationType


def _source(path):
    """A small quantized GGUF: a Q4_1 and a Q8_0 matrix, an F16 one, an F32 vector, metadata of each kind."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "tiny")
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1])
    for name, kind, shape in (("blk.0.attn_q.weight", Q.Q4_1, (8, 64)), ("blk.0.ffn_down.weight", Q.Q8_0, (4, 64)),
                              ("token_embd.weight", Q.F16, (3, 64)), ("output_norm.weight", Q.F32, (64,))):
        values = rng.standard_normal(shape).astype(np.float32)
        if kind in (Q.Q4_1, Q.Q8_0):
            writer.add_tensor(name, gguf.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values.astype(np.float16 if kind is Q.F16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_copy_holds_the_dequantized_values_and_every_field_but_the_file_type(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    source = _source(tmp_path / "tiny.Q4_1.gguf")
    copy = float32_gguf(source)
    assert copy.name == "tiny.Q4_1.F32.gguf" and copy.is_relative_to(tmp_path / "cache")
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(copy)
    fields = {f.name: f.contents() for f in before.fields.values() if not f.name.startswith("GGUF.")}
    copied = {f.name: f.contents() for f in after.fields.values() if not f.name.startswith("GGUF.")}
    assert copied.pop("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert fields.pop("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1
    assert copied == fields and copied["general.alignment"] == 64
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        assert new.tensor_type is Q.F32 and list(new.shape) == list(old.shape)
        assert np.array_equal(np.asarray(new.data), gguf.dequantize(old.data, old.tensor_type)), old.name


def test_the_copy_is_made_once_per_source_content(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    source = _source(tmp_path / "tiny.gguf")
    copy = float32_gguf(source)
    made = copy.stat().st_mtime_ns
    assert float32_gguf(source) == copy and copy.stat().st_mtime_ns == made
    (tmp_path / "elsewhere").mkdir()
    assert float32_gguf(_source(tmp_path / "elsewhere" / "tiny.gguf")) == copy     # the same bytes: the same copy


def test_a_file_that_is_not_a_gguf_is_refused_with_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="model.gguf is not a readable GGUF file"):
        float32_gguf(bad)
    assert not any((tmp_path / "cache").rglob("*.gguf"))


def test_a_copy_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    source = _source(tmp_path / "tiny.gguf")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(ModelLoadError, match=r"needs 0\.0 GB in .*cache.* which has 0\.0 GB free: .*"
                                             r"--engine-weights native"):
        float32_gguf(source)
    assert not any((tmp_path / "cache").rglob("*.gguf"))


def test_a_tensor_that_does_not_dequantize_is_refused_with_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDIFF_CACHE", str(tmp_path / "cache"))
    source = _source(tmp_path / "tiny.gguf")

    def unsupported(data, kind):
        raise NotImplementedError(f"Dequantization for {kind.name} is not yet implemented")

    monkeypatch.setattr(gguf, "dequantize", unsupported)
    with pytest.raises(ModelLoadError, match="its tensor blk.0.attn_q.weight of type Q4_1 does not dequantize .*"
                                             "--engine-weights native"):
        float32_gguf(source)
    assert not any((tmp_path / "cache").rglob("*.gguf"))
