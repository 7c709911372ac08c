"""`rsd chat`: an interactive session on the same engine and events as `generate`."""

from __future__ import annotations

import difflib
import glob
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import errors
from .errors import RsdError, UsageError
from .generation import context_end_note, stop_text_of, stream_completion
from .models import describe_layers
from .profiles import EMPTY_ITEM, list_items, parse_bool
from .prompting import NEXT_TURN, counted, encode_prompt, has_chat_template
from .render import summary_line
from .runtime import (FLAG_KEYS, branching_factors, idle_include_stop, make_decoder, parse_logit_bias, seed_of,
                      unreachable_min_tokens, unread_settings)

HELP = """commands:
  /help                 this help
  /bye, /exit, /quit    leave (Ctrl-D too)
  /clear                forget the conversation
  /retry                answer the last message again (another draw, the settings now)
  /undo                 take back the last message and its answer
  /system TEXT          set the system prompt (empty TEXT clears it)
  /set KEY VALUE        KEY: temperature, top_p, top_k, min_p, repetition_penalty,
                        presence_penalty, frequency_penalty, logit_bias, min_tokens,
                        max_tokens, seed, stop, include_stop, stop_token, variant,
                        draft_len, ngram, branching, beam_width, depth, num_drafts,
                        budget (0: off)
                        (/set alone: every setting now and where it comes from; /set KEY: one)
                        (/set stop TEXT: one stop string; /set stop ["a", "b"]: several; [] none;
                        /set include_stop on: print the stop string too;
                        /set logit_bias 2=-100,13=5: token id = bias, {} none;
                        /set stop_token 198,13: token ids that end the answer, [] none;
                        /set branching 3,2: factors per depth)
  /stats                statistics of the last answer
  /tree on|off          live view of the draft tree while answering
  /save FILE            write the conversation as JSON
  /load FILE            resume a conversation written by /save (replaces this one)
  \"\"\"                   start and end a multi-line message (sent as written, / and all)
Ctrl-C stops the current answer and keeps the session."""

def _stop_list(value: str) -> list[str]:
    """`/set stop` takes one string, or a JSON list of them."""
    if not value.startswith("["):
        return [value]
    parsed = json.loads(value)
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(value)
    return parsed


def _token_list(value: str) -> list[int]:
    """`/set stop_token 198,13` (or spaces between): token ids; [] clears them."""
    if value.strip() == "[]":
        return []
    return [int(entry) for entry in list_items(value)]


def _bias_table(value: str) -> dict[str, float]:
    """`/set logit_bias 2=-100,13=5` (or spaces between): a profile's table; {} clears it."""
    if value.strip() == "{}":
        return {}
    try:
        return parse_logit_bias(list_items(value), "/set logit_bias")
    except UsageError:
        raise ValueError(value) from None


def _as_typed(value) -> str:
    """A setting as /set takes it: a logit bias as 2=-inf,17=6, a list as 3,2 or a JSON list of strings,
    a switch as on or off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ",".join(f"{token}={bias:g}" for token, bias in value.items()) or "{}"
    if isinstance(value, list):
        return json.dumps(value) if not value or isinstance(value[0], str) else ",".join(map(str, value))
    return str(value)


def _short(message: str, width: int = 60) -> str:
    """A message as /retry and /undo name it: quoted, on one line, cut at `width` characters."""
    shown = repr(message)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


# what /set takes (the flags' names, runtime.FLAG_KEYS) -> how its text is read
SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
            "presence_penalty": float, "frequency_penalty": float, "logit_bias": _bias_table, "min_tokens": int,
            "max_tokens": int, "seed": int, "stop": _stop_list, "include_stop": parse_bool, "stop_token": _token_list,
            "variant": str, "draft_len": int, "ngram": int, "branching": branching_factors, "beam_width": int,
            "depth": int, "num_drafts": int, "budget": int}
EXPECTED = {float: "a number", int: "an integer", _stop_list: "a string or a JSON list of strings",
            parse_bool: "on or off",
            branching_factors: "integers separated by commas, like 3,2,2",
            _token_list: "token ids separated by commas, like 198,13 ([] for none)",
            _bias_table: "TOKEN_ID=BIAS entries separated by commas, like 2=-100,13=5 ({} for none)"}


@dataclass
class ChatSession:
    pair: object
    profile: object
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    tree: bool = False
    last_stats: tuple | None = None  # (the last answer's Stats, the shape it was asked with), for /stats
    turns: int = 0
    learnt: tuple = (None, None, None)  # (shape, sampling, auto.AutoShape) of the last answer
    kept: object = None  # the last answer's KV caches (engine.KeptCaches): the next one reads only what is new
    window: int = 0  # history[window:] is what the model is shown (older messages no longer fit its context)
    unanswered: str | None = None  # the last message sent where its answer was stopped or failed (for /retry)

    def command(self, line: str, console, out=None) -> bool:
        """Run a slash command (out: where /retry's answer goes); returns False when the session should end."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        if f"/{name}" in LEAVE:
            return False
        if name == "help":
            console.print(HELP, markup=False, highlight=False)
        elif name == "clear":
            self.history.clear()
            self.window, self.unanswered = 0, None
            console.print("conversation cleared")
        elif name == "retry":
            message = self.unanswered if self.unanswered is not None else self.take_back()
            if message is None:
                raise RsdError("no message to answer again yet")
            console.print(f"(again: {_short(message)})", style="dim", markup=False, highlight=False)
            self.answer(message, out or sys.stdout, console)
        elif name == "undo":
            before = len(self.history)
            message, self.unanswered = self.take_back(), None
            if message is None:
                raise RsdError("nothing to take back: the conversation holds no message yet")
            answer = " and its answer" if before - len(self.history) > 1 else ""
            console.print(f"took back {_short(message)}{answer}; {counted(len(self.history), 'message')} left",
                          markup=False, highlight=False)
        elif name == "system":
            self.system = arg or None
            console.print(f"system prompt {'set' if arg else 'cleared'}")
        elif name == "set":
            key, _, value = arg.partition(" ")
            if key in ("", *SETTABLE) and not value.strip():  # what the settings are now, and where from
                for shown in SETTABLE if not key else [key]:
                    table, entry = FLAG_KEYS[shown]
                    console.print(f"{shown} = {_as_typed(self.profile[table][entry])}  "
                                  f"({self.profile.origins[table][entry]})", markup=False, highlight=False)
                return True
            if key not in SETTABLE:
                meant = difflib.get_close_matches(key, SETTABLE, n=1, cutoff=0.7)  # (/set temprature 0)
                raise RsdError(f"no setting {key!r}: did you mean /set {meant[0]}?" if meant else
                               f"usage: /set {'|'.join(SETTABLE)} VALUE (/set alone: the settings now)")
            try:
                typed = SETTABLE[key](value.strip())
            except ValueError as error:
                what = "has an empty item; it takes" if str(error) == EMPTY_ITEM else "is not"
                raise RsdError(f"/set {key}: {value.strip()!r} {what} {EXPECTED[SETTABLE[key]]}") from None
            table, entry = FLAG_KEYS[key]
            before = self.profile.values[table][entry], self.profile.origins[table][entry]
            try:  # checked like a profile entry; the shape now (and whether the models take it), not at the next answer
                self.profile.set(table, entry, typed, "/set")
                decoder = make_decoder(self.pair, self.profile)
                if table == "decoding":
                    decoder.check_shape("/set variant")
                shape = decoder.shape
            except RsdError:  # a setting refused leaves the session as it was
                self.profile.values[table][entry], self.profile.origins[table][entry] = before
                raise
            what = f" · {shape.describe()}" if table == "decoding" else ""
            unread = unread_settings(shape.variant, self.profile["decoding"]["budget"], [key], spell=str)
            what += f" ({unread})" if unread else ""
            unreachable = key in ("min_tokens", "max_tokens") and unreachable_min_tokens(self.profile)
            what += f" — {unreachable}" if unreachable else ""
            idle = key in ("include_stop", "stop") and idle_include_stop(self.profile, "/set stop TEXT")
            what += f" — {idle}" if idle else ""
            console.print(f"{key} = {_as_typed(typed)}{what}", markup=False, highlight=False)
        elif name == "stats":
            console.print(summary_line(*self.last_stats) if self.last_stats else "no answer yet", highlight=False)
        elif name == "tree":
            if arg not in ("on", "off"):
                raise RsdError("usage: /tree on|off")
            self.tree = arg == "on"
            if self.tree and not console.is_terminal:
                console.print("(the live view draws nothing where stderr is not a terminal)", style="dim")
        elif name == "load":
            if not arg:
                raise RsdError("usage: /load FILE")
            self.load(Path(arg).expanduser())
            console.print(f"loaded {counted(len(self.history), 'message')} from {arg}")
        elif name == "save":
            if not arg:
                raise RsdError("usage: /save FILE")
            self.save(Path(arg).expanduser())
            console.print(f"saved {counted(len(self.history), 'message')} to {arg}")
        else:
            meant = difflib.get_close_matches(f"/{name}", COMMANDS, n=1, cutoff=0.7)  # (/sve x.json)
            raise RsdError(f"unknown command /{name}" + (f": did you mean {meant[0]}?" if meant else " (try /help)"))
        return True

    def take_back(self) -> str | None:
        """Remove the last exchange from the conversation: its last user message and what follows it (the
        answer; nothing, where a loaded conversation ends with a message). Returns that message; None where
        the conversation holds none (nothing removed)."""
        users = [i for i, m in enumerate(self.history) if m["role"] == "user"]
        if not users:
            return None
        message = self.history[users[-1]]["content"]
        del self.history[users[-1]:]
        self.window = min(self.window, len(self.history))
        return message

    def save(self, path: Path) -> None:
        record = {"profile": self.profile.name, "system": self.system, "messages": self.history}
        try:
            path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            raise RsdError(f"cannot save to {path}: {e.strerror or e}") from None

    def load(self, path: Path) -> None:
        """Resume a conversation written by `save`: its system prompt and messages replace these."""
        self.system, self.history = read_conversation(path)
        self.window, self.unanswered = 0, None

    def answer(self, message: str, out, console) -> None:
        self.unanswered = message  # (until its answer is in the conversation)
        decoder = make_decoder(self.pair, self.profile)
        if (decoder.shape, decoder.sampling) == self.learnt[:2]:  # auto goes on from what earlier answers taught it
            decoder.policy = self.learnt[2]
        decoder.keep_caches, decoder.kept = True, self.kept
        ids = self.prompt_ids(message, console)
        seed = seed_of(self.profile)
        if seed is not None:
            seed += self.turns  # reproducible session, but not the same draw every turn
        self.turns += 1
        self.history.append({"role": "user", "content": message})
        plain = not has_chat_template(self.pair.tokenizer)
        try:
            tokens, stats, events, text = stream_completion(
                self.pair, decoder, ids, self.profile["sampling"]["max_tokens"], seed,
                out=AnswerStart(out) if plain else out, console=console,
                live=self.tree, stop_text=stop_text_of(self.pair.tokenizer, self.profile, self.plain_stops()),
                reading_note=True)
        except RsdError:  # not answered: the message leaves the conversation (the next one would fail too)
            self.kept = decoder.kept
            self.history.pop()
            raise
        except KeyboardInterrupt:
            self.kept = decoder.kept  # (None where the stop came in the middle of a step)
            out.write("\n")
            console.print("[dim](answer stopped)[/dim]")
            self.history.pop()
            if errors.ending_signal is not None:  # (SIGTERM: the session ends, not the answer alone)
                raise
            return
        self.kept = decoder.kept
        out.write("\n")
        out.flush()
        if events and events[-1].finished == "context":  # (max_tokens above half the context: prompt_ids)
            note = context_end_note(self.pair.context_length, len(ids), len(tokens),
                                    self.profile["sampling"]["max_tokens"])
            console.print(f"({note})", style="dim", markup=False, highlight=False)
        self.last_stats = (stats, decoder.shape.describe())
        self.learnt = (decoder.shape, decoder.sampling, decoder.policy)
        self.history.append({"role": "assistant", "content": text.lstrip() if plain else text})
        self.unanswered = None

    def plain_stops(self) -> tuple[str, ...]:
        """Without a chat template the conversation goes as plain text (prompting.plain_conversation),
        and a base model's answer tends to go on with the user's next turn: it ends there."""
        return () if has_chat_template(self.pair.tokenizer) else (NEXT_TURN,)

    def prompt_ids(self, message: str, console) -> list[int]:
        """The prompt for `message`: the system prompt and the latest messages. Once they no longer
        fit the model's context with room for an answer (max_tokens, at most half the context), the
        oldest are left out until the rest takes at most half of it, the window starting at a user
        message (a note the first time): it then stays put for a while, so the next answers still
        find most of their prompt in the kept caches instead of reading the whole conversation
        again each time."""
        limit = self.pair.context_length
        room = min(self.profile["sampling"]["max_tokens"], limit // 2) if limit else 0
        start = min(self.window, len(self.history))
        ids = encode_prompt(self.pair.tokenizer, message, system=self.system, history=self.history[start:])
        if limit and len(ids) + room > limit:
            goal = min(limit // 2, limit - room)
            while len(ids) > goal and start < len(self.history):
                start += 1
                while start < len(self.history) and self.history[start]["role"] != "user":
                    start += 1
                ids = encode_prompt(self.pair.tokenizer, message, system=self.system, history=self.history[start:])
        if limit and len(ids) >= limit:
            raise RsdError(f"this message needs {len(ids)} tokens (chat template and system prompt included), "
                           f"but the model's context holds {limit}: not sent")
        if self.window == 0 and start > 0:  # said once a conversation; the window moves on quietly
            kept = len(self.history) - start
            which = f"the latest {kept} of {len(self.history)} kept" if kept else "none of the earlier ones kept"
            console.print(f"[dim](the conversation outgrew the model's context of {limit} tokens: from now on the "
                          f"oldest messages are left out, {which}; /save keeps all)[/dim]")
        self.window = start
        return ids


def read_conversation(path: Path) -> tuple[str | None, list[dict]]:
    """(system prompt, messages) of a conversation written by /save, checked."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RsdError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise RsdError(f"{path} is not a saved conversation: {e}") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in messages):
        raise RsdError(f"{path} is not a saved conversation (no list of user/assistant messages)")
    system = record.get("system")
    return (system if isinstance(system, str) and system else None,
            [{"role": m["role"], "content": m["content"]} for m in messages])


class AnswerStart:
    """`out` without the whitespace an answer begins with: a base model's answer after "Assistant:"
    (prompting.plain_conversation) begins with the space it writes there, which printed as ` Hello`."""

    def __init__(self, out):
        self.out, self.started = out, False

    def write(self, text: str) -> int:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        return self.out.write(text) if text else 0

    def __getattr__(self, name):  # (flush, isatty, ...)
        return getattr(self.out, name)


def read_message(read_line) -> tuple[str, bool] | None:
    """One user message and whether it is a \"\"\"-delimited block (never a command, though its first line
    begins with "/": a path pasted at its start was run as one), or a line. None at end of input."""
    try:
        line = read_line("you› ")
    except EOFError:
        return None
    if line.strip() != '"""':
        return line, False
    lines = []
    while True:
        try:
            more = read_line("... ")
        except EOFError:
            break
        if more.strip() == '"""':
            break
        lines.append(more)
    return "\n".join(lines), True


LEAVE = ("/bye", "/exit", "/quit")
COMMANDS = ("/help", *LEAVE, "/clear", "/retry", "/undo", "/system", "/set", "/stats", "/tree", "/save", "/load")
HISTORY_LINES = 1000


def history_file() -> Path | None:
    """Where the lines typed in `rsd chat` are kept for the next session (Up recalls them):
    $RSD_CHAT_HISTORY (empty: nowhere), else $XDG_STATE_HOME/rsd/chat_history."""
    chosen = os.environ.get("RSD_CHAT_HISTORY")
    if chosen is not None:
        return Path(chosen).expanduser() if chosen.strip() else None
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "rsd" / "chat_history"


def completions(line: str) -> list[str]:
    """The lines Tab may complete a line typed so far to: a command, /set's keys, /tree on|off,
    the files and folders /save and /load may name."""
    words = line.split(" ")
    if len(words) == 1:
        return [c + " " for c in COMMANDS if c.startswith(words[0])] if line.startswith("/") else []
    if len(words) == 2 and words[0] == "/set":
        return [f"/set {key} " for key in SETTABLE if key.startswith(words[1])]
    if len(words) == 2 and words[0] == "/tree":
        return [f"/tree {value}" for value in ("on", "off") if value.startswith(words[1])]
    if len(words) == 2 and words[0] in ("/save", "/load"):
        typed, home = words[1], os.path.expanduser("~")
        found = sorted(glob.glob(glob.escape(os.path.expanduser(typed)) + "*"))
        shown = [f"~{path[len(home):]}" if typed.startswith("~") and path.startswith(home) else path for path in found]
        return [f"{words[0]} {name}{'/' if os.path.isdir(path) else ''}" for name, path in zip(shown, found)]
    return []


def terminal_reader(console):
    """A line reader with editing, history (kept in history_file()) and Tab completion, where
    stdin and stdout are both a terminal and Python has readline (its prompt is written to stdout
    then, the same terminal); None elsewhere: piped input is read as it comes, and piped output
    receives only the answers."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    try:
        import readline
    except ImportError:  # Windows, or a Python built without it
        return None
    path = history_file()
    if path is not None:
        try:
            readline.read_history_file(str(path))
        except OSError:  # none yet, or unreadable: start afresh
            pass
    readline.set_history_length(HISTORY_LINES)
    readline.set_completer_delims("")  # the whole line is what completions() sees

    def complete(text: str, state: int) -> str | None:
        found = completions(text)
        return found[state] if state < len(found) else None

    readline.set_completer(complete)
    binding = "bind ^I rl_complete" if "libedit" in (readline.__doc__ or "") else "tab: complete"
    readline.parse_and_bind(binding)
    errors.wake_a_prompt_on_ending_signal()

    def read(prompt: str) -> str:
        console.file.flush()
        return input(prompt)

    def save() -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)  # what was typed is for this user's eyes only (as a shell's history)
            readline.write_history_file(str(path))
        except OSError as e:
            console.print(f"chat history not saved to {path}: {e.strerror or e}", style="dim", markup=False,
                          highlight=False)  # (a path may hold brackets)

    read.save = save
    return read


def run_chat(pair, profile, *, system: str | None, tree: bool, console, out=None, read_line=None,
             history: list[dict] | None = None) -> None:
    out = out or sys.stdout
    if isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8 comes in with its bytes escaped: refused
        sys.stdin.reconfigure(errors="surrogateescape")  # by encode_prompt in one line, the session going on
    session = ChatSession(pair, profile, system=system, tree=tree, history=list(history or []))

    def default_read(prompt: str) -> str:
        if sys.stdin.isatty():  # (a script's lines piped in are not asked for: no `you› you› ` on stderr)
            console.file.write(prompt)
            console.file.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    read_line = read_line or terminal_reader(console) or default_read
    try:
        _converse(session, pair, profile, console, out, read_line)
    finally:
        getattr(read_line, "save", lambda: None)()


def _converse(session, pair, profile, console, out, read_line) -> None:
    runtime = pair.runtimes.describe() if pair.runtimes else "transformers eager"
    if pair.placement and "target" in pair.placement:
        runtime += f" · target layers {describe_layers(pair.placement['target'])}"
    console.print(f"[dim]rsd chat · {pair.description} · {runtime} · {make_decoder(pair, profile).shape.describe()} · "
                  f"/help for commands, Ctrl-D to leave[/dim]")
    if not has_chat_template(pair.tokenizer):
        console.print("[dim](the target has no chat template: the conversation goes to it as plain text, each "
                      "message on a line after User: or Assistant:, and an answer ends where it starts the next "
                      "User: line)[/dim]")
    if session.history:
        console.print(f"[dim]resumed {counted(len(session.history), 'message')}[/dim]")
    while True:
        try:
            read = read_message(read_line)
        except KeyboardInterrupt:
            console.print("")
            if errors.ending_signal is not None:
                raise
            continue
        if read is None:
            if sys.stdin.isatty():  # (ends the prompt's line)
                console.print("")
            return
        message, block = read
        if not message.strip():
            continue
        try:
            if message.startswith("/") and not block:
                if not session.command(message.strip(), console, out):
                    return
            else:
                session.answer(message, out, console)
        except RsdError as e:
            console.print(f"error: {e}", style="red", markup=False, highlight=False)
