"""Prompts in (chat template, stdin joining) and text out (incremental detokenisation)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .errors import RsdError


def builtin_prompts(name: str) -> list[str]:
    """A built-in prompt set: "train" (distillation) or "eval" (held out, for benchmarks)."""
    text = (resources.files("rsd_cli") / "prompts" / f"{name}.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a file: one a line, or in a .jsonl file one a line as a JSON string or an object
    with a "prompt" string (prompts that hold line breaks: code, documents)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RsdError(f"cannot read prompts from {path}: {e}") from None
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


def encode_prompt(tokenizer, prompt: str, system: str | None = None, raw: bool = False,
                  history: list[dict] | None = None) -> list[int]:
    """Token ids for a prompt: through the chat template when the model has one (unless raw)."""
    if raw or not getattr(tokenizer, "chat_template", None):
        text = (system + "\n\n" + prompt) if (raw and system) else prompt
        return tokenizer.encode(text, add_special_tokens=True)
    text = tokenizer.apply_chat_template(messages_for(prompt, system, history), add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


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
