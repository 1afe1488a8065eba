"""Splitting a conversation into chunks: one per message plus the generation prompt, or fixed N-token chunks.

Message chunks come from diffing chat-template renders of message prefixes, each tokenized
alone. Their concatenation must equal the tokenization of the whole prompt; where the
template or tokenizer merges across a boundary that is an error naming the position,
unless the caller accepts the mismatch (then the chunk tokens are used, with a warning).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvdiff.conversation import Messages, render_chat, render_prompt_ids, validate_messages
from kvdiff.errors import InputError, TokenizationBoundaryError

log = logging.getLogger(__name__)

GENERATION_CHUNK = "generation"


@dataclass(frozen=True)
class Chunk:
    """A run of prompt tokens cached and reused as a unit."""

    name: str                     # "system", "user", "assistant", "user#2", ..., "generation", "chunk3"
    token_ids: tuple[int, ...]
    start: int                    # global position of the first token
    message_index: int | None = None  # index in the conversation; None for generation / fixed chunks

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> tuple[int, int]:
        """(first, last) global positions."""
        return (self.start, self.end - 1)


@dataclass(frozen=True)
class SkippedMessage:
    """A message that produced no chunk, and why."""

    message_index: int
    role: str
    reason: str


@dataclass
class ChunkedPrompt:
    """A conversation's prompt as chunks."""

    messages: Messages            # the messages rendered (skipped ones removed)
    chunks: list[Chunk]
    prompt_ids: list[int]         # concatenation of the chunk tokens
    skipped: list[SkippedMessage] = field(default_factory=list)
    boundary_mismatch: bool = False

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _render(tokenizer, messages: Messages, generation: bool) -> str:
    if not messages:
        return ""
    return render_chat(tokenizer, messages, generation)


def _encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _chunk_name(role: str, seen: dict[str, int]) -> str:
    seen[role] = seen.get(role, 0) + 1
    return role if seen[role] == 1 else f"{role}#{seen[role]}"


def _check_boundaries(tokenizer, chunks: list[Chunk], whole: list[int], allow_mismatch: bool) -> bool:
    joined = [t for c in chunks for t in c.token_ids]
    if joined == whole:
        return False
    pos = next((i for i, (a, b) in enumerate(zip(joined, whole)) if a != b), min(len(joined), len(whole)))
    chunk = next((c.name for c in chunks if c.start <= pos < c.end), chunks[-1].name)
    got = tokenizer.convert_ids_to_tokens(joined[pos]) if pos < len(joined) else "<end>"
    want = tokenizer.convert_ids_to_tokens(whole[pos]) if pos < len(whole) else "<end>"
    message = (f"chunk tokens differ from the whole-prompt tokenization at position {pos} (chunk {chunk}): "
               f"chunks give {got!r}, the whole prompt gives {want!r}")
    if not allow_mismatch:
        raise TokenizationBoundaryError(
            message + "; use chunk_size=N, or allow_boundary_mismatch=True to go on with the chunk tokens")
    log.warning("%s; going on with the chunk tokens", message)
    return True


def split_messages(tokenizer, messages: Messages, allow_boundary_mismatch: bool = False) -> ChunkedPrompt:
    """One chunk per non-empty message plus the generation-prompt chunk."""
    messages = validate_messages(messages)
    kept: Messages = []
    skipped: list[SkippedMessage] = []
    for i, message in enumerate(messages):
        if message["content"] == "":
            skipped.append(SkippedMessage(i, message["role"], "empty message"))
            log.info("message %d (%s) is empty: no chunk", i, message["role"])
        else:
            kept.append(message)
    if not kept or kept[-1]["role"] != "user":
        raise InputError("the last non-empty message must be from the user: kvdiff generates the reply")
    chunks: list[Chunk] = []
    seen: dict[str, int] = {}
    previous = ""
    start = 0
    index_of = [i for i, m in enumerate(messages) if m["content"] != ""]
    for n in range(len(kept) + 1):
        generation = n == len(kept)
        text = _render(tokenizer, kept, True) if generation else _render(tokenizer, kept[: n + 1], False)
        if not text.startswith(previous):
            raise TokenizationBoundaryError(
                f"the chat template renders message {n} differently once later messages follow: "
                "per-message chunks are impossible with this template; use chunk_size=N")
        piece = text[len(previous):]
        previous = text
        ids = _encode(tokenizer, piece)
        if not ids:
            continue
        if generation:
            name, index = GENERATION_CHUNK, None
        else:
            name, index = _chunk_name(kept[n]["role"], seen), index_of[n]
        chunks.append(Chunk(name, tuple(ids), start, index))
        start += len(ids)
    whole = render_prompt_ids(tokenizer, kept)
    mismatch = _check_boundaries(tokenizer, chunks, whole, allow_boundary_mismatch)
    prompt_ids = [t for c in chunks for t in c.token_ids]
    return ChunkedPrompt(kept, chunks, prompt_ids, skipped, mismatch)


def split_fixed(tokenizer, messages: Messages, chunk_size: int) -> ChunkedPrompt:
    """Fixed `chunk_size`-token chunks of the whole prompt, named chunk0, chunk1, ..."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    messages = validate_messages(messages)
    kept = [m for m in messages if m["content"] != ""]
    skipped = [SkippedMessage(i, m["role"], "empty message") for i, m in enumerate(messages) if m["content"] == ""]
    ids = render_prompt_ids(tokenizer, kept)
    chunks = [Chunk(f"chunk{n}", tuple(ids[s: s + chunk_size]), s)
              for n, s in enumerate(range(0, len(ids), chunk_size))]
    return ChunkedPrompt(kept, chunks, ids, skipped, False)


def split_conversation(tokenizer, messages: Messages, chunk_size: int | None = None,
                       allow_boundary_mismatch: bool = False) -> ChunkedPrompt:
    """Chunks of a conversation: per message (default) or fixed `chunk_size`-token chunks."""
    if chunk_size is None:
        return split_messages(tokenizer, messages, allow_boundary_mismatch)
    return split_fixed(tokenizer, messages, chunk_size)
