"""Prompts in (chat template, stdin joining) and text out (incremental detokenisation)."""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from pathlib import Path

from .errors import RsdError


def counted(count: int, noun: str) -> str:
    """"1 step", "3 steps", "0 tokens": a count and its noun (one that takes an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def builtin_prompts(name: str) -> list[str]:
    """A built-in prompt set: "train" (distillation) or "eval" (held out, for benchmarks)."""
    text = (resources.files("rsd_cli") / "prompts" / f"{name}.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a file: one a line, or in a .jsonl file one a line as a JSON string or an object
    with a "prompt" string (prompts that hold line breaks: code, documents)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RsdError(f"cannot read prompts from {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RsdError(f"cannot read prompts from {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return prompts_in(text, path, jsonl=path.suffix == ".jsonl")


def prompts_in(text: str, source, jsonl: bool = False) -> list[str]:
    """read_prompt_file's prompts of a text read from `source` (named in errors)."""
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line.strip())
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise RsdError(f"{source}, line {number}: not JSON ({e})") from None
        value = value.get("prompt") if isinstance(value, dict) else value
        if not isinstance(value, str) or not value.strip():
            raise RsdError(f'{source}, line {number}: neither a prompt string nor an object with a "prompt" string')
        prompts.append(value)
    if not prompts:
        raise RsdError(f"{source} holds no prompts")
    return prompts


def messages_for(prompt: str, system: str | None = None, history: list[dict] | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + list(history or []) + [{"role": "user", "content": prompt}]


# a conversation for a model without a chat template (a base model): each message after its role's name,
# the answer after the assistant's (plain_conversation); a line starting the user's next turn ends an answer
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
NEXT_TURN = "\nUser:"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_conversation(prompt: str, system: str | None, history: list[dict]) -> str:
    """A chat's conversation as plain text, for a model without a chat template: the system prompt,
    then a line for each message after its role's name, ending where the assistant's answer starts.
    An answer that goes on to write the user's next turn stops there (chat's NEXT_TURN stop)."""
    lines = [system, ""] if system else []
    messages = [*history, {"role": "user", "content": prompt}]
    # (an answer's text begins with the space the model wrote after "Assistant:": one space, as it read)
    lines += [f"{ROLE_NAMES.get(m['role'], m['role'])}: {m['content'].strip()}" for m in messages]
    return "\n".join(lines) + f"\n{ROLE_NAMES['assistant']}:"


def not_utf8_at(text: str) -> int | None:
    """The byte at which `text` stops being UTF-8, or None: bytes that were not UTF-8 in an argument,
    the environment or a line read reach Python as surrogate escapes ("\\udcff" for 0xff)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return len(text[:e.start].encode())
    return None


def utf8_text(text: str, what: str) -> str:
    """`text` where it is UTF-8; else an error naming `what` and the byte where it stops being so."""
    at = not_utf8_at(text)
    if at is not None:
        raise RsdError(f"the {what} is not valid UTF-8 (byte {at})")
    return text


def encode_prompt(tokenizer, prompt: str, system: str | None = None, raw: bool = False,
                  history: list[dict] | None = None) -> list[int]:
    """Token ids for a prompt: through the chat template when the model has one (unless raw); else
    the system prompt before it, and a chat's turn (`history` given, even empty) as the plain text of
    its conversation (plain_conversation)."""
    utf8_text(prompt, "prompt")
    if system:
        utf8_text(system, "system prompt")
    for message in history or []:
        utf8_text(message["content"], f"conversation's {message['role']} message")
    if raw or not has_chat_template(tokenizer):
        if history is not None and not raw:
            text = plain_conversation(prompt, system, history)
        else:
            text = (system + "\n\n" + prompt) if system else prompt
        return tokenizer.encode(text, add_special_tokens=True)
    try:
        text = tokenizer.apply_chat_template(messages_for(prompt, system, history), add_generation_prompt=True,
                                             tokenize=False)
    except Exception as error:  # noqa: BLE001 - the template's own refusal (raise_exception) is jinja2's error
        refusal = template_refusal(error, system)
        if refusal is None:
            raise
        raise refusal from None
    return tokenizer.encode(text, add_special_tokens=False)


def template_refusal(error: Exception, system: str | None) -> RsdError | None:
    """An error of the chat template (jinja2's TemplateError: Gemma's "System role not supported",
    roles that must alternate) as a one-line RsdError, which a chat survives; None for any other."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return None
    if not isinstance(error, TemplateError):
        return None
    why = f"the model's chat template refuses this prompt: {str(error).strip() or type(error).__name__}"
    return RsdError(f"{why} (a system prompt was given, which some templates take none of)" if system else why)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces without splitting characters.

    Decodes a short window behind the newest tokens (as text-generation-inference does) so a
    multi-byte character split over tokens is printed only once it is complete.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character, shown as �)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


def token_bytes(tokenizer, token: int, text: str | None = None) -> bytes:
    """The bytes a token stands for: its text's UTF-8, or, where it holds part of a character (its
    text alone decodes to U+FFFD: an emoji's first bytes), the bytes of its piece: a byte-fallback
    piece's (`<0xF0>`) or a byte-level BPE's (GPT-2's alphabet of 256 characters, Llama 3's, SmolLM's).
    text: the token's text where the caller has decoded it already."""
    text = tokenizer.decode([token]) if text is None else text
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = _piece(tokenizer, token)
    candidate = None
    if isinstance(piece, str) and piece:
        table = _byte_of_character()
        if found := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            candidate = bytes([int(found.group(1), 16)])
        elif all(character in table for character in piece):
            candidate = bytes(table[character] for character in piece)
    # (bytes the tokenizer's own text is, where each partial character reads U+FFFD; else its text's UTF-8)
    if candidate is not None and candidate.decode("utf-8", errors="replace") == text:
        return candidate
    return text.encode("utf-8")


def _piece(tokenizer, token: int) -> str | None:
    """The token's piece in the vocabulary (`tokenizers`' id_to_token; a slow tokenizer's own)."""
    for backend in (getattr(tokenizer, "backend_tokenizer", None), getattr(tokenizer, "backend", None)):
        if hasattr(backend, "id_to_token"):
            return backend.id_to_token(token)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    return convert(token) if convert is not None else None


@functools.cache
def _byte_of_character() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode): each byte as a printable character."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(others)}}


def quoted_bytes(data: bytes, style: str = "json") -> str:
    """Bytes as a quoted literal, UTF-8 shown as text and a byte that is part of no whole character as
    \\xNN: `" \\xf0\\x9f"` (style "json": as json.dumps quotes text) or `' \\xf0\\x9f'` ("repr")."""
    parts = re.split("([\udc80-\udcff]+)", data.decode("utf-8", errors="surrogateescape"))
    body = "".join(_escaped_bytes(part) if index % 2 else _quoted_body(part, style) for index, part in enumerate(parts))
    quote = '"' if style == "json" else "'"
    return f"{quote}{body}{quote}"


def _escaped_bytes(part: str) -> str:
    return "".join(f"\\x{ord(character) - 0xDC00:02x}" for character in part)


def _quoted_body(text: str, style: str) -> str:
    if style == "json":
        return json.dumps(text, ensure_ascii=False)[1:-1]
    shown = repr(text)  # (single-quoted, unless the text holds a ' and no ")
    return shown[1:-1] if shown[0] == "'" else shown[1:-1].replace("'", "\\'")


def token_text_shown(tokenizer, token: int, style: str = "json", text: str | None = None) -> str:
    """A token's text (`text`, where decoded already) quoted for a reader (json.dumps' quoting, or repr's),
    its partial character's bytes as \\xNN (token_bytes) rather than U+FFFD."""
    text = tokenizer.decode([token]) if text is None else text
    if "\ufffd" in text:
        return quoted_bytes(token_bytes(tokenizer, token, text), style)
    return json.dumps(text, ensure_ascii=False) if style == "json" else repr(text)
