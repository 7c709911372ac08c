"""TOML profiles: the model pair, the variant and the sampling settings, with provenance.

Precedence: flags > environment (RSD_<TABLE>_<KEY>) > profile file > built-in defaults.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from .errors import RsdError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

VARIANTS = ("ar", "sd", "mss", "spectr", "rsd-c", "rsd-s", "lookup", "auto")


def _positive(v) -> str | None:
    return None if v >= 1 else "must be at least 1"


SEED_MAX = 2**63 - 1  # (torch takes seeds below 2^64; --samples adds the completion's index to it)


def _seed(v) -> str | None:
    return None if -1 <= v <= SEED_MAX else f"must be -1 (a fresh seed each time) or from 0 to {SEED_MAX}"


def _non_negative(v) -> str | None:
    return None if v >= 0 else "must be at least 0"


def _top_p(v) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _min_p(v) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _temperature(v) -> str | None:
    return None if 0 <= v < math.inf else "must be a finite number, at least 0"


def _penalty(v) -> str | None:
    return None if 0 < v < math.inf else "must be a finite number greater than 0"


def _finite(v) -> str | None:
    return None if math.isfinite(v) else "must be a finite number"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _branching(v) -> str | None:
    if not v:
        return "must list at least one branching factor"
    return None if all(b >= 1 for b in v) else "must list factors of at least 1"


def _logit_bias(v) -> str | None:
    """A table of token id = bias (OpenAI's logit_bias: ids as strings, a number each; -inf bars the token)."""
    for token, bias in v.items():
        if not str(token).isdecimal():
            return f"must have token ids as keys, like {{ 2 = -100 }}; {token!r} is not one"
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or bias == math.inf:
            return f"must give token {token} a number (-inf bars it; nan and inf are not biases)"
    return None


def _token_ids(v) -> str | None:
    return "must list token ids (at least 0)" if any(token < 0 for token in v) else None


def _stops(v) -> str | None:
    from .prompting import not_utf8_at

    if any(not text for text in v):
        return "must not contain an empty string"
    return "must be UTF-8 text" if any(not_utf8_at(text) is not None for text in v) else None


PLACEMENT_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE = re.compile(r"^(cpu|disk|mps|cuda(:\d+)?|\d+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_bytes(size: int | str) -> int | None:
    """A memory size ("70GiB", "500MB", "1.5 GB", or an integer of bytes) in bytes; None if malformed."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size if size > 0 else None
    match = _SIZE.match(size) if isinstance(size, str) else None
    if not match:
        return None
    value = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()]
    return int(value) if value >= 1 else None


DEVICES = "cpu, disk, cuda, cuda:N or a GPU index N"


def _target_device(v) -> str | None:
    """The one device a whole model sits on (a placement's devices: device_map)."""
    return None if re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) else 'must be "auto", "cpu", "cuda", "cuda:N" or "mps"'


def _known_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return device >= 0
    return isinstance(device, str) and bool(_DEVICE.match(device))


def _device_map(v) -> str | None:
    """"" (no placement: `device` holds the whole model), a strategy, one device, or a table of
    module name -> device."""
    if isinstance(v, str):
        if not v or v in PLACEMENT_STRATEGIES or (_known_device(v) and v != "disk"):
            return None
        return f"must be \"\", {', '.join(PLACEMENT_STRATEGIES)}, a device or a table of module = device"
    if not v:
        return "must name at least one module"
    for module, device in v.items():
        if not _known_device(device):
            return f"places {module or 'the whole model'!r} on an unknown device {device!r} (expected {DEVICES})"
    return None


def _max_memory(v) -> str | None:
    for device, size in v.items():
        if not _known_device(device):
            return f"names an unknown device {device!r} (expected {DEVICES})"
        if memory_bytes(size) is None:
            return f"has a malformed size for {device!r}: {size!r} (expected e.g. \"70GiB\", \"512MB\" or bytes)"
    return None


@dataclass(frozen=True)
class Key:
    type: type | tuple  # int, float, str, bool, list (of `item`), dict (a table) or (str, dict)
    default: Any
    check: Callable[[Any], str | None] | None = None
    help: str = ""
    item: type = int  # the type of a list's items


def _loading_keys(applies: str) -> dict[str, Key]:
    """How a model loads, for [target] and (kind = model) [draft]: trust_remote_code, and its placement
    (device_map, max_memory, offload_folder)."""
    return {
        "trust_remote_code": Key(bool, False, None, f"{applies}run the model's own Python code from its folder or "
                                 "hub repo (transformers' trust_remote_code): only for a model you trust"),
        "device_map": Key((str, dict), "", _device_map,
                          f'{applies}place the model over devices with accelerate: "auto", "balanced", "sequential", '
                          'or a table of module = device ("cpu", "disk", 0, "cuda:1"); "" = all on `device`'),
        "max_memory": Key(dict, {}, _max_memory, f'{applies}with device_map: memory per device, e.g. '
                          '{ 0 = "70GiB", cpu = "200GiB" } (a max_memory alone implies device_map = "auto")'),
        "offload_folder": Key(str, "", None, f"{applies}with device_map: where weights placed on \"disk\" go "
                              "(default: a temporary folder in rsd's cache)"),
    }


SCHEMA: dict[str, dict[str, Key]] = {
    "target": {
        "source": Key(str, "embedded", None, '"embedded", a model directory, a .gguf file, or a hub id'),
        "dtype": Key(str, "auto", _one_of("auto", "float32", "bfloat16", "float16"),
                     "auto (bfloat16 on CUDA, float32 elsewhere), float32, bfloat16 or float16"),
        "device": Key(str, "auto", _target_device, '"auto", "cpu", "cuda", "cuda:1", ... or "mps"'),
        **_loading_keys(""),
    },
    "draft": {
        "kind": Key(str, "early-exit", _one_of("early-exit", "model"),
                    '"early-exit": the target\'s first layers; "model": a separate model (source)'),
        "source": Key(str, "", None, "the draft model (kind = model): directory, .gguf or hub id"),
        "layers": Key(int, 3, _positive, "early-exit: how many of the target's first layers"),
        "adapter": Key(str, "auto", None,
                       'early-exit: "auto" (the shipped one if trained for this target), "embedded", a file, or ""'),
        "vocab": Key(int, 0, _non_negative, "early-exit: draft only among the first N token ids (0 = all)"),
        **_loading_keys("kind = model: "),
    },
    "decoding": {
        "variant": Key(str, "sd", _one_of(*VARIANTS), f"{', '.join(VARIANTS)}: how each step drafts (docs/variants.md)"),
        "draft_len": Key(int, 4, _positive, "sd: draft length γ; lookup: the most tokens drafted"),
        "ngram": Key(int, 3, _positive, "lookup: the longest n-gram of the context's end looked up (down to 1)"),
        "branching": Key(list, [2, 2, 1], _branching, "mss, rsd-c: branching factor per depth"),
        "beam_width": Key(int, 3, _positive, "rsd-s: beam width W"),
        "depth": Key(int, 4, _positive, "rsd-s, spectr: tree depth L"),
        "num_drafts": Key(int, 3, _positive, "spectr: number of draft sequences K"),
        "budget": Key(int, 0, _non_negative, "if > 0: pick a tree of at most this many nodes"),
    },
    "runtime": {
        "compile": Key(str, "auto", _one_of("auto", "on", "off"),
                       'the static-cache runtime: "on" compiled, "auto" compiled where measured 20% faster, '
                       '"off" transformers\' eager forward'),
    },
    "sampling": {
        "temperature": Key(float, 1.0, _temperature, "0 is greedy"),
        "top_p": Key(float, 1.0, _top_p, "keep the likeliest tokens whose probabilities add up to top_p; 1 disables"),
        "top_k": Key(int, 0, _non_negative, "0 disables"),
        "min_p": Key(float, 0.0, _min_p, "drop tokens below min_p x the likeliest one's probability; 0 disables"),
        "repetition_penalty": Key(float, 1.0, _penalty, "> 1 discourages tokens already in the context; 1 disables"),
        "presence_penalty": Key(float, 0.0, _finite, "subtracted from the logit of every token in the answer so "
                                "far; 0 disables"),
        "frequency_penalty": Key(float, 0.0, _finite, "subtracted from a token's logit once per time it is in the "
                                 "answer so far; 0 disables"),
        "logit_bias": Key(dict, {}, _logit_bias, 'added to the logits of the tokens named: a table of token id = '
                          'bias, e.g. { 2 = -100, 13 = 5 } (-inf bars the token)'),
        "min_tokens": Key(int, 0, _non_negative, "the answer does not end at an end-of-sequence token or a stop "
                          "string before this many tokens"),
        "max_tokens": Key(int, 256, _positive, "the most tokens an answer takes"),
        "seed": Key(int, -1, _seed, "-1 draws a fresh seed"),
        "stop": Key(list, [], _stops, "end the answer at the first of these strings (not printed unless "
                    "include_stop)", item=str),
        "include_stop": Key(bool, False, None, "print the stop string that ended the answer too (vLLM's "
                            "include_stop_str_in_output)"),
        "stop_tokens": Key(list, [], _token_ids, "end the answer at any of these token ids too, as at an "
                           "end-of-sequence token (its text kept unless special)"),
    },
}
TOP_LEVEL_KEYS = {"description": str}


# the settings that name a file or folder, and the words they take that name none
PATH_KEYS = {("target", "source"), ("target", "offload_folder"), ("draft", "source"), ("draft", "adapter"),
             ("draft", "offload_folder")}
PATH_WORDS = ("", "auto", "embedded")


def toml_value(value) -> str:
    """A value as a TOML line writes it (tables inline: { 0 = "70GiB", cpu = "200GiB" })."""
    if isinstance(value, dict):
        bare = lambda key: key if key and all(c.isalnum() or c in "-_" for c in key) else json.dumps(key)  # noqa: E731
        return "{ " + ", ".join(f"{bare(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, float) and not math.isfinite(value):  # (TOML's inf and -inf, where JSON has none)
        return str(value)
    return json.dumps(value)  # (non-ASCII as \u escapes, which TOML reads alike: no text a terminal cannot print)


def profile_file_text(profile: "Profile", header: str) -> str:
    """A profile file holding every setting of `profile`, each after a comment saying what it does, and
    its relative paths made absolute (the file may live in another folder): `rsd profiles new`."""
    lines = [f"# {header}", "# `rsd profiles show NAME` gives where each value comes from; a setting left out takes "
             "its default", f"description = {toml_value(profile.description)}"]
    for table, keys in SCHEMA.items():
        lines += ["", f"[{table}]"]
        for key, spec in keys.items():
            value = profile.values[table][key]
            if (table, key) in PATH_KEYS and value not in PATH_WORDS:
                value = profile.resolve_path(value)
            lines += [f"# {line}" for line in textwrap.wrap(spec.help, 98)]
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def config_dir() -> Path:
    if os.environ.get("RSD_CONFIG_DIR"):
        return Path(os.environ["RSD_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "rsd"


def user_profiles_dir() -> Path:
    return config_dir() / "profiles"


def builtin_profiles() -> dict[str, Path]:
    folder = resources.files("rsd_cli") / "profiles"
    return {Path(f.name).stem: Path(str(f)) for f in folder.iterdir() if f.name.endswith(".toml")}


def available_profiles() -> dict[str, tuple[Path, str]]:
    """name -> (file, "built-in" | "user"); user profiles shadow built-in ones."""
    found = {name: (path, "built-in") for name, path in builtin_profiles().items()}
    folder = user_profiles_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.toml")):
            found[path.stem] = (path, "user")
    return found


@dataclass
class Profile:
    name: str
    path: Path | None
    description: str = ""
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    origins: dict[str, dict[str, str]] = field(default_factory=dict)

    def __getitem__(self, table: str) -> dict[str, Any]:
        return self.values[table]

    def set(self, table: str, key: str, value: Any, origin: str) -> None:
        """Override one value (from a flag, say), validated like a profile entry."""
        value = _coerce(SCHEMA[table][key], value, f"{origin}: {table}.{key}")
        self.values[table][key] = value
        self.origins[table][key] = origin

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    def resolve_path(self, value: str) -> str:
        """A file path in a profile: `~` is the home folder (no shell expands it in TOML), and a relative
        path is relative to the profile's folder where it exists there (else as given: a hub id)."""
        if value.startswith("~"):
            return str(Path(value).expanduser())
        if value and not Path(value).is_absolute() and (self.base_dir / value).exists():
            return str(self.base_dir / value)
        return value


def _coerce(key: Key, value: Any, where: str) -> Any:
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key.type is list and isinstance(value, key.item) and not isinstance(value, bool):  # one item alone:
        value = [value]  # `stop = "\n\n"` (as its environment variable takes it), `stop_tokens = 198`
    ok = isinstance(value, key.type) and (key.type is bool or not isinstance(value, bool))
    if key.type is list:
        ok = isinstance(value, list) and all(isinstance(v, key.item) and not isinstance(v, bool) for v in value)
    if not ok:
        expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table",
                    (str, dict): "a string or a table",
                    list: f"a list of {'strings' if key.item is str else 'integers'}"}[key.type]
        raise RsdError(f"{where} must be {expected}, got {value!r}")
    problem = key.check(value) if key.check else None
    if problem:
        raise RsdError(f"{where} {problem} (got {value!r})")
    return value


EMPTY_ITEM = "an empty item"


def got(text: str, error: ValueError) -> str:
    """What an error about a value says it got, and why where list_items refused it: '2,,3': an empty item."""
    return f"{text!r}: {EMPTY_ITEM}" if str(error) == EMPTY_ITEM else repr(text)


def list_items(text: str) -> list[str]:
    """"3,2,2", "3 2 2" or "3, 2, 2" -> ["3", "2", "2"]; "" or "," -> []. ValueError at an empty item beside
    others ("3,,2", ",3", "3,"): a slip that, read as nothing, would quietly change what was asked for."""
    parts = [part.split() for part in text.split(",")]
    if any(parts) and not all(parts):
        raise ValueError(EMPTY_ITEM)
    return [item for part in parts for item in part]


def parse_bool(raw: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case) -> bool; ValueError otherwise."""
    answer = {"true": True, "1": True, "yes": True, "on": True,
              "false": False, "0": False, "no": False, "off": False}.get(raw.strip().lower())
    if answer is None:
        raise ValueError(raw)
    return answer


def _parse_env(key: Key, raw: str, where: str) -> Any:
    try:
        if key.type is bool:
            return parse_bool(raw)
        if key.type is int:
            return int(raw)
        if key.type is float:
            return float(raw)
        if key.type is list and key.item is str:  # a JSON list, or one string
            return json.loads(raw) if raw.lstrip().startswith("[") else [raw]
        if key.type in (dict, (str, dict)):  # a table as a JSON object (or, where allowed, a string)
            if raw.lstrip().startswith("{") or key.type is dict:
                table = json.loads(raw)
                if not isinstance(table, dict):  # (valid JSON of another kind: RSD_SAMPLING_LOGIT_BIAS=5)
                    raise ValueError(raw)
                return table
        if key.type is list:
            return [int(x) for x in list_items(raw)]
    except ValueError as error:  # json.JSONDecodeError is one
        expected = {float: "a number", bool: "true or false", list: "a JSON list" if key.item is str else "integers",
                    dict: "a JSON object", (str, dict): "a string or a JSON object"}.get(key.type, "an integer")
        raise RsdError(f"{where} must be {expected}, got {got(raw, error)}") from None
    return raw


def find_profile(name_or_path: str) -> tuple[str, Path]:
    candidate = Path(name_or_path).expanduser()
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not candidate.is_file():
            raise RsdError(f"profile file not found: {candidate}")
        return candidate.stem, candidate
    profiles = available_profiles()
    if name_or_path not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise RsdError(f"no profile named {name_or_path!r} (known: {known}; user profiles live in {user_profiles_dir()})")
    return name_or_path, profiles[name_or_path][0]


def _env_name(table: str, key: str = "") -> str:
    """The environment variable of a setting (RSD_SAMPLING_TEMPERATURE), or with no key its table's prefix."""
    return f"RSD_{table}_{key}".upper()


def _check_environment(environ) -> None:
    """A variable named like a setting (RSD_<TABLE>_<KEY>) that is none — RSD_SAMPLING_TEMPRATURE, or
    RSD_TEMPERATURE, its table left out — is refused as a profile's unknown key is, naming the setting
    meant where one is close: read as nothing, it would leave the answer to a setting the user meant to
    change."""
    for name in sorted(environ):
        table = next((t for t in SCHEMA if name.startswith(_env_name(t))), None)
        if table is None:
            bare = name.removeprefix("RSD_").lower() if name.startswith("RSD_") else None
            homes = [_env_name(t, bare) for t in SCHEMA if bare in SCHEMA[t]]  # (RSD_TEMPERATURE: the table left out)
            if homes:
                raise RsdError(f"environment variable {name} is not a setting (did you mean {' or '.join(homes)}?)")
            continue
        key = name[len(_env_name(table)):].lower()
        if key in SCHEMA[table]:
            continue
        elsewhere = [t for t in SCHEMA if key in SCHEMA[t]]  # (a key of another table: RSD_SAMPLING_VARIANT)
        meant = [_env_name(t, key) for t in elsewhere] or \
            [_env_name(table, k) for k in difflib.get_close_matches(key, SCHEMA[table], n=1, cutoff=0.6)]
        known = ", ".join(_env_name(table, k) for k in SCHEMA[table])
        raise RsdError(f"environment variable {name} is not a setting ("
                       + (f"did you mean {meant[0]}?" if meant else f"[{table}] takes {known}") + ")")


def _meant_key(table: str | None, key: str) -> str:
    """What a profile's unknown key (in `table`, or at the top level: None) was likely meant to be: a
    setting of another table (`[sampling] variant`: decoding.variant), a close spelling of one of this
    table's (`temprature`) or of a table (`[sampler]`), else the keys it takes."""
    elsewhere = [other for other, keys in SCHEMA.items() if other != table and key in keys]
    if elsewhere:
        return "it belongs in " + " or ".join(f"[{other}]: {other}.{key}" for other in elsewhere)
    names = list(SCHEMA[table]) if table else list(SCHEMA)
    meant = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if meant:
        return f"did you mean {table + '.' if table else '['}{meant[0]}{'' if table else ']'}?"
    return f"known: {', '.join(names)}" if table else f"expected tables: {', '.join(SCHEMA)}"


def load_profile(name_or_path: str | None = None, environ: dict[str, str] | None = None) -> Profile:
    environ = os.environ if environ is None else environ
    name, path = find_profile(name_or_path or environ.get("RSD_PROFILE") or "default")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RsdError(f"{path}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RsdError(f"{path}: cannot read: {e}") from None

    _check_environment(environ)
    profile = Profile(name, path)
    for key, value in data.items():
        if key in SCHEMA:
            if not isinstance(value, dict):
                raise RsdError(f"{path}: [{key}] must be a table")
        elif key in TOP_LEVEL_KEYS:
            if not isinstance(value, str):
                raise RsdError(f"{path}: {key} must be a string")
            profile.description = value
        else:
            raise RsdError(f"{path}: unknown key {key!r} ({_meant_key(None, key)})")
    for table, keys in SCHEMA.items():
        given = data.get(table, {})
        for key in given:
            if key not in keys:
                raise RsdError(f"{path}: unknown key {table}.{key} ({_meant_key(table, key)})")
        profile.values[table], profile.origins[table] = {}, {}
        for key, spec in keys.items():
            env_name = _env_name(table, key)
            if env_name in environ:
                where = f"environment variable {env_name}"
                value, origin = _coerce(spec, _parse_env(spec, environ[env_name], where), where), f"env {env_name}"
            elif key in given:
                value, origin = _coerce(spec, given[key], f"{path}: {table}.{key}"), str(path)
            else:
                value, origin = spec.default, "default"
            profile.values[table][key] = value
            profile.origins[table][key] = origin
    return profile
