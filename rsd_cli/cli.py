"""The `rsd` command line (Typer). Heavy imports happen inside commands so --help is instant."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer carries its own copy of click since 0.2x; before, it used click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - an older typer
    from click import exceptions as click_errors

from .cache import PART_NAMES  # (a light module: --help and completions stay instant)
from .errors import RsdError, UsageError


def _one_line(usage_error):
    """Click's usage errors (an unknown flag or command, a value of the wrong type, a missing
    argument) as rsd's own: one line on stderr and exit code 2, instead of a framed box under the
    usage. (Asking for nothing, as `rsd` alone does, still shows the help.)"""
    if isinstance(usage_error, getattr(click_errors, "NoArgsIsHelpError", ())):
        raise usage_error
    param = getattr(usage_error, "param", None)
    if getattr(param, "param_type_name", None) == "argument" and usage_error.param_hint is None:
        usage_error.param_hint = f"'{param.name.upper()}'"  # (as the help names it: PROMPT, not 'prompt')
    where = f" (see '{usage_error.ctx.command_path} -h')" if usage_error.ctx is not None else ""
    message = _value_error(param, usage_error.__cause__) or usage_error.format_message().removesuffix(".")
    error(message + where)  # (click's "No such command 'x'.")
    raise typer.Exit(2)


# pydantic's checks that Typer 0.2x reads values with -> how rsd says what the value should be
VALUE_CHECKS = {"int_parsing": "takes an integer", "float_parsing": "takes a number",
                "greater_than_equal": "must be at least {ge}", "less_than_equal": "must be at most {le}",
                "greater_than": "must be more than {gt}", "less_than": "must be less than {lt}"}


def _value_error(param, cause) -> str | None:
    """An option's value refused by Typer's pydantic checks, said as rsd says its own ("--max-tokens
    takes an integer (got 'abc')", "--samples must be at least 1 (got 0)"), not as pydantic does
    ("Invalid value for '--max-tokens' / '-n': Input should be a valid integer, unable to parse string
    as an integer"); None for any other error (click's own words, from Typers before pydantic, kept)."""
    errors = cause.errors() if callable(getattr(cause, "errors", None)) else []
    if not errors or errors[0].get("type") not in VALUE_CHECKS or getattr(param, "param_type_name", "") != "option":
        return None
    first = errors[0]
    given = first.get("input")
    shown = repr(given) if first["type"].endswith("_parsing") else given
    return f"{max(param.opts, key=len)} {VALUE_CHECKS[first['type']].format(**first.get('ctx', {}))} (got {shown})"


class OneLineUsage:
    """A command whose command line's errors are one line (_one_line)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click_errors.UsageError as e:
            _one_line(e)


HELP_TYPE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH"}


def _help_type(param, ctx) -> dict:
    """What the help shows of a parameter, as a command line reads it: nothing beside a flag (Typer
    0.29 shows `--raw <bool>`, as if it took a value), TEXT, INTEGER, FLOAT or PATH beside the others
    (not `<list[str]>` or `<int range>`: a repeatable option says so in its help), an argument by its
    name in capitals (`rsd generate [OPTIONS] [PROMPT]`, `rsd tokenize [OPTIONS] TEXT`, as the commands'
    help names it), and no range whose bound is past 2^31 (`--seed`'s 2^63 - 1: its error names the
    range). Returns the parameter's attributes to set while the help is written (Typers before 0.2x,
    without `display_type`, show click's TEXT and INTEGER already: nothing)."""
    if not hasattr(param, "display_type") or param.metavar is not None:
        return {}
    if getattr(param, "is_flag", False):
        return {"metavar": ""}
    label = param.display_type(ctx).strip("<>").removesuffix(" range")
    if label.startswith("list[") and label.endswith("]"):
        label = label[len("list["):-1]
    label = HELP_TYPE_NAMES.get(label, label.upper())
    if param.param_type_name == "argument":  # (its usage PROMPT, or [PROMPT]: Typer 0.29 wrote {PROMPT})
        usage = param.name.upper() if param.required else f"[{param.name.upper()}]"
        usage += "..." if param.nargs != 1 else ""
        return {"metavar": param.name.upper(), "display_type_rich": lambda ctx: label,
                "_usage_display_name": lambda: usage}
    shown = {"metavar": label}
    if any(isinstance(bound, (int, float)) and abs(bound) > 2**31
           for bound in (getattr(param, "min", None), getattr(param, "max", None))):
        shown["_get_number_range_help_str"] = lambda: None
    return shown


MISSING = object()


class HelpTypes:
    """A command or group whose help shows its parameters as _help_type says (only while the help is
    written: an error's wording keeps click's names)."""

    def format_help(self, ctx, formatter):
        changed = [(param, _help_type(param, ctx)) for param in self.get_params(ctx)]
        saved = [(param, {name: param.__dict__.get(name, MISSING) for name in shown}) for param, shown in changed]
        for param, shown in changed:
            param.__dict__.update(shown)
        try:
            return super().format_help(ctx, formatter)
        finally:
            for param, before in saved:
                for name, value in before.items():
                    if value is MISSING:
                        del param.__dict__[name]
                    else:
                        param.__dict__[name] = value


class Command(OneLineUsage, HelpTypes, TyperCommand):
    pass


class Group(OneLineUsage, HelpTypes, TyperGroup):
    def resolve_command(self, ctx, args):  # (an unknown command)
        try:
            return super().resolve_command(ctx, args)
        except click_errors.UsageError as e:
            _one_line(e)


app = typer.Typer(
    name="rsd",
    cls=Group,
    help="Faster text generation with Recursive Speculative Decoding: a draft model proposes a "
    "tree of tokens, the target verifies it in one pass, the output stays exactly the target's.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich",
)
profiles_app = typer.Typer(help="List, inspect and make profiles.", no_args_is_help=True, cls=Group,
                           context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(profiles_app, name="profiles")
cache_app = typer.Typer(help="What rsd keeps in its cache folder, and clearing it.", cls=Group,
                        invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(cache_app, name="cache")

SAMPLING, DRAFT, OUTPUT = "Sampling", "Draft", "Output"
ENDING = "Length and stops"  # (apart from Sampling: --include-stop's --no- column there cut --repetition-penalty
# to "--repetition-pena…" at 80 columns)


def _print_version(asked: bool) -> None:
    if asked:
        from . import __version__

        typer.echo(f"rsd {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                   help="Print rsd's version and exit.")] = False) -> None:
    """(rsd's own options, before a command: --version)"""


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    sys.stderr.write(f"rsd: error: {message}\n")
    sys.stderr.flush()


def cli_errors(fn):
    """Turn failures into one clear line and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            error(str(e))
            raise typer.Exit(2) from None
        except RsdError as e:
            error(str(e))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            from . import errors

            if errors.ending_signal is not None:
                sys.stderr.write(f"\nrsd: {errors.ended_by()}\n")
                raise typer.Exit(128 + errors.ending_signal) from None
            sys.stderr.write("\nrsd: interrupted\n")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(0) from None
        except typer.Exit:
            raise
        except Exception as e:
            if os.environ.get("RSD_DEBUG") == "1":
                raise
            if isinstance(e, OSError) and e.strerror:  # (a cache folder that cannot be made, a full disk)
                error(_os_error_line(e))
            else:
                error(f"{type(e).__name__}: {e} (set RSD_DEBUG=1 for the traceback)")
            raise typer.Exit(1) from None

    return wrapper


def _os_error_line(e: OSError) -> str:
    """An operating system's refusal as one line: its reason, the path, and where the path is in rsd's
    cache folder (RSD_CACHE_DIR), which folder to change."""
    from .models import cache_dir

    path = e.filename if e.filename is not None else ""
    line = f"{e.strerror}: {path}" if path else e.strerror
    cache = cache_dir()
    if path and (Path(path) == cache or cache in Path(path).parents):
        line += f" (in rsd's cache folder {cache}: set RSD_CACHE_DIR to a writable folder)"
    return line


def _silence_stdout() -> None:
    """After `| head` closed the pipe: point stdout at /dev/null so exit stays quiet."""
    from .errors import point_at_null

    try:
        point_at_null(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def notice(message: str) -> None:
    """One line on stderr that the user should see once (a first compile, a setting that cannot apply)."""
    sys.stderr.write(f"rsd: {message}\n")
    sys.stderr.flush()


def complete_profile(incomplete: str) -> list[str]:
    from .profiles import available_profiles

    try:
        return [name for name in sorted(available_profiles()) if name.startswith(incomplete)]
    except Exception:
        return []


ProfileOpt = Annotated[Optional[str], typer.Option("--profile", "-p", help="Profile name or path to a .toml file.",
                                                   autocompletion=complete_profile, show_default=False)]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.", show_default=False)]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")]
VariantOpt = Annotated[Optional[str], typer.Option("--variant", "-v", help="ar, sd, mss, spectr, rsd-c, rsd-s, lookup "
                                                   "(drafts from the context, no model), or auto (the shape that pays "
                                                   "most here, re-chosen as it goes).",
                                                   rich_help_panel=DRAFT, show_default=False)]
TemperatureOpt = Annotated[Optional[float], typer.Option("--temperature", "-t", help="0 is greedy.",
                                                         rich_help_panel=SAMPLING, show_default=False)]
BENCH_VARIANTS = "ar,sd,mss,spectr,rsd-c,rsd-s,lookup,auto"
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="Keep the likeliest tokens whose probabilities add "
                                                 "up to P (1 disables).", rich_help_panel=SAMPLING,
                                                 show_default=False)]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="Keep the K likeliest tokens (0 disables).",
                                                rich_help_panel=SAMPLING, show_default=False)]
MinPOpt = Annotated[Optional[float], typer.Option("--min-p", help="Drop tokens below this fraction of the likeliest "
                                                 "one's probability (0 disables).", rich_help_panel=SAMPLING,
                                                 show_default=False)]
RepetitionPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--repetition-penalty", help="> 1 discourages tokens already in the context (1 disables).",
    rich_help_panel=SAMPLING, show_default=False)]
PresencePenaltyOpt = Annotated[Optional[float], typer.Option(
    "--presence-penalty", help="Subtracted from the logit of every token in the answer so far (0 disables).",
    rich_help_panel=SAMPLING, show_default=False)]
FrequencyPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--frequency-penalty", help="Subtracted from a token's logit once per time it is in the answer so far "
    "(0 disables).",
    rich_help_panel=SAMPLING, show_default=False)]
LogitBiasOpt = Annotated[Optional[list[str]], typer.Option(
    "--logit-bias", help="TOKEN_ID=BIAS: added to that token's logit, e.g. 2=-100 (-inf bars the token); "
    "repeatable.", rich_help_panel=SAMPLING, show_default=False)]
MinTokensOpt = Annotated[Optional[int], typer.Option(
    "--min-tokens", help="The answer does not end at an end-of-sequence token or a stop string before this many "
    "tokens (0 disables).", rich_help_panel=ENDING, show_default=False)]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos", help="Never end at an end-of-sequence token: answers run to --max-tokens (or a stop string).",
    rich_help_panel=ENDING)]
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="The most tokens an answer takes.",
                                                     rich_help_panel=ENDING, show_default=False)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="The same tokens again with a fixed --variant (with auto, "
                                                "which picks shapes by timing, the same distribution); -1 draws a "
                                                "fresh one each run.",
                                                rich_help_panel=SAMPLING, show_default=False)]
DraftLenOpt = Annotated[Optional[int], typer.Option("--draft-len", help="sd: draft length γ; lookup: at most γ tokens.",
                                                    rich_help_panel=DRAFT, show_default=False)]
NgramOpt = Annotated[Optional[int], typer.Option("--ngram", help="lookup: the longest n-gram of the context's end "
                                                "looked up (down to 1).", rich_help_panel=DRAFT, show_default=False)]
BranchingOpt = Annotated[Optional[str], typer.Option("--branching", help="mss, rsd-c: factors per depth, e.g. 3,2,2.",
                                                     rich_help_panel=DRAFT, show_default=False)]
BeamWidthOpt = Annotated[Optional[int], typer.Option("--beam-width", help="rsd-s: beam width W.",
                                                     rich_help_panel=DRAFT, show_default=False)]
DepthOpt = Annotated[Optional[int], typer.Option("--depth", help="rsd-s, spectr: tree depth L.",
                                                 rich_help_panel=DRAFT, show_default=False)]
NumDraftsOpt = Annotated[Optional[int], typer.Option("--num-drafts", help="spectr: number of draft sequences K.",
                                                     rich_help_panel=DRAFT, show_default=False)]
StopOpt = Annotated[Optional[list[str]], typer.Option(
    "--stop", help="End the answer at the first occurrence of TEXT (not printed unless --include-stop); repeatable.",
    rich_help_panel=ENDING, show_default=False)]
IncludeStopOpt = Annotated[Optional[bool], typer.Option(
    "--include-stop/--no-include-stop", help="Print the stop string that ended the answer too (and keep it in "
    "--json's text).",
    rich_help_panel=ENDING, show_default=False)]
StopTokenOpt = Annotated[Optional[list[int]], typer.Option(
    "--stop-token", help="End the answer at this token id too, as at an end-of-sequence token (its text kept "
    "unless special; `rsd tokenize` gives ids); repeatable.", rich_help_panel=ENDING, show_default=False)]
CompileOpt = Annotated[Optional[str], typer.Option(
    "--compile", help="auto, on or off: run the models on rsd's static-cache runtime compiled (on; CUDA graphs on a "
    "GPU), compiled where measured 20% faster on this machine (auto), or on transformers' eager forward (off).",
    show_default=False)]
BudgetOpt = Annotated[Optional[int], typer.Option("--budget", help="Pick a tree of at most N nodes per step (auto: its limit).",
                                                  rich_help_panel=DRAFT, show_default=False)]


def _load_profile(profile: str | None, flags: dict):
    from .profiles import load_profile
    from .runtime import apply_flags

    return apply_flags(load_profile(profile), flags)


def read_prompt(prompt: str | None, stdin=None, what: str = "prompt") -> str:
    """The prompt argument, `-` for stdin, or piped stdin joined before the argument (`what`: how
    errors name it)."""
    stdin = stdin or sys.stdin
    piped = prompt == "-" or (stdin is not None and not stdin.isatty())
    text = ""
    if piped:
        raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RsdError(f"stdin is not valid UTF-8 (byte {e.start})") from None
    if prompt not in (None, "-"):
        text = f"{text.rstrip()}\n{prompt}" if text.strip() else prompt
    elif prompt is None and not piped:
        raise UsageError(f"no {what}: give one as an argument, or pipe it in (use - to read stdin)")
    if not text.strip():
        raise UsageError(f"the {what} is empty")
    from .prompting import utf8_text

    return utf8_text(text, what)  # (before any model loads; encode_prompt checks what reaches a tokenizer)


def read_prompts(path: Path, prompt: str | None, stdin=None) -> list[str]:
    """--prompts: the prompts of a file (prompting.read_prompt_file), or of stdin's lines for -."""
    from .prompting import prompts_in, read_prompt_file

    if prompt is not None:
        raise UsageError("give a prompt or --prompts, not both")
    return read_prompt_file(path) if str(path) != "-" else prompts_in(read_prompt("-", stdin), "stdin")


def _profile_and_pair(profile: str | None, arguments: dict, fixed_shape: bool = True):
    """The profile with the command's flags applied (checked before any model loads), and the pair;
    fixed_shape: every step has the profile's shape (not in chat, whose /set may change the variant,
    nor for completions decoded together), so compiling prepares what that shape runs."""
    from .runtime import FLAG_KEYS, idle_include_stop, shape_of, unreachable_min_tokens, unread_settings

    flags = {name: arguments.get(name) for name in FLAG_KEYS}
    prof = _load_profile(profile, {**flags, "ignore_eos": arguments.get("ignore_eos", False)})
    unread = unread_settings(prof["decoding"]["variant"], prof["decoding"]["budget"],
                             [name for name, value in flags.items() if value is not None])
    if unread:  # (a flag the variant does not read: said, not refused — a script may pass one set to every variant)
        notice(unread)
    if unreachable := unreachable_min_tokens(prof):
        notice(unreachable)
    if idle := idle_include_stop(prof):
        notice(idle)
    shape = shape_of(prof)
    return prof, Loader().load(prof, fixed=shape if fixed_shape else None)


class Loader:
    """Shows model loading on stderr (a spinner on a terminal, nothing otherwise)."""

    def __init__(self, quiet: bool = False):
        self.console = _stderr_console()
        self.quiet = quiet or not self.console.is_terminal

    def load(self, profile, light: bool = True, fixed=None):
        """light: the pair runs only on its runtimes (not bench's transformers peers); fixed: the
        Shape of its every step, where it has one. See load_pair."""
        from .models import load_pair

        if self.quiet:
            return load_pair(profile, notice=notice, light=light, fixed=fixed)
        with self.console.status("loading models…") as status:
            return load_pair(profile, progress=lambda m: status.update(m), notice=self.notice, light=light,
                             fixed=fixed)

    def notice(self, message: str) -> None:
        """A notice line printed above the spinner (on a terminal)."""
        self.console.print(f"rsd: {message}", markup=False, highlight=False)

    def tokenizer(self, profile):
        """The target's tokenizer and the tokens that end an answer (models.load_tokenizer)."""
        from .models import load_tokenizer

        source, trusted = profile.resolve_path(profile["target"]["source"]), profile["target"]["trust_remote_code"]
        if self.quiet:
            return load_tokenizer(source, remote_code=trusted, notice=notice)
        with self.console.status("loading the tokenizer…") as status:
            return load_tokenizer(source, lambda m: status.update(m), trusted, self.notice)

    def target_location(self, profile) -> str:
        """The target's source as from_pretrained takes it (a GGUF file is converted here, once)."""
        from .models import resolve_source

        source = profile.resolve_path(profile["target"]["source"])
        if self.quiet:
            return resolve_source(source, notice=notice)[0]
        with self.console.status("resolving the target…") as status:
            return resolve_source(source, lambda m: status.update(m), self.notice)[0]


@app.command(no_args_is_help=False, cls=Command)
@cli_errors
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; - reads stdin. Piped stdin is joined before it.",
                                                    show_default=False)] = None,
    profile: ProfileOpt = None,
    system: SystemOpt = None,
    raw: RawOpt = False,
    variant: VariantOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = None,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    logit_bias: LogitBiasOpt = None,
    min_tokens: MinTokensOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    draft_len: DraftLenOpt = None,
    ngram: NgramOpt = None,
    branching: BranchingOpt = None,
    beam_width: BeamWidthOpt = None,
    depth: DepthOpt = None,
    num_drafts: NumDraftsOpt = None,
    budget: BudgetOpt = None,
    compile: CompileOpt = None,
    stop: StopOpt = None,
    include_stop: IncludeStopOpt = None,
    stop_token: StopTokenOpt = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Independent completions (models load once).",
                                         rich_help_panel=OUTPUT)] = 1,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Answer every prompt of a file instead, in "
                                                    "order: one a line, or .jsonl: a JSON string or "
                                                    "{\"prompt\": ...} a line; - reads stdin's lines.",
                                                    rich_help_panel=OUTPUT, show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per completion on stdout.",
                                          rich_help_panel=OUTPUT)] = False,
    logprobs: Annotated[int, typer.Option("--logprobs", min=0, help="With --json: each token's log-probability "
                                          "under the target's (processed) distribution and the N likeliest "
                                          "alternatives.", rich_help_panel=OUTPUT)] = 0,
    stats: Annotated[bool, typer.Option("--stats", help="A per-step statistics table on stderr at the end.",
                                        rich_help_panel=OUTPUT)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No statistics summary on stderr.",
                                        rich_help_panel=OUTPUT)] = False,
    live: Annotated[Optional[bool], typer.Option("--live/--no-live", help="Live view of the draft tree on stderr "
                                                 "(default: on when stderr is a terminal).", rich_help_panel=OUTPUT,
                                                 show_default=False)] = None,
):
    """Generate text for PROMPT: the answer streams to stdout, statistics go to stderr."""
    if logprobs and not as_json:
        raise UsageError("--logprobs needs --json (they are reported per token in the JSON record)")
    text = read_prompt(prompt) if prompts is None else read_prompts(prompts, prompt)
    console = _stderr_console()
    if live and not console.is_terminal:  # (asked for, and nothing to show it on: said, not refused)
        notice("--live draws nothing where stderr is not a terminal")
    elif live and as_json:
        notice("--live draws nothing with --json")
    prof, pair = _profile_and_pair(profile, locals(), fixed_shape=samples == 1 and prompts is None)
    from .generation import run_generate

    live = console.is_terminal if live is None else live
    run_generate(pair, prof, text, system=system, raw=raw, samples=samples, as_json=as_json,
                 show_stats=not quiet, step_table=stats, live=live, console=console, logprobs=logprobs)


@app.command(cls=Command)
@cli_errors
def chat(
    profile: ProfileOpt = None,
    system: SystemOpt = None,
    variant: VariantOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = None,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    logit_bias: LogitBiasOpt = None,
    min_tokens: MinTokensOpt = None,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    draft_len: DraftLenOpt = None,
    ngram: NgramOpt = None,
    branching: BranchingOpt = None,
    beam_width: BeamWidthOpt = None,
    depth: DepthOpt = None,
    num_drafts: NumDraftsOpt = None,
    budget: BudgetOpt = None,
    compile: CompileOpt = None,
    stop: StopOpt = None,
    include_stop: IncludeStopOpt = None,
    stop_token: StopTokenOpt = None,
    tree: Annotated[bool, typer.Option("--tree/--no-tree", help="Live view of the draft tree while answering.",
                                       rich_help_panel=OUTPUT)] = False,
    load: Annotated[Optional[Path], typer.Option("--load", help="Resume a conversation written by /save "
                                                 "(its system prompt unless --system is given).",
                                                 show_default=False)] = None,
):
    """An interactive session (history, chat template, slash commands; /help lists them)."""
    from .chat import read_conversation, run_chat

    history = []
    if load is not None:  # checked before any model loads
        saved_system, history = read_conversation(load.expanduser())
        system = system if system is not None else saved_system
    console = _stderr_console()
    if tree and not console.is_terminal:
        notice("--tree draws nothing where stderr is not a terminal")
    prof, pair = _profile_and_pair(profile, locals(), fixed_shape=False)  # (/set variant may change it)
    run_chat(pair, prof, system=system, tree=tree, console=console, history=history)


@app.command("inspect-tree", cls=Command)
@cli_errors
def inspect_tree(
    prompt: Annotated[str, typer.Argument(help="The prompt; - reads stdin.")],
    profile: ProfileOpt = None,
    step: Annotated[int, typer.Option("--step", min=1, help="Which decoding step to show.")] = 1,
    fmt: Annotated[Optional[str], typer.Option("--format", "-f", help="text, json or svg (default: text; svg with "
                                               "--output).", rich_help_panel=OUTPUT, show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="SVG file (default: rsd-step-N.svg).",
                                                   rich_help_panel=OUTPUT, show_default=False)] = None,
    system: SystemOpt = None,
    raw: RawOpt = False,
    variant: VariantOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = None,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    logit_bias: LogitBiasOpt = None,
    min_tokens: MinTokensOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    seed: SeedOpt = None,
    draft_len: DraftLenOpt = None,
    ngram: NgramOpt = None,
    branching: BranchingOpt = None,
    beam_width: BeamWidthOpt = None,
    depth: DepthOpt = None,
    num_drafts: NumDraftsOpt = None,
    budget: BudgetOpt = None,
    compile: CompileOpt = None,
    stop: StopOpt = None,
    stop_token: StopTokenOpt = None,
):
    """Decode up to step N and show that step in full: every node with q, p, order and fate."""
    fmt = fmt or ("svg" if output is not None else "text")  # (-o x.svg alone: what else would it write)
    if fmt not in ("text", "json", "svg"):
        raise UsageError(f"--format must be text, json or svg (got {fmt!r})")
    if output is not None and fmt != "svg":
        raise UsageError(f"--output writes an SVG (--format svg); {fmt} goes to stdout")
    text = read_prompt(prompt)
    prof, pair = _profile_and_pair(profile, locals())
    from .inspect import run_inspect

    run_inspect(pair, prof, text, step=step, fmt=fmt, output=output, system=system, raw=raw,
                console=_stderr_console())


@app.command(cls=Command)
@cli_errors
def tokenize(
    text: Annotated[str, typer.Argument(help="The text; - reads stdin.")],
    profile: ProfileOpt = None,
    chat: Annotated[bool, typer.Option("--chat", help="The tokens `rsd generate` sends for TEXT as a prompt: "
                                       "through the chat template (with --system).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt (with --chat).",
                                                  show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.", rich_help_panel=OUTPUT)] = False,
):
    """The target's token ids for TEXT, each with its text (for --logit-bias), and the tokens that end an answer.

    Only the tokenizer loads."""
    if system is not None and not chat:
        raise UsageError("--system applies with --chat (the tokens of a prompt)")
    text = read_prompt(text, what="text")
    prof = _load_profile(profile, {})
    tokenizer, eos = Loader().tokenizer(prof)
    eos |= set(prof["sampling"]["stop_tokens"])  # (what ends an answer with this profile)
    from .prompting import counted, encode_prompt, token_bytes, token_text_shown

    ids = encode_prompt(tokenizer, text, system) if chat else tokenizer.encode(text, add_special_tokens=False)

    def entry(token: int) -> dict:  # (bytes: exact where the text holds part of a character, U+FFFD)
        text = tokenizer.decode([token])
        return {"id": token, "text": text, "bytes": list(token_bytes(tokenizer, token, text))}

    ends = [entry(token) for token in sorted(eos)]
    if as_json:
        typer.echo(json.dumps({"tokens": [entry(token) for token in ids], "count": len(ids),
                               "end_of_sequence": ends}, ensure_ascii=False))
        return
    for token in ids:  # (the text JSON-quoted: spaces and line breaks stay visible; part of a character: \xNN)
        typer.echo(f"{token}\t{token_text_shown(tokenizer, token)}")
    listed = ", ".join(f"{e['id']} {token_text_shown(tokenizer, e['id'], text=e['text'])}" for e in ends) or "none"
    sys.stderr.write(f"{counted(len(ids), 'token')} · the answer ends at: {listed}\n")


def _csv_list(text: str, kind, name: str) -> list:
    """A flag's comma-separated values; at least one (an empty list would measure nothing), none empty."""
    from .profiles import got, list_items
    try:
        values = [kind(part) for part in list_items(text)]
    except ValueError as error:
        raise UsageError(f"{name} takes a comma-separated list (got {got(text, error)})") from None
    if not values:
        raise UsageError(f"{name} lists nothing (got {text!r})")
    return values


@app.command(cls=Command)
@cli_errors
def bench(
    profile: ProfileOpt = None,
    variants: Annotated[str, typer.Option("--variants", help=f"Comma-separated variants; by default every one: "
                                          f"{BENCH_VARIANTS.replace(',', ', ')}.",  # (with spaces: it wraps)
                                          show_default=False)] = BENCH_VARIANTS,
    budgets: Annotated[Optional[str], typer.Option("--budgets", help="Fixed target budgets, e.g. 6,10,14,21,30.",
                                                   show_default=False)] = None,
    depths: Annotated[Optional[str], typer.Option("--depths", help="Fixed draft lengths L, e.g. 2,4.",
                                                  show_default=False)] = None,
    width: Annotated[Optional[int], typer.Option("--width", min=1, help="Tree width at --depths: root children "
                                                 "(mss, rsd-c), beam width (rsd-s), drafts (spectr); by default "
                                                 "the profile's beam_width.", show_default=False)] = None,
    temperatures: Annotated[str, typer.Option("--temperatures", help="Comma-separated temperatures.")] = "1.0",
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A prompt file, one per line, or .jsonl: a "
                                                    "JSON string or {\"prompt\": ...} a line (default: the built-in "
                                                    "held-out set).", show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Use the first N prompts.")] = 4,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs of every prompt by every row.")] = 1,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="The most tokens an answer takes.")] = 64,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**63 - 1, help="Seed of the first answer (each row "
                                      "answers with the same "
                                      "seeds).")] = 0,
    assisted: Annotated[bool, typer.Option("--assisted/--no-assisted", help="Also time transformers' assisted "
                                           "generation with the same pair.")] = True,
    hf_static: Annotated[bool, typer.Option("--hf-static/--no-hf-static", help="Also time transformers' generate "
                                            "with a static cache (the target alone; compiled by transformers on "
                                            "CUDA).")] = True,
    stop: StopOpt = None,
    stop_token: StopTokenOpt = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Never end at an end-of-sequence token: every "
                                             "run, the peers' too, takes --max-tokens tokens (or ends at a stop "
                                             "string).")] = False,
    compile: Annotated[Optional[str], typer.Option("--compile", help="Comma-separated --compile settings to "
                                                   "measure, rows interleaved, e.g. on,off; by default the "
                                                   "profile's.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help='{"results": [...]} on stdout.', rich_help_panel=OUTPUT)] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV on stdout.", rich_help_panel=OUTPUT)] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a plot (.svg, or .png with matplotlib).",
                                                 rich_help_panel=OUTPUT, show_default=False)] = None,
):
    """Measure the variants side by side, interleaved, against ar in the same run."""
    from .profiles import VARIANTS

    names = _csv_list(variants, str, "--variants")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    budget_list = _csv_list(budgets, int, "--budgets") if budgets is not None else []
    depth_list = _csv_list(depths, int, "--depths") if depths is not None else []
    temps = _csv_list(temperatures, float, "--temperatures")
    for flag, given, values, fits, what in (("--budgets", budgets, budget_list, lambda b: b >= 1, "numbers of at least 1"),
                                            ("--depths", depths, depth_list, lambda d: d >= 1, "numbers of at least 1"),
                                            ("--temperatures", temperatures, temps, lambda t: 0 <= t < math.inf,
                                             "finite numbers of at least 0")):
        if not all(map(fits, values)):
            raise UsageError(f"{flag} takes {what} (got {given!r})")
    if as_json and as_csv:
        raise UsageError("--json and --csv are exclusive")
    compiles = list(dict.fromkeys(_csv_list(compile, str, "--compile"))) if compile is not None else []
    if any(c not in ("auto", "on", "off") for c in compiles):
        raise UsageError(f"--compile takes auto, on or off, comma-separated (got {compile!r})")
    if plot:
        from .bench import check_plot_path

        check_plot_path(plot)
    from .distill_command import _read_prompts
    from .prompting import builtin_prompts

    prompt_list = (_read_prompts(prompts) if prompts else builtin_prompts("eval"))[:limit]
    if width is not None and not depth_list:
        notice("--width changes nothing without --depths: it sets the width of the trees at --depths (the "
               "profile's own trees and --budgets' keep theirs)")
    prof = _load_profile(profile, {"compile": compiles[0] if compiles else None, "stop": stop,
                                   "stop_token": stop_token})
    if ignore_eos:  # (bench's --max-tokens, not the profile's)
        prof.set("sampling", "min_tokens", max_tokens, "flag --ignore-eos")
    from .bench import Interrupted, results_table, run_bench, runtime_rss_mb, table_title, write_csv, write_plot

    loader = Loader()
    runtime_mb = runtime_rss_mb(loader.target_location(prof))  # before any weights load
    pair = loader.load(prof, light=False)  # the peers and --compile off run transformers' forward
    from .bench import plan_jobs
    from .runtime import runtimes_of

    # every tree one the models take, as generate's (else an error naming the flag), before anything is measured
    plan_jobs(prof, names, temps, budget_list, depth_list, width, pair.vocab_size, pair.context_length)

    compiles = compiles or [prof["runtime"]["compile"]]
    runtimes = {c: pair.runtimes if c == prof["runtime"]["compile"] else runtimes_of(pair, c, notice=notice)
                for c in compiles}
    from .engine import pair_limit

    # (an ALiBi, GPT-Neo or Llama 4 model takes trees on the static-cache runtime only: where every runtime asked
    # for has a limit, the default variants are the tightest one's; where some have, those runtimes measure theirs)
    limits = {c: pair_limit(pair.target, pair.draft, r) for c, r in runtimes.items()}
    found = [limit for limit in limits.values() if limit is not None]
    default = variants == BENCH_VARIANTS
    if found and default and len(found) == len(limits):
        limit = min(found, key=lambda each: len(each[0].variants))
        names = [v for v in names if v in limit[0].variants + ("auto",)]
        notice(f"{limit[1]} take no tree: measuring {', '.join(names)}")
    elif found and default:
        for c, limit in limits.items():
            if limit is not None:
                taken = [v for v in names if v in limit[0].variants + ("auto",)]
                notice(f"{limit[1]} take no tree on --compile {c}: measuring {', '.join(taken)} there")
    from rich.progress import Progress

    console = _stderr_console()
    stopped = None  # (Ctrl-C or SIGTERM after some prompts: their rows are reported, then rsd exits as interrupted)
    with Progress(console=console, disable=not console.is_terminal, transient=True) as bars:
        task = bars.add_task("benchmarking", total=None)
        try:
            rows = run_bench(pair, prof, variants=names, temperatures=temps, budgets=budget_list, depths=depth_list,
                             prompts=prompt_list, repeats=repeats, max_tokens=max_tokens, seed=seed,
                             assisted=assisted, progress=lambda done, total: bars.update(task, completed=done, total=total),
                             compiles=compiles, hf_static=hf_static, runtimes=runtimes, refused_rows=not default,
                             width=width)
        except Interrupted as e:
            rows, stopped = e.rows, e
    if stopped:
        console.print(f"rsd: interrupted after {stopped.measured} of {stopped.planned} rounds (a prompt each, every "
                      f"row in turn): the rows measure those", markup=False, highlight=False)
    for row in rows:
        if row.get("error"):
            where = f" on --compile {row['compile']}" if row.get("compile") and len(compiles) > 1 else ""
            console.print(f"rsd: warning: {row['variant']}{where} failed and has no numbers: {row['error']}",
                          markup=False, highlight=False)
    from .bench import memory_summary, shared_cpu

    warning = shared_cpu(rows)
    if warning:
        console.print(warning, markup=False, highlight=False)
    memory = memory_summary(pair, runtime_mb)
    if as_json:
        from .small_batch import installed, signature

        from . import __version__

        # (what the run was, so that a saved report says how to run it again)
        settings = {"rsd": __version__, "argv": sys.argv[1:], "profile": prof.name, "variants": names,
                    "temperatures": temps, "budgets": budget_list, "depths": depth_list, "width": width,
                    "prompts": str(prompts) if prompts else "built-in held-out set", "prompt_count": len(prompt_list),
                    "repeats": repeats, "max_tokens": max_tokens, "seed": seed, "ignore_eos": ignore_eos,
                    "compile": compiles, "rounds_planned": len(prompt_list) * repeats,
                    "rounds_measured": stopped.measured if stopped else len(prompt_list) * repeats}
        typer.echo(json.dumps({"results": rows, "settings": settings, "memory": memory,
                               "small_batch_layers": installed(pair.target, pair.draft),
                               "cpu_kernels": signature(pair.target, pair.draft)}, indent=2))
    elif as_csv:
        write_csv(rows, sys.stdout)
    else:
        from rich.console import Console

        from .render import print_table

        title = table_title(len(prompt_list), repeats, max_tokens, stopped.measured if stopped else None)
        print_table(Console(highlight=False), lambda width: results_table(rows, width, title))
        console.print(f"peak memory {memory['peak_rss_mb']:.0f} MB resident, of which {memory['runtime_rss_mb']:.0f} MB "
                      f"is the runtime (Python, torch, transformers, the model's code) before any weights load; "
                      f"weights {memory['weights_mb']:.0f} MB "
                      f"(target + draft, shared tensors counted once)")
    if plot:  # (after the results are out: a plot that fails loses none of them)
        write_plot(rows, plot)
        console.print(f"wrote {plot}")
    if stopped:
        raise stopped


@profiles_app.command("list", cls=Command)
@cli_errors
def profiles_list():
    """Built-in and user profiles (user ones shadow built-in ones of the same name)."""
    from .profiles import available_profiles, load_profile

    for name, (path, where) in sorted(available_profiles().items()):
        try:
            description = load_profile(str(path)).description
        except RsdError as e:
            description = f"(invalid: {e})"
        typer.echo(f"{name}\t{where}\t{path}\t{description}")


@profiles_app.command("show", cls=Command)
@cli_errors
def profiles_show(name: Annotated[str, typer.Argument(autocompletion=complete_profile)] = "default",
                  as_json: Annotated[bool, typer.Option("--json")] = False):
    """Resolved values of a profile, and where each came from."""
    from .profiles import load_profile, toml_value
    from .runtime import resolved

    prof = load_profile(name)
    rows = resolved(prof)
    if as_json:
        out = {"name": prof.name, "path": str(prof.path), "description": prof.description, "values": {}}
        for table, key, value, origin in rows:
            out["values"].setdefault(table, {})[key] = {"value": value, "from": origin}
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(f"# profile {prof.name} ({prof.path})")
    if prof.description:
        typer.echo(f"# {prof.description}")
    current = None
    for table, key, value, origin in rows:
        if table != current:
            typer.echo(f"\n[{table}]")
            current = table
        typer.echo(f"{key} = {toml_value(value)}  # {origin}")


@profiles_app.command("new", cls=Command)
@cli_errors
def profiles_new(
    name: Annotated[str, typer.Argument(help="The new user profile's name.", show_default=False)],
    base: Annotated[str, typer.Option("--from", help="The profile whose values it starts with.",
                                      autocompletion=complete_profile)] = "default",
    force: Annotated[bool, typer.Option("--force", help="Replace a user profile of that name.")] = False,
):
    """Write a user profile NAME with every setting of another, each after what it does, to edit.

    The environment's RSD_ settings are not written; the new file's path goes to stdout."""
    from .profiles import builtin_profiles, load_profile, profile_file_text, user_profiles_dir

    if name.endswith(".toml"):
        raise UsageError(f"give the profile's name without .toml (got {name!r})")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"a profile's name is letters, digits, '.', '_' and '-' (got {name!r})")
    path = user_profiles_dir() / f"{name}.toml"
    if path.exists() and not force:
        raise RsdError(f"profile {name!r} exists: {path} (--force replaces it)")
    prof = load_profile(base, environ={})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_file_text(prof, f"rsd profile {name}, made by `rsd profiles new` from {prof.path}"),
                    encoding="utf-8")
    if name in builtin_profiles():
        notice(f"your profile {name!r} now shadows the built-in one of that name (remove {path} to undo)")
    typer.echo(str(path))


@profiles_app.command("path", cls=Command)
@cli_errors
def profiles_path():
    """The folder where user profiles live."""
    from .profiles import user_profiles_dir

    typer.echo(str(user_profiles_dir()))


@cache_app.callback()
def _cache(ctx: typer.Context,
           as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout (as show --json).")] = False):
    """(`rsd cache` alone: `rsd cache show`)"""
    if ctx.invoked_subcommand is None:
        cache_show(as_json)


@cache_app.command("show", cls=Command)
@cli_errors
def cache_show(as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False):
    """Each part of the cache folder: its size, what it holds and what clearing it costs."""
    from .cache import chosen_inductor_folder, entry_count, size_text, survey
    from .models import cache_dir

    folder = cache_dir()
    parts = survey(folder)
    total = sum(part.size for part in parts)
    elsewhere = chosen_inductor_folder(folder)  # (torch.compile's code goes there: the user's folder)
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), "bytes": total, "parts": [
            {"name": part.name, "bytes": part.size, "entries": len(part.paths), "in_use": len(part.in_use),
             "what": part.what, "when_cleared": part.remade} for part in parts],
            "compiled_elsewhere": None if elsewhere is None else str(elsewhere)}, indent=2))
        return
    typer.echo(f"rsd's cache folder: {folder} (RSD_CACHE_DIR moves it)")
    width = max(len(part.name) for part in parts)
    for part in parts:
        if part.name == "other" and not part.paths:
            continue
        held = ", ".join(filter(None, [entry_count(part), f"{len(part.in_use)} in use" if part.in_use else ""]))
        line = part.what + (f" ({held})" if held else "") + (f"; {part.remade}" if part.remade and part.paths else "")
        if part.name == "compiled" and elsewhere is not None:
            line += f"; new code goes to {elsewhere} (TORCHINDUCTOR_CACHE_DIR), not here"
        typer.echo(f"  {part.name:<{width}}  {size_text(part.size):>9}  {line}")
    typer.echo(f"  {'total':<{width}}  {size_text(total):>9}")


@cache_app.command("clear", cls=Command)
@cli_errors
def cache_clear(
    parts: Annotated[Optional[list[str]], typer.Argument(
        help=f"The parts to remove: {', '.join(PART_NAMES)}.",
        autocompletion=lambda incomplete: [name for name in PART_NAMES if name.startswith(incomplete)],
        show_default=False)] = None,
    everything: Annotated[bool, typer.Option("--all", help="Remove every part.")] = False,
):
    """Remove parts of the cache folder (each is remade when needed; `rsd cache` says at what cost).

    An offload folder of a process still running is kept; what was removed goes to stderr."""
    from .cache import chosen_inductor_folder, clear, size_text, survey
    from .models import cache_dir
    from .prompting import counted

    names = set(parts or ())
    unknown = sorted(names - set(PART_NAMES))
    if unknown:
        raise UsageError(f"no cache part {unknown[0]!r}: the parts are {', '.join(PART_NAMES)}")
    if everything == bool(names):
        raise UsageError("name the parts to clear (" + ", ".join(PART_NAMES) + ") or give --all"
                         if not names else "give the parts to clear or --all, not both")
    failed = False
    for cleared in clear(survey(cache_dir()), set(PART_NAMES) if everything else names):
        line = f"{cleared.part.name}: removed {size_text(cleared.removed)}"
        if cleared.in_use:
            line += (f", kept {counted(len(cleared.in_use), 'offload folder')} in use "
                     f"({', '.join(path.name for path in cleared.in_use)})")
        if cleared.failed:
            line += f"; could not remove {', '.join(map(str, cleared.failed))} (see its permissions)"
        if cleared.part.name == "compiled" and (elsewhere := chosen_inductor_folder(cache_dir())) is not None:
            line += f"; torch.compile's code now goes to {elsewhere} (TORCHINDUCTOR_CACHE_DIR), which rsd leaves alone"
        typer.echo(line, err=True)
        failed = failed or bool(cleared.failed)
    if failed:
        raise typer.Exit(1)


@cache_app.command("path", cls=Command)
@cli_errors
def cache_path():
    """The cache folder (RSD_CACHE_DIR, else $XDG_CACHE_HOME/rsd, else ~/.cache/rsd)."""
    from .models import cache_dir

    typer.echo(str(cache_dir()))


@app.command(cls=Command)
@cli_errors
def distill(
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the adapter (.safetensors).")],
    profile: ProfileOpt = None,
    layers: Annotated[int, typer.Option("--layers", min=1, help="Target layers before the adapter.")] = 3,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Training tokens to sample.")] = 20_000,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", min=1, help="Held-out tokens to evaluate on.")] = 2_000,
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Passes over the training tokens.")] = 4,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW).")] = 3e-4,
    schedule: Annotated[str, typer.Option("--schedule", help="cosine (5% warm-up, then cosine decay) or constant.")
                        ] = "cosine",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest sampled answer.")] = 160,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Answers sampled together.")] = 32,
    vocab: Annotated[int, typer.Option("--vocab", min=0, help="Train for a draft head of the first N tokens "
                                       "(the profile's draft.vocab); 0 = the whole vocabulary.")] = 0,
    train_head: Annotated[Optional[bool], typer.Option(
        "--train-head/--shared-head", show_default=False,
        help="Train the draft its own final norm and head (its rows go into the file) or share the target's; "
             "default: --train-head with --vocab, else shared.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**63 - 1,
                                      help="Seed of the sampled answers and of the training.")] = 0,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A file of training prompts, one per line (.jsonl: "
                                                    "a JSON string or {\"prompt\": ...} a line).",
                                                    show_default=False)] = None,
    compile: Annotated[Optional[str], typer.Option(
        "--compile", help="auto, on or off: sample the target's answers on rsd's static-cache runtime (as "
        "generate's --compile) or with transformers' generate (off).", show_default=False)] = None,
):
    """Train an adapter layer that turns the target's first layers into a good draft."""
    from .distill_command import run_distill

    if not 0 < lr < math.inf:  # (0 trains nothing: the adapter written would be its initial copy of layer K)
        raise UsageError(f"--lr must be a finite number more than 0 (got {lr:g})")

    run_distill(_load_profile(profile, {"compile": compile}), out, layers=layers, tokens=tokens,
                eval_tokens=eval_tokens, epochs=epochs, lr=lr, schedule=schedule, max_new_tokens=max_new_tokens,
                batch_size=batch_size, vocab=vocab, seed=seed, prompts_file=prompts,
                console=_stderr_console(), train_head=train_head)


def open_closed_standard_streams() -> list[str]:
    """Standard streams the caller closed (`2>&-`, `<&-`, `>&-`) opened on the null device, as daemons
    do: Python left them None (a write failed), and a file rsd opens would take their descriptor, where
    a C library's write to stderr (torch's warnings) would land. A closed stdin reads as empty, a closed
    stderr drops what is written to it. Returns the names of those that were closed."""
    from .errors import point_at_null

    closed = []
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        point_at_null(fd)
        stream = open(fd, "r" if fd == 0 else "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
        closed.append(name)
    return closed


def main() -> None:
    """`rsd`: the app, then a prompt exit. Once a process has imported torch, Python's own shutdown
    (every module and object torn down) takes 0.2-0.5 s after the answer is out. rsd leaves nothing
    to it: its files are written and closed by then, and exit hooks (a temporary offload folder,
    torch's worker pools, multiprocessing's children) run here; so it flushes the output and ends
    the process with the app's exit code. Where another thread is still running, Python's exit as
    usual (it waits for such threads)."""
    import threading

    from .errors import leave_ending_signals, outlive_the_terminal, take_ending_signals

    if "stdout" in open_closed_standard_streams():
        error("stdout is closed: what rsd writes there would be lost (>/dev/null discards it)")
        sys.exit(1)
    outlive_the_terminal()
    take_ending_signals()  # (`timeout`, `kill`, a closed terminal: what was generated is kept, as on Ctrl-C)
    try:
        app(prog_name="rsd")
        code = 0
    except SystemExit as e:
        code = e.code
    leave_ending_signals()  # (the answer is out: a SIGTERM now just ends the process)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "torch" not in sys.modules or others:  # (--help, completions: nothing to tear down)
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # (as sys.exit("message") does)
        print(code, file=sys.stderr)
        code = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a pipe the reader closed)
            pass
    os._exit(code)
