"""A model folder's tokenizer read without transformers, where that gives what transformers gives.

Importing transformers costs ~0.55 s of a 2-core CPU's time and loading its generic fast tokenizer
~0.3 s more: a third of a whole `rsd generate "Hi" -n 1` once the models load without its modeling
code (rsd_cli/llama.py). Its generic class (`TokenizersBackend`, `PreTrainedTokenizerFast` before
transformers 5) is a thin layer over the `tokenizers` library's `Tokenizer` of `tokenizer.json`: it
encodes and decodes through it, names its special tokens from `tokenizer_config.json`, and renders
the chat template with jinja2 in a sandbox. `LightTokenizer` does the same for what rsd asks of a
tokenizer (encode, decode, the chat template, the special tokens' ids, the vocabulary), and only
where the configuration holds nothing else that transformers would act on: any other key, a
special token the vocabulary lacks, a template jinja2 cannot compile here, and `load` gives None,
so the model's tokenizer loads through transformers as before (tests/test_light_tokenizer.py
compares both on the same files).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing rsd asks of the tokenizer (lengths, padding and
# truncation sides for batches, where the file came from, which class to build)
INERT_KEYS = {"tokenizer_class", "backend", "added_tokens_decoder", "model_max_length", "padding_side",
              "truncation_side", "model_input_names", "is_local", "local_files_only", "name_or_path",
              "chat_template", "clean_up_tokenization_spaces", "errors", "extra_special_tokens",
              "additional_special_tokens", "split_special_tokens"}
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _transformers_major() -> int:
    """The installed transformers' major version, read from its metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def generic_config(folder: Path) -> dict | None:
    """The folder's tokenizer_config.json where it names transformers' generic fast tokenizer and a
    tokenizer.json is there to build it from; None otherwise (unreadable, another class)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    return config if (folder / "tokenizer.json").is_file() else None


def _token_text(value) -> str | None:
    """A special token as the config writes it: a string, or an AddedToken's fields ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _unchanged_by(config: dict, backend) -> bool:
    """Whether transformers would use `backend` as it is: the keys it acts on keep their defaults,
    or say what the tokenizer file already does."""
    if set(config) - INERT_KEYS - set(SPECIAL_TOKENS):
        return False
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens"):
        return False
    if config.get("extra_special_tokens") or config.get("additional_special_tokens"):
        return False  # (tokens transformers would add to the vocabulary if missing, and mark special)
    if "clean_up_tokenization_spaces" not in config and _transformers_major() < 5:
        return False  # (before transformers 5 its default was to clean up)
    for name in SPECIAL_TOKENS:
        if name in config and config[name] is not None:
            text = _token_text(config[name])
            if text is None or backend.token_to_id(text) is None:
                return False  # (transformers would add it to the vocabulary)
    decoder = config.get("added_tokens_decoder") or {}
    for index, token in decoder.items():
        text = _token_text(token)
        if text is None or backend.token_to_id(text) != int(index):
            return False
    return True


def _chat_template(folder: Path, config: dict) -> tuple[bool, str | None]:
    """(found in a form read here, the template or None): chat_template.jinja (transformers 5), else
    the config's `chat_template` string; a list of named templates is left to transformers."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return True, path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return True, template
    return False, None


def _compiled(template: str):
    """The template in the environment transformers renders chat templates in (a sandbox, blocks
    trimmed, loop controls, `tojson` without HTML escapes, `raise_exception`, `strftime_now`)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise ImportError("jinja2 before 3.1.6 has known sandbox escapes")  # (transformers refuses those too)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)


class LightTokenizer:
    """encode, decode, apply_chat_template (as text), the special tokens and the vocabulary of a
    `tokenizers.Tokenizer`, as transformers' generic fast tokenizer gives them for the same files."""

    def __init__(self, backend, special: dict[str, str], chat_template: str | None, compiled):
        self.backend = backend
        self.special_tokens_map = special  # name -> token text, as transformers' (the template sees them)
        self.chat_template = chat_template
        self._compiled = compiled

    @classmethod
    def load(cls, folder: Path, config: dict | None = None) -> LightTokenizer | None:
        """The folder's tokenizer, or None where it must load through transformers (see the module);
        config: its generic_config, where the caller read it already."""
        config = config if config is not None else generic_config(folder)
        if config is None:
            return None
        try:
            readable, template = _chat_template(folder, config)
            if not readable:
                return None
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            if not _unchanged_by(config, backend):
                return None
            compiled = _compiled(template) if template is not None else None
        except Exception:  # noqa: BLE001 - unreadable files, no jinja2, a template it cannot compile: transformers'
            return None
        special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        return cls(backend, special, template, compiled)

    def _id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]  # (a tensor's elements too)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> str:
        """The conversation through the chat template, as text (`tokenize=False`: what rsd asks, encoding
        the text itself; transformers' tokenized forms differ between its versions, so none here)."""
        if tokenize:
            raise NotImplementedError("LightTokenizer.apply_chat_template gives text only: pass tokenize=False")
        if self._compiled is None:
            raise ValueError("this tokenizer has no chat template")
        return self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
