"""Splitting a conversation into chunks: one per message plus the generation prompt, or fixed N-token chunks.

Message chunks come from diffing chat-template renders of message prefixes, each tokenized
alone. Their concatenation must equal the tokenization of the whole prompt; where the
template or tokenizer merges across a boundary that is an error naming the position,
unless the caller accepts the mismatch (then the chunk tokens are used, with a warning).

Rendering every prefix costs a render of the conversation per message, which grows with the
square of the message count (2,000 one-character messages took 8.7 s, 200,000 more than 300 s,
before the context check refused them). A message's text is taken instead from a window of two
or three messages ending with it (the text `render(window)` adds to `render(window minus it)`),
which is linear; the windows' texts must then join to exactly the render of the whole
conversation. A template whose windows do not (one that numbers messages, or renders one
differently once later ones follow) gets the prefix renders, for at most
MAX_PREFIX_RENDER_MESSAGES messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvdiff.conversation import Messages, encode_texts, render_chat, render_prompt_ids, validate_messages
from kvdiff.errors import InputError, TokenizationBoundaryError

log = logging.getLogger(__name__)

GENERATION_CHUNK = "generation"
MAX_PREFIX_RENDER_MESSAGES = 2048      # prefix renders (quadratic): 2,048 messages take a few seconds


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


def _window_texts(tokenizer, kept: Messages) -> list[str] | None:
    """Each message's text as the window ending with it renders it: the window starts at the even
    index at or before the previous message (so it keeps the parity a template that checks
    alternating roles expects), two or three messages. None when a window's render does not
    extend the render without its last message, or a template refuses a window."""
    texts: list[str] = []
    cached: tuple[int, int, str] = (-1, -1, "")         # (first, end, render) of the last window
    for n in range(len(kept)):
        first = max(n - 1, 0) & ~1
        try:
            before = cached[2] if cached[:2] == (first, n) else _render(tokenizer, kept[first:n], False)
            after = _render(tokenizer, kept[first:n + 1], False)
        except InputError:
            return None
        if not after.startswith(before):
            return None
        texts.append(after[len(before):])
        cached = (first, n + 1, after)
    return texts


def _prefix_texts(tokenizer, kept: Messages) -> list[str]:
    """Each message's text as the render of the conversation up to it adds it: exact for any
    template, at a render of the conversation per message."""
    if len(kept) > MAX_PREFIX_RENDER_MESSAGES:
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise InputError(f"the chat template of {name} renders a message differently within a few messages than "
                         f"within the whole conversation, so per-message chunks take a render of every prefix: "
                         f"{len(kept)} messages are more than the {MAX_PREFIX_RENDER_MESSAGES} kvdiff renders so; "
                         "use chunk_size=N (--chunk-size N)")
    texts, previous = [], ""
    for n in range(len(kept)):
        text = _render(tokenizer, kept[: n + 1], False)
        if not text.startswith(previous):
            raise TokenizationBoundaryError(
                f"the chat template renders message {n} differently once later messages follow: "
                "per-message chunks are impossible with this template; use chunk_size=N")
        texts.append(text[len(previous):])
        previous = text
    return texts


def _message_texts(tokenizer, kept: Messages) -> tuple[list[str], str]:
    """The text each message adds to the render of the conversation, and the generation prompt's."""
    whole = _render(tokenizer, kept, False)
    texts = _window_texts(tokenizer, kept)
    if texts is None or "".join(texts) != whole:
        texts = _prefix_texts(tokenizer, kept)
        whole = "".join(texts)
    prompt = _render(tokenizer, kept, True)
    if not prompt.startswith(whole):
        raise TokenizationBoundaryError(
            f"the chat template renders message {len(kept) - 1} differently once the generation prompt follows: "
            "per-message chunks are impossible with this template; use chunk_size=N")
    return texts, prompt[len(whole):]


def _chunk_name(role: str, seen: dict[str, int]) -> str:
    seen[role] = seen.get(role, 0) + 1
    return role if seen[role] == 1 else f"{role}#{seen[role]}"


def _check_boundaries(tokenizer, chunks: list[Chunk], joined: list[int], whole: list[int],
                      allow_mismatch: bool) -> bool:
    """Whether the chunks' tokens `joined` differ from the whole prompt's; an error where they do,
    unless `allow_mismatch`."""
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
    start = 0
    index_of = [i for i, m in enumerate(messages) if m["content"] != ""]
    texts, generation_text = _message_texts(tokenizer, kept)
    for n, ids in enumerate(encode_texts(tokenizer, [*texts, generation_text])):
        generation = n == len(kept)
        if not ids:
            continue
        if generation:
            name, index = GENERATION_CHUNK, None
        else:
            name, index = _chunk_name(kept[n]["role"], seen), index_of[n]
        chunks.append(Chunk(name, ids, start, index))
        start += len(ids)
    prompt_ids = [t for c in chunks for t in c.token_ids]
    mismatch = _check_boundaries(tokenizer, chunks, prompt_ids, render_prompt_ids(tokenizer, kept),
                                 allow_boundary_mismatch)
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
