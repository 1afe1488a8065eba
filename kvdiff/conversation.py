"""Conversations: validated chat messages, and how they are built from CLI-style input."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiff.errors import InputError

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]


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


def render_chat(tokenizer, messages: Messages, generation: bool, tokenize: bool = False):
    """`messages` through the tokenizer's chat template (text, or token ids with `tokenize`),
    with the assistant's generation prompt when `generation`. InputError when the tokenizer has
    no chat template or its template refuses the conversation."""
    from jinja2 import TemplateError

    name = getattr(tokenizer, "name_or_path", "") or "this model"
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"the tokenizer of {name} has no chat template, and kvdiff renders each conversation "
                         "with it (a chunk a message): use an instruct model, or add a chat_template to its "
                         "tokenizer_config.json")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=generation)
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


def render_prompt_ids(tokenizer, messages: Messages) -> list[int]:
    """Token ids of the conversation rendered with the chat template, generation prompt added."""
    encoded = render_chat(tokenizer, messages, generation=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(map(int, ids))
