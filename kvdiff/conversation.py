"""Conversations: validated chat messages, and how they are built from CLI-style input."""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from pathlib import Path

from kvdiff.errors import InputError

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]
TOKEN_CACHE_TEXTS = 256                # texts whose token ids a tokenizer's TokenCache keeps


def validate_messages(messages) -> Messages:
    """Check a conversation: a non-empty list of {role, content} with known roles."""
    if not isinstance(messages, list) or not messages:
        raise InputError("a conversation must be a non-empty list of {role, content} messages")
    out: Messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise InputError(f"message {i} must be an object with keys 'role' and 'content' only")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InputError(f"message {i} has unknown role {role!r}: use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise InputError(f"message {i} content must be a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"message {i} content holds U+{ord(content[exc.start]):04X} at character {exc.start}, "
                             "which is not valid Unicode text: pass UTF-8 text") from None
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user":
        raise InputError("the last message must be from the user: kvdiff generates the reply")
    if not any(m["content"].strip() for m in out):
        raise InputError("the conversation is empty: give a non-empty prompt")
    return out


def render_chat(tokenizer, messages: Messages, generation: bool) -> str:
    """`messages` as text through the tokenizer's chat template, with the assistant's generation
    prompt when `generation`. InputError when the tokenizer has
    no chat template or its template refuses the conversation."""
    from jinja2 import TemplateError

    name = getattr(tokenizer, "name_or_path", "") or "this model"
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"the tokenizer of {name} has no chat template, and kvdiff renders each conversation "
                         "with it (a chunk a message): use an instruct model, or add a chat_template to its "
                         "tokenizer_config.json")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except TemplateError as exc:
        raise InputError(f"the chat template of {name} refused the conversation: {exc}") from None


def build_messages(prompt: str | None, system: str | None = None, messages_file: Path | None = None) -> Messages:
    """A conversation from `--prompt`/`--system`, or from a JSON `--messages` file."""
    if messages_file is not None:
        if prompt is not None or system is not None:
            raise InputError("give either --messages or --prompt/--system, not both")
        try:
            raw = Path(messages_file).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read messages file {messages_file}: {exc.strerror}") from None
        try:
            data = json.loads(raw.decode("utf-8-sig"))  # a byte-order mark (Windows editors) is fine
        except UnicodeDecodeError:
            raise InputError(f"messages file {messages_file} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"messages file {messages_file} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        except RecursionError:
            raise InputError(f"messages file {messages_file} is nested too deeply to be a list of messages") from None
        if isinstance(data, dict) and "messages" in data:
            data = data["messages"]
        return validate_messages(data)
    if prompt is None:
        raise InputError("no prompt: give --prompt TEXT (and optionally --system TEXT) or --messages FILE")
    messages: Messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return validate_messages(messages)


def check_fits(prompt_tokens: int, max_new_tokens: int, context: int, where: str = "") -> None:
    """InputError when a prompt of `prompt_tokens` plus `max_new_tokens` would run past a model
    context of `context` positions."""
    if prompt_tokens + max_new_tokens > context:
        raise InputError(f"{where}prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} "
                         f"exceeds the model context of {context}: shorten the prompt or lower max_new_tokens")


class TokenCache:
    """Token ids of the texts one tokenizer tokenized last (each alone), least recently used
    dropped past TOKEN_CACHE_TEXTS: a cached system prompt is tokenized once, not again on every
    request that sends it, and a rendered prompt once for the engine and its trace. Ids are a
    function of the text and the vocabulary; the entries are dropped when the vocabulary's size
    changes (tokens added). It holds no reference to its tokenizer, so that the weak mapping
    from tokenizers to caches lets a tokenizer go."""

    def __init__(self, vocabulary: int):
        self.vocabulary = vocabulary
        self.ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def encode(self, tokenizer, texts: list[str]) -> list[tuple[int, ...]]:
        """Token ids of each text, tokenized alone (the texts not kept in one batched call)."""
        if len(tokenizer) != self.vocabulary:
            self.vocabulary = len(tokenizer)
            self.ids.clear()
        missing = list(dict.fromkeys(t for t in texts if t not in self.ids))
        if missing:
            encoded = tokenizer(missing, add_special_tokens=False)["input_ids"]
            self.ids.update((t, tuple(int(i) for i in ids)) for t, ids in zip(missing, encoded))
        out = [self.ids[t] for t in texts]
        for t in texts:
            self.ids.move_to_end(t)
        while len(self.ids) > TOKEN_CACHE_TEXTS:
            self.ids.popitem(last=False)
        return out


_TOKEN_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def encode_texts(tokenizer, texts: list[str]) -> list[tuple[int, ...]]:
    """Token ids of each text, tokenized alone without special tokens, through the tokenizer's TokenCache."""
    cache = _TOKEN_CACHES.get(tokenizer)
    if cache is None:
        cache = _TOKEN_CACHES[tokenizer] = TokenCache(len(tokenizer))
    return cache.encode(tokenizer, texts)


def render_prompt_ids(tokenizer, messages: Messages) -> list[int]:
    """Token ids of the conversation rendered with the chat template, generation prompt added:
    the rendered text tokenized without special tokens (as apply_chat_template(tokenize=True)
    does), through the tokenizer's TokenCache."""
    (ids,) = encode_texts(tokenizer, [render_chat(tokenizer, messages, generation=True)])
    return list(ids)
