"""From a profile (plus flag overrides) to a ready decoder: the glue every command shares."""

from __future__ import annotations

from typing import Any

from .drafting import Shape, make_shape, shape_for_budget
from .errors import RsdError, UsageError
from .profiles import SCHEMA, Profile, got, list_items
from .prompting import counted

# flag name -> (table, key)
FLAG_KEYS = {
    "variant": ("decoding", "variant"),
    "draft_len": ("decoding", "draft_len"),
    "ngram": ("decoding", "ngram"),
    "branching": ("decoding", "branching"),
    "beam_width": ("decoding", "beam_width"),
    "depth": ("decoding", "depth"),
    "num_drafts": ("decoding", "num_drafts"),
    "budget": ("decoding", "budget"),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "top_k": ("sampling", "top_k"),
    "min_p": ("sampling", "min_p"),
    "repetition_penalty": ("sampling", "repetition_penalty"),
    "presence_penalty": ("sampling", "presence_penalty"),
    "frequency_penalty": ("sampling", "frequency_penalty"),
    "logit_bias": ("sampling", "logit_bias"),
    "min_tokens": ("sampling", "min_tokens"),
    "max_tokens": ("sampling", "max_tokens"),
    "seed": ("sampling", "seed"),
    "compile": ("runtime", "compile"),
    "stop": ("sampling", "stop"),
    "stop_token": ("sampling", "stop_tokens"),
    "include_stop": ("sampling", "include_stop"),
}


def branching_factors(text: str) -> list[int]:
    """"3,2,2" -> [3, 2, 2] (ValueError where a part is not an integer or is empty: "3,,2")."""
    return [int(part) for part in list_items(text)]


def parse_branching(text: str) -> list[int]:
    try:
        return branching_factors(text)
    except ValueError as error:
        raise UsageError(f"--branching takes integers separated by commas, like 3,2,2 (got {got(text, error)})") from None


def parse_logit_bias(entries: list[str], name: str = "--logit-bias") -> dict[str, float]:
    """["2=-100", "13=5"] -> {"2": -100.0, "13": 5.0} (a profile's table: ids as keys); later entries win."""
    table = {}
    for entry in entries:
        token, _, bias = entry.replace(" ", "").partition("=")
        try:
            if not token.isdecimal():
                raise ValueError(token)
            table[str(int(token))] = float(bias)
        except ValueError:
            raise UsageError(f"{name} takes TOKEN_ID=BIAS, like 2=-100 or 13=5 (-inf bars the token; "
                             f"got {entry!r})") from None
    return table


def apply_flags(profile: Profile, flags: dict[str, Any]) -> Profile:
    """Flags override the profile; None means 'not given'. A value out of its range is a usage
    error (exit 2), as a value of the wrong type is for Typer. --ignore-eos (ignore_eos: True)
    makes min_tokens the answer's most tokens."""
    flags = dict(flags)
    ignore_eos = flags.pop("ignore_eos", False)
    for name, value in flags.items():
        if value is None or name in ("stop", "stop_token", "logit_bias") and not value:  # (a repeatable option
            continue  # not given is [])
        if name in ("stop", "stop_token"):
            value = list(value)
        if name == "logit_bias":
            value = parse_logit_bias(value)
        table, key = FLAG_KEYS[name]
        if name == "branching" and isinstance(value, str):
            value = parse_branching(value)
        if name == "compile" and value not in ("auto", "on", "off"):
            raise UsageError(f"--compile takes auto, on or off (got {value!r})")
        if name == "budget" and value < 1:  # in a profile 0 means "off"; a flag asks for a tree
            raise UsageError(f"--budget {value}: the budget must be at least 1 (the root of the tree)")
        try:
            profile.set(table, key, value, f"flag --{name.replace('_', '-')}")
        except RsdError as e:
            raise UsageError(str(e)) from None
    if ignore_eos:  # (the end-of-sequence tokens barred throughout, as llama.cpp's and vLLM's --ignore-eos)
        profile.set("sampling", "min_tokens", profile["sampling"]["max_tokens"], "flag --ignore-eos")
    return profile


def _set_where(profile: Profile, key: str) -> str:
    """Where a sampling setting was set, as a note says it after the value (` (flag --min-tokens)`);
    nothing for its default."""
    origin = profile.origins.get("sampling", {}).get(key, "default")
    return f" ({origin})" if origin != "default" else ""


def unreachable_min_tokens(profile: Profile) -> str | None:
    """One line where min_tokens is above max_tokens (each answer then stops at max_tokens, its
    end-of-sequence tokens and stop strings barred throughout, which the user may not expect); else None.
    --ignore-eos sets min_tokens to max_tokens: not above."""
    least, most = profile["sampling"]["min_tokens"], profile["sampling"]["max_tokens"]
    if least <= most:
        return None
    return (f"min_tokens {least}{_set_where(profile, 'min_tokens')} is above max_tokens {most}"
            f"{_set_where(profile, 'max_tokens')}: every answer runs to {counted(most, 'token')} (no end-of-sequence "
            f"token or stop string ends it earlier)")


def idle_include_stop(profile: Profile, how: str = "--stop") -> str | None:
    """One line where include_stop is on without a stop string (`how` sets one): it applies to the
    user's stop strings only (not end-of-sequence or stop tokens, nor chat's own end of a base model's
    turn), so it then changes nothing; else None."""
    if not profile["sampling"]["include_stop"] or profile["sampling"]["stop"]:
        return None
    return f"include_stop{_set_where(profile, 'include_stop')} changes nothing without a stop string ({how})"


# the tree settings (FLAG_KEYS' names) each variant's shape reads (shape_of); a profile may hold others for
# other variants, but a flag or a /set of one the variant does not read changes nothing
SHAPE_SETTINGS = {"ar": (), "sd": ("draft_len", "budget"), "lookup": ("draft_len", "ngram", "budget"),
                  "mss": ("branching", "budget"), "rsd-c": ("branching", "budget"),
                  "rsd-s": ("beam_width", "depth", "budget"), "spectr": ("num_drafts", "depth", "budget"),
                  "auto": ("budget",)}
TREE_SETTINGS = ("draft_len", "ngram", "branching", "beam_width", "depth", "num_drafts", "budget")


def unread_settings(variant: str, budget: int, given, spell=lambda name: f"--{name.replace('_', '-')}") -> str | None:
    """Where some of the tree settings `given` (names) change nothing — another variant's, or with a
    budget (which picks the tree: shape_for_budget) any but the budget and lookup's n-gram — one line
    naming them and what sets `variant`'s tree (spell: how a setting is written, a flag by default);
    else None."""
    reads = SHAPE_SETTINGS[variant]
    picked = bool(budget) and variant != "ar"
    if picked:
        reads = tuple(name for name in reads if name in ("budget", "ngram"))
    unread = [name for name in dict.fromkeys(given) if name in TREE_SETTINGS and name not in reads]
    if not unread:
        return None
    names = ", ".join(spell(name) for name in unread)
    if picked:
        why = f"a budget of {counted(budget, 'node')} picks its tree"
    elif variant == "ar":
        why = "it drafts no tree"
    elif variant == "auto":
        why = f"it picks its own shapes ({spell('budget')} caps them)"
    else:
        why = f"its tree is set by {' and '.join(spell(name) for name in SHAPE_SETTINGS[variant])}"
    return f"{names} {'changes' if len(unread) == 1 else 'change'} nothing for {variant}: {why}"


def shape_of(profile: Profile, vocab_size: int | None = None, context_length: int | None = None) -> Shape:
    """The profile's tree shape; with the models' vocabulary and context, one they can take (a
    setting given by a flag that they cannot: a usage error naming it, as setting_error says)."""
    d = profile["decoding"]
    variant = d["variant"]
    if d["budget"]:
        shape = shape_for_budget(variant, d["budget"], d["ngram"])
    else:
        shape = make_shape(variant, draft_len=d["draft_len"], branching=tuple(d["branching"]),
                           beam_width=d["beam_width"], depth=d["depth"], num_drafts=d["num_drafts"],
                           ngram=d["ngram"])
    if vocab_size is not None and (wide := wider_than_the_vocabulary(shape, vocab_size)):
        key = "budget" if d["budget"] else "beam_width" if variant == "rsd-s" else "branching"
        raise setting_error(profile, "decoding", key, wide)
    if (variant != "auto" or d["budget"]) and (
            large := larger_than_the_context(shape, context_length, shape.max_nodes if d["budget"] else None)):
        raise setting_error(profile, "decoding", _tree_key(profile), large)
    return shape


def wider_than_the_vocabulary(shape: Shape, vocab_size: int) -> str | None:
    """Why the models cannot take the shape's width, or None: rsd-c and rsd-s draw a node's children
    (a beam) without replacement, so never more of them than there are tokens (mss and spectr draw with
    replacement and take any width)."""
    if shape.variant not in ("rsd-c", "rsd-s"):
        return None
    widest = max(shape.branching, default=1) if shape.variant == "rsd-c" else shape.width
    what = "beam width" if shape.variant == "rsd-s" else "branching factor"
    return f"{what} {widest} is larger than the vocabulary ({vocab_size} tokens)" if widest > vocab_size else None


def _tree_key(profile: Profile) -> str:
    """The decoding setting that sets the profile's tree: its budget, else the variant's first tree
    setting a flag (or /set) gave, else its first (what setting_error names, and exits by)."""
    d = profile["decoding"]
    if d["budget"]:
        return "budget"
    keys = [key for key in SHAPE_SETTINGS[d["variant"]] if key not in ("budget", "ngram")]
    given = [key for key in keys if profile.origins["decoding"][key] != "default"]
    flagged = [key for key in given if profile.origins["decoding"][key].startswith("flag ")]
    return (flagged or given or keys)[0]


def larger_than_the_context(shape: Shape, context_length: int | None, budget: int | None = None) -> str | None:
    """Why a tree of more nodes than the target's context is refused, or None: a step verifies its whole
    tree in one forward (`--branching 40,40,40`, 65641 nodes on a 40-token vocabulary, filled 24 GB and
    was killed; 8191 nodes of the embedded pair took 65 s and 5.8 GB a step). budget: the tree is said
    as the budget of that many nodes that set it."""
    if not context_length or shape.max_nodes <= context_length:
        return None
    what = (f"a budget of {budget} nodes" if budget is not None
            else f"{shape.describe()} drafts trees of up to {shape.max_nodes} nodes, which")
    return (f"{what} is more than the target's context ({context_length} tokens): a step verifies its whole tree "
            f"in one forward")


def sampling_of(profile: Profile):
    from .sampling import SamplingParams

    s = profile["sampling"]
    bias = tuple(sorted((int(token), float(value)) for token, value in s["logit_bias"].items()))
    return SamplingParams(s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["repetition_penalty"],
                          s["presence_penalty"], s["frequency_penalty"], bias, s["min_tokens"])


def setting_error(profile: Profile, table: str, key: str, message: str) -> RsdError:
    """A setting the models refuse: a usage error (exit 2) saying which flag where a flag gave it, as a
    value out of its range is (apply_flags); else a runtime error, saying which profile file (or
    environment variable) and entry gave it, as a profile's value out of its range is (Profile.set)."""
    origin = profile.origins[table][key]
    if origin.startswith("flag "):
        return UsageError(f"{origin}: {message}")
    return RsdError(message if origin in ("default", "/set") else f"{origin}: {table}.{key}: {message}")


def ends_of(pair, profile: Profile) -> set[int]:
    """The tokens that end an answer: the models' end-of-sequence tokens and the profile's stop tokens
    (sampling.stop_tokens, --stop-token), which must be in the models' vocabulary."""
    stops = profile["sampling"]["stop_tokens"]
    beyond = [token for token in stops if token >= pair.vocab_size]
    if beyond:
        raise setting_error(profile, "sampling", "stop_tokens",
                            f"stop token id {beyond[0]} is beyond the models' vocabulary ({pair.vocab_size} tokens)")
    return set(pair.eos_ids) | set(stops)


def seed_of(profile: Profile) -> int | None:
    seed = profile["sampling"]["seed"]
    return None if seed < 0 else seed


def make_decoder(pair, profile: Profile):
    from .drafting import make_shape
    from .engine import Decoder, logit_bias_beyond

    sampling = sampling_of(profile)
    if beyond := logit_bias_beyond(sampling, pair.vocab_size):
        raise setting_error(profile, "sampling", "logit_bias", beyond)
    shape = shape_of(profile, pair.vocab_size, pair.context_length)
    decoder = Decoder(pair.target, pair.draft, pair.vocab_size, shape, sampling, ends_of(pair, profile),
                      pair.context_length, pair.runtimes, pair.notice)
    if not decoder.takes(decoder.shape.variant) and profile.origins["decoding"]["variant"] == "default":
        decoder.shape = make_shape("auto")  # the best of what these models run, where no variant was chosen (one
        # asked for is refused: Decoder.check_shape)
    return decoder


def runtimes_of(pair, setting: str, progress=lambda message: None, notice=lambda message: None, fixed=None):
    """The execution of both models for a --compile setting (see compiled.runtime_for; fixed: the Shape
    of every step of the run, where it has one); an early-exit draft shares its target's layers, so it
    shares the verdict and compiled graphs."""
    from .compiled import runtime_for
    from .engine import Runtimes

    target = runtime_for(pair.target, setting, "target", progress, notice, fixed)
    draft = runtime_for(pair.draft, setting, "draft", progress, notice, fixed)
    return Runtimes(target, draft, setting)


def resolved(profile: Profile) -> list[tuple[str, str, Any, str]]:
    """(table, key, value, origin) for every setting, in schema order."""
    return [(t, k, profile.values[t][k], profile.origins[t][k]) for t in SCHEMA for k in SCHEMA[t]]
