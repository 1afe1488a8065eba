"""The identity of what a trace was recorded with: hashes of a model's config and weights and of
its tokenizer, so two traces can tell whether they ran the same checkpoint."""

from __future__ import annotations

import hashlib
import json
import weakref

import torch


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_HASH_CHUNK = 1 << 26                 # elements hashed at once (bounds the int64 scratch memory)
_MUL1, _MUL2, _MUL3 = -7046029254386353131, -4658895280553007687, 6364136223846793005


def _mixed_word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Every word of `tensor` mixed with its index (multiply, xor-shift), summed with int64
    wrap-around: a 0-dim tensor on the tensor's device, queued there without waiting for it."""
    words = tensor.detach().contiguous().view(-1)
    words = words.view(_WORDS[words.element_size()])
    if words.is_cuda:
        from kvdiff.trace import hash_kernel      # imports Triton: only when weights are on a GPU

        if hash_kernel.available:
            return hash_kernel.mixed_word_sum(words, _MUL1, _MUL2, _MUL3)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _HASH_CHUNK):
        x = words[start:start + _HASH_CHUNK].to(torch.int64) * _MUL1
        x += torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64) * _MUL2
        x ^= x >> 31
        x *= _MUL3
        x ^= x >> 29
        total += x.sum()
    return total


def gpu_weight_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """An 8-byte hash of each GPU tensor's bytes, computed on its GPU.

    Each hash is the sum modulo 2**64 of the tensor's words mixed with their indices (an integer
    sum, so its order does not matter). Every tensor is queued first and each GPU is then waited
    on once. Copying a billion weights to the host to hash them there costs seconds; this costs
    milliseconds.
    """
    sums = [_mixed_word_sum(t) for t in tensors]
    values: dict[int, int] = {}
    for device in {s.device for s in sums}:
        indices = [i for i, s in enumerate(sums) if s.device == device]
        values.update(zip(indices, torch.stack([sums[i] for i in indices]).tolist()))
    return [(values[i] % 2**64).to_bytes(8, "little") for i in range(len(sums))]


def model_fingerprint(model: torch.nn.Module) -> str:
    """'cfg:<16 hex>/w:<16 hex>': a hash of the config and one of every weight's bytes.

    Weights on a GPU are hashed there (`gpu_weight_digests`) and the weight part is then
    written 'wg:', so a fingerprint says which scheme made it: the same weights on CPU and on
    GPU give different fingerprints.
    """
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "dtype", "torch_dtype")}
    cfg = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    parts: list[bytes | int] = []          # bytes to hash, or the index of a GPU tensor's digest
    on_gpu: list[torch.Tensor] = []
    seen = set()
    for name, tensor in model.state_dict().items():
        parts.append(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if tensor.is_cuda:
            parts.append(len(on_gpu))
            on_gpu.append(tensor)
        else:
            parts.append(tensor.detach().contiguous().view(torch.uint8).numpy().data)
    gpu_digests = gpu_weight_digests(on_gpu)
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(gpu_digests[part] if isinstance(part, int) else part)
    return f"cfg:{cfg}/{'wg' if on_gpu else 'w'}:{digest.hexdigest()}"


def _tokenizer_shape(tokenizer, backend) -> tuple:
    """What a tokenizer's user can change without building a new one, cheaply read: its length
    (added tokens), chat template, and the fast backend's pipeline around the vocabulary
    (normalizer, pre-tokenizer, post-processor, decoder: what `add_bos_token` and the like rewrite),
    truncation and padding."""
    parts = tuple(None if p is None else p.__getstate__() for p in
                  (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder))
    return (len(tokenizer), str(getattr(tokenizer, "chat_template", "") or ""), parts,
            repr(backend.truncation), repr(backend.padding))


_tokenizer_memo: "weakref.WeakKeyDictionary[object, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's full definition and chat template.

    A fast tokenizer's definition is serialised whole (~10-40 ms for a 50k-128k vocabulary) once
    per tokenizer object and remembered with `_tokenizer_shape`; it is serialised again when that
    shape changes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        body = json.dumps(sorted(tokenizer.get_vocab().items()))
        return _hash_body(body, tokenizer)
    shape = _tokenizer_shape(tokenizer, backend)
    try:
        known = _tokenizer_memo.get(tokenizer)
    except TypeError:         # an unhashable tokenizer object: nothing remembered
        return _hash_body(backend.to_str(), tokenizer)
    if known is not None and known[0] == shape:
        return known[1]
    fingerprint = _hash_body(backend.to_str(), tokenizer)
    _tokenizer_memo[tokenizer] = (shape, fingerprint)
    return fingerprint


def _hash_body(body: str, tokenizer) -> str:
    body += "\n" + str(getattr(tokenizer, "chat_template", "") or "")
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()
