"""The terminal experience: chat, inspect-tree, the live view, and robustness."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rsd_cli.cli import app


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)


def test_chat_scripted_session(tiny_profile, tmp_path):
    saved = tmp_path / "conv.json"
    script = "\n".join([
        "hello there",
        "/set temperature 0",
        "/set temperature -1",
        "/set nonsense 3",
        "/set temprature 0.5",
        "/sve x.json",
        "/frobnicate",
        "/stats",
        "/tree off",
        "/system be brief",
        f"/save {tmp_path / 'no-such-dir' / 'x.json'}",
        '"""',
        "first line",
        "second line",
        '"""',
        f"/save {saved}",
        "/bye",
    ]) + "\n"
    result = invoke("chat", "-p", tiny_profile, "-n", "5", input=script)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "temperature = 0.0" in result.stderr
    assert "sampling.temperature must be a finite number, at least 0" in result.stderr  # an error, and the session goes on
    assert "usage: /set" in result.stderr
    assert "error: no setting 'temprature': did you mean /set temperature?" in result.stderr
    assert "error: unknown command /sve: did you mean /save?" in result.stderr
    assert "error: unknown command /frobnicate (try /help)" in result.stderr
    assert "block efficiency" in result.stderr  # /stats
    assert "cannot save to" in result.stderr
    stats = invoke("chat", "-p", tiny_profile, "-n", "5", "-v", "sd", "--draft-len", "2", input="hello\n/stats\n")
    said = [line for line in stats.stderr.splitlines() if "block efficiency" in line]
    assert said and said[0].startswith("sd γ=2 · ") and "shapes" not in said[0], stats.stderr  # (as generate says it)
    conversation = json.loads(saved.read_text())
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conversation["messages"][2]["content"] == "first line\nsecond line"
    assert conversation["system"] == "be brief"
    assert conversation["messages"][1]["content"] in result.stdout


def test_chat_retry_answers_the_last_message_again_and_undo_takes_it_back(tiny_profile, tmp_path, monkeypatch):
    """/retry answers the last message again (the answer it replaces leaves the conversation; at T=0 the
    same answer, with the settings now: max_tokens shorter), /undo takes back a message and its answer;
    either says so where there is nothing to do. An answer stopped with Ctrl-C is not in the
    conversation, and /retry asks its message again."""
    from rsd_cli import engine

    saved, undone = tmp_path / "retried.json", tmp_path / "undone.json"
    script = ["/retry", "/undo", "hello", "/retry", "/set max_tokens 2", "/retry", f"/save {saved}", "/undo",
              "/undo", f"/save {undone}"]
    result = invoke("chat", "-p", tiny_profile, "-n", "6", "-t", "0", input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.stderr
    assert "error: no message to answer again yet" in result.stderr
    assert "error: nothing to take back: the conversation holds no message yet" in result.stderr
    assert result.stderr.count("(again: 'hello')") == 2
    assert "took back 'hello' and its answer; 0 messages left" in result.stderr
    first, again, shorter = result.stdout.splitlines()
    assert first == again and first.startswith(shorter) and 0 < len(shorter) < len(first)
    messages = json.loads(saved.read_text())["messages"]
    assert messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": shorter}]
    assert json.loads(undone.read_text())["messages"] == []

    real_generate = engine.Decoder.generate
    calls = []

    def stopped_once(self, *args, **kwargs):
        calls.append(1)
        for i, event in enumerate(real_generate(self, *args, **kwargs)):
            if len(calls) == 2 and i == 1:  # (the second message's answer)
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(engine.Decoder, "generate", stopped_once)
    result = invoke("chat", "-p", tiny_profile, "-n", "6", "-t", "0",
                    input=f"hello\nhow are you\n/retry\n/save {saved}\n")
    assert result.exit_code == 0 and "(answer stopped)" in result.stderr, result.stderr
    assert "(again: 'how are you')" in result.stderr
    assert [m["content"] for m in json.loads(saved.read_text())["messages"][::2]] == ["hello", "how are you"]


def test_a_chat_block_beginning_with_a_slash_is_a_message_not_a_command(tiny_profile, tmp_path):
    """A \"\"\" block is sent as written: one whose first line began with "/" (a path pasted at its start)
    was run as a command, the whole block its argument ("unknown command /etc/hosts")."""
    saved = tmp_path / "c.json"
    script = '"""\n/etc/hosts lists the hosts\n/set temperature 5\n"""\n' + f"/save {saved}\n"
    result = invoke("chat", "-p", tiny_profile, "-n", "3", input=script)
    assert result.exit_code == 0 and "error" not in result.stderr, result.stderr
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0] == {"role": "user", "content": "/etc/hosts lists the hosts\n/set temperature 5"}
    assert [m["role"] for m in messages] == ["user", "assistant"]


def test_chat_sets_every_tree_setting_and_a_refused_one_changes_nothing(tiny_profile, tmp_path):
    """/set takes the tree settings the flags take (the shape each gives is shown); a value the
    profile or the shape refuses is an error that leaves the setting as it was, so the next
    answer is given (the tiny vocabulary has 40 tokens: a root cannot have 1000 children)."""
    saved = tmp_path / "c.json"
    script = "\n".join([
        "/set variant rsd-c", "/set branching 3,2", "/set branching 1000", "/set branching 3,x", "/set branching 3,,2", "/set budget 6",
        "/set budget 0", "/set variant rsd-s", "/set beam_width 0", "/set beam_width 2", "/set depth 3",
        "/set variant spectr", "/set num_drafts 2", "/set variant rsd-c", "hello", f"/save {saved}", "/bye",
    ]) + "\n"
    result = invoke("chat", "-p", tiny_profile, "-n", "5", "-t", "0", input=script)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    for line in ["branching = 3,2 · rsd-c b=(3,2)", "budget = 6 · rsd-c b=(1,1,1,1,1)",
                 "budget = 0 · rsd-c b=(3,2)", "beam_width = 2 · rsd-s W=2 L=4", "depth = 3 · rsd-s W=2 L=3",
                 "num_drafts = 2 · spectr K=2 L=3", "variant = rsd-c · rsd-c b=(3,2)",
                 "error: branching factor 1000 is larger than the vocabulary (40 tokens)",
                 "error: /set branching: '3,x' is not integers separated by commas, like 3,2,2",
                 "error: /set branching: '3,,2' has an empty item; it takes integers separated by commas, like 3,2,2",
                 "error: /set: decoding.beam_width must be at least 1 (got 0)"]:
        assert line in result.stderr
    assert result.stderr.count("error:") == 4
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["user", "assistant"]


@pytest.mark.parametrize("variant", ["ar", "sd"])
def test_chat_reads_only_what_is_new_in_the_conversation(tiny_profile, monkeypatch, variant):
    """Each answer's prompt is the whole conversation; the last answer's caches hold most of it, so
    only the rest is read, and the answer is the one a fresh decoder gives (greedy)."""
    from rsd_cli.chat import ChatSession
    from rsd_cli.engine import ChainExtension
    from rsd_cli.generation import complete
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.prompting import encode_prompt
    from rsd_cli.runtime import apply_flags, make_decoder

    profile = apply_flags(load_profile(str(tiny_profile)), {"variant": variant, "max_tokens": 8, "temperature": 0.0})
    session = ChatSession(load_pair(profile), profile)
    console = Console(file=io.StringIO())
    session.answer("hello", io.StringIO(), console)
    prompt = encode_prompt(session.pair.tokenizer, "and again", history=session.history)
    decoder = make_decoder(session.pair, profile)
    decoder.kept = session.kept
    unread = decoder.unread(prompt)  # what the "reading the prompt" line counts
    read = []
    real = ChainExtension.extend
    monkeypatch.setattr(ChainExtension, "extend",
                        lambda self, tokens, *a, **k: read.append(len(tokens)) or real(self, tokens, *a, **k))
    session.answer("and again", io.StringIO(), console)
    assert 0 < read[0] < len(prompt) - 10  # the target's prefill: the new message, not the conversation
    assert unread == read[0] + 1  # (+ the prompt's last token, read by the first step)
    monkeypatch.setattr(ChainExtension, "extend", real)
    fresh, _, _ = complete(make_decoder(session.pair, profile), prompt, 8, None)
    assert session.history[-1]["content"] == session.pair.tokenizer.decode(fresh, skip_special_tokens=True)


def test_chat_ends_on_end_of_input(tiny_profile):
    result = invoke("chat", "-p", tiny_profile, "-n", "3", input="hi\n")
    assert result.exit_code == 0 and result.stdout.strip()


def test_chat_clear_and_help(tiny_profile, tmp_path):
    saved = tmp_path / "c.json"
    result = invoke("chat", "-p", tiny_profile, "-n", "3", input=f"hi\n/clear\n/help\n/save {saved}\n/exit\n")
    assert result.exit_code == 0
    assert "/system TEXT" in result.stderr
    assert json.loads(saved.read_text())["messages"] == []
    from rsd_cli.chat import COMMANDS, HELP

    assert [c for c in COMMANDS if c not in HELP] == []  # /help lists every command there is


@pytest.mark.parametrize("leave", ["/bye", "/exit", "/quit"])
def test_chat_ends_on_each_leave_command(tiny_profile, leave):
    result = invoke("chat", "-p", tiny_profile, "-n", "3", input=f"{leave}\nhi\n")
    assert result.exit_code == 0 and result.stdout == ""  # left before "hi" was answered


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_session_goes_on(tiny_profile, tmp_path):
    """A line whose bytes are not UTF-8 ended the session with a UnicodeDecodeError (a UTF-8 locale's
    strict stdin), losing the conversation; now it is one error line, not sent, not kept."""
    saved = tmp_path / "c.json"
    result = invoke("chat", "-p", tiny_profile, "-n", "3", "-t", "0",
                    input=b"hi \xff there\nhello\n/save " + bytes(saved) + b"\n")
    assert result.exit_code == 0, result.stderr
    assert "error: the prompt is not valid UTF-8 (byte 3)" in result.stderr
    assert [m["content"] for m in json.loads(saved.read_text())["messages"]][0] == "hello"


def test_chat_keeps_answering_when_the_conversation_outgrows_the_context(tiny_profile, tmp_path):
    """The tiny model's context holds 256 tokens (~75 a message here): later answers are given on the
    latest messages that fit, said once; a message too long on its own is refused and not kept
    (every later message would fail with it); /save keeps the whole conversation."""
    saved = tmp_path / "c.json"
    message = " ".join(["hello world"] * 5)
    script = "\n".join([message] * 6 + ["word " * 400, "hi", f"/save {saved}", "/bye"]) + "\n"
    result = invoke("chat", "-p", tiny_profile, "-n", "8", input=script)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("the conversation outgrew the model's context of 256 tokens") == 1
    assert result.stderr.count("error:") == 1
    assert "error: this message needs 2005 tokens" in result.stderr and "not sent" in result.stderr
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 7
    assert messages[-2]["content"] == "hi" and all(m["content"] for m in messages[1::2])


def test_a_chat_answer_that_fails_leaves_its_message_out_of_the_conversation(tiny_profile, monkeypatch):
    """Otherwise the conversation would hold two user messages in a row, and a message that
    broke the answer (e.g. one the model cannot read) would break every later one."""
    from rsd_cli import chat
    from rsd_cli.errors import RsdError
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.runtime import apply_flags

    profile = apply_flags(load_profile(str(tiny_profile)), {"variant": "ar", "max_tokens": 4})
    session = chat.ChatSession(load_pair(profile), profile)
    console = Console(file=io.StringIO())
    session.answer("hello", io.StringIO(), console)
    real = chat.stream_completion

    def failing(*args, **kwargs):
        raise RsdError("the device ran out of memory")

    monkeypatch.setattr(chat, "stream_completion", failing)
    with pytest.raises(RsdError):
        session.answer("this one fails", io.StringIO(), console)
    assert [m["role"] for m in session.history] == ["user", "assistant"]
    monkeypatch.setattr(chat, "stream_completion", real)
    session.answer("and this one works", io.StringIO(), console)
    assert [m["content"] for m in session.history[::2]] == ["hello", "and this one works"]


def test_chat_window_starts_at_a_user_message_and_holds_what_fits(tiny_pair_dir):
    from rsd_cli.chat import ChatSession
    from rsd_cli.prompting import encode_prompt

    class Pair:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
        context_length = 256

    history = [{"role": "assistant", "content": "welcome"}]
    for n in range(8):
        history += [{"role": "user", "content": f"question {n} " * 5}, {"role": "assistant", "content": f"a{n} " * 4}]
    session = ChatSession(Pair(), {"sampling": {"max_tokens": 40}}, history=history)
    console = Console(file=io.StringIO(), width=200)
    assert len(encode_prompt(Pair.tokenizer, "last one", history=history)) + 40 > 256  # (it outgrew the context)
    ids = session.prompt_ids("last one", console)
    window = history[session.window:]
    assert 0 < session.window and window[0]["role"] == "user"
    assert ids == encode_prompt(Pair.tokenizer, "last one", history=window)
    # what is left takes at most half the context: one message pair more would not
    assert len(ids) <= 128 < len(encode_prompt(Pair.tokenizer, "last one", history=history[session.window - 2:]))
    assert "the latest %d of 17 kept" % len(window) in console.file.getvalue()
    first = session.window  # the next answers keep that window (their prompts begin as this one did)
    history += [{"role": "user", "content": "last one"}, {"role": "assistant", "content": "ok"}]
    assert session.prompt_ids("and one more", console)[:len(ids) - 8] == ids[:len(ids) - 8]
    assert session.window == first


def _read_until(fd: int, marker: bytes, timeout: float = 60) -> bytes:
    data = b""
    deadline = time.time() + timeout
    while marker not in data and time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return data


def _hangup_by_default():
    """SIGHUP's default in a child, whatever the suite runs under (`nohup make test` ignores it, and rsd keeps
    an ignored SIGHUP ignored, as it must)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextlib.contextmanager
def _chat_on_a_terminal(profile, config_dir):
    """`rsd chat` on a pseudo-terminal (stdin, stdout and stderr): yields the process and the terminal's other end."""
    primary, secondary = pty.openpty()
    env = dict(os.environ, RSD_CONFIG_DIR=str(config_dir), COLUMNS="60")
    proc = subprocess.Popen([sys.executable, "-m", "rsd_cli", "chat", "-p", str(profile), "-n", "4"],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True,
                            preexec_fn=_hangup_by_default)
    os.close(secondary)
    try:
        yield proc, primary
    finally:
        proc.kill()
        os.close(primary)


def test_chat_in_a_real_pseudo_terminal(tiny_profile, tmp_path):
    with _chat_on_a_terminal(tiny_profile, tmp_path) as (proc, primary):
        banner = _read_until(primary, "you› ".encode())
        assert b"rsd chat" in banner
        os.write(primary, b"hello\n")
        assert "you› ".encode() in _read_until(primary, "you› ".encode())
        os.write(primary, b"/bye\n")
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("signum, code, line", [(signal.SIGTERM, 143, b"rsd: terminated"),
                                                (signal.SIGHUP, 129, b"rsd: hung up")])
def test_sigterm_ends_a_chat_as_a_terminated_process(tiny_profile, tmp_path, signum, code, line):
    """SIGTERM (`kill`, a process manager) ended a chat at once, its exit code the signal's; now a chat
    waiting for a message ends with one line and exit code 143 (128 + 15), not as Ctrl-C, which goes on.
    SIGHUP sent while the terminal is still there (`kill -HUP`) too: 129, its line on the terminal."""
    with _chat_on_a_terminal(tiny_profile, tmp_path) as (proc, primary):
        assert b"rsd chat" in _read_until(primary, "you› ".encode())
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == code
        assert line in _read_until(primary, line)


def test_sigterm_that_lands_before_a_prompts_wait_still_ends_it():
    """readline writes the prompt, then waits in select(); a SIGTERM landing between the two only set
    Python's flag, nothing interrupted the wait, and a chat hung until a key was typed (CI, loaded: its
    SIGTERM test above hung 60 s; here under load 9 of 15 chats). Made certain below: SIGTERM is blocked
    in the main thread, so it lands on another and the main thread's read is never interrupted by it;
    the wakeup thread's SIGWINCH has to cut that read for the handler to run."""
    script = (
        "import os, readline, signal\n"
        "from rsd_cli import errors\n"
        "signal.signal(signal.SIGTERM, errors.end_on_signal)\n"
        "errors.wake_a_prompt_on_ending_signal()\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])\n"
        "never, _ = os.pipe()\n"
        "try:\n"
        "    print('waiting', flush=True)\n"  # (a loaded machine may take the signal here, before the read)
        "    os.read(never, 1)\n"
        "except KeyboardInterrupt:\n"
        "    print('ended by', errors.ending_signal, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == b"waiting\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out == f"ended by {int(signal.SIGTERM)}\n".encode() and proc.returncode == 0


def test_sigterm_keeps_what_was_generated_as_ctrl_c_does(tiny_profile, tmp_path):
    """`timeout 30 rsd generate --json ...` sends SIGTERM: the process died with nothing on stdout, not even
    the records of the completions already done. Now SIGTERM is taken as Ctrl-C: every finished record,
    then the cut one's ("finish_reason": "interrupted"), statistics on stderr, exit code 143 (128 + 15)."""
    env = dict(os.environ, RSD_CONFIG_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "rsd_cli", "generate", "hello", "-p", str(tiny_profile), "-v", "sd",
                             "--samples", "100000", "-n", "30", "--ignore-eos", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    try:
        first = proc.stdout.readline()  # (one completion written: the models are loaded and answering)
        proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert proc.returncode == 143, stderr.decode()
    assert stderr.decode().endswith("rsd: terminated\n") and b"Traceback" not in stderr
    assert all(record["finish_reason"] == "length" and len(record["token_ids"]) == 30 for record in records[:-1])
    # (the last: the completion the signal cut, or the last one done where it came between two)
    assert records[-1]["finish_reason"] in ("interrupted", "length") and len(records) < 100000
    last = len(records[-1]["token_ids"])
    assert last < 30 if records[-1]["finish_reason"] == "interrupted" else last == 30


def _on_a_terminal_that_hangs_up(argv, config_dir, *, stdout_on_it=False, stderr_on_it=True, ignore_hangup=False,
                                  env=None):
    """rsd with a pseudo-terminal as its controlling terminal (stdin, and stderr and stdout as said; else pipes):
    returns the process and the terminal's other end, whose closing hangs the terminal up (as closing
    a terminal window or losing an ssh connection does): the kernel sends SIGHUP."""
    import fcntl
    import termios

    def take_the_terminal():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hangup else signal.SIG_DFL)  # (SIG_IGN: as `nohup` does)

    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "rsd_cli", *map(str, argv)], stdin=secondary,
                            stdout=secondary if stdout_on_it else subprocess.PIPE,
                            stderr=secondary if stderr_on_it else subprocess.PIPE, start_new_session=True,
                            preexec_fn=take_the_terminal, close_fds=True,
                            env=dict(os.environ, RSD_CONFIG_DIR=str(config_dir), COLUMNS="60", **(env or {})))
    os.close(secondary)
    return proc, primary


def test_a_closed_terminal_keeps_what_was_generated_as_sigterm_does(tiny_profile, tmp_path):
    """Closing the terminal (a window, an ssh connection) sends SIGHUP, whose default ended
    `rsd generate --json ... > out.jsonl` with the cut completion's record lost. Now SIGHUP is taken as
    SIGTERM: every finished record, the cut one's, exit code 129 (128 + 1); its lines to the terminal,
    gone, are dropped instead of failing (a write to a hung-up terminal fails)."""
    proc, primary = _on_a_terminal_that_hangs_up(["generate", "hello", "-p", tiny_profile, "-v", "sd", "--samples",
                                                  "100000", "-n", "30", "--ignore-eos", "--json"], tmp_path)
    try:
        first = proc.stdout.readline()  # (one completion written: the models are loaded and answering)
        time.sleep(0.5)  # (some more, each with its line on the terminal)
        os.close(primary)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert proc.returncode == 129 and 1 < len(records) < 100000
    assert all(record["finish_reason"] == "length" and len(record["token_ids"]) == 30 for record in records[:-1])
    assert records[-1]["finish_reason"] in ("interrupted", "length")


def test_under_nohup_a_closed_terminal_does_not_end_rsd(tiny_profile, tmp_path):
    """`nohup rsd ...` ignores SIGHUP so that a run outlives its terminal: rsd keeps it ignored. Such a run (or
    one sent to the background and `disown`ed, which its shell sends no SIGHUP) whose stderr is still the closed
    terminal failed at its next line there (a write to a hung-up terminal fails: exit 1, the completions left
    lost); those lines are dropped now, and the run goes on to its end."""
    proc, primary = _on_a_terminal_that_hangs_up(["generate", "hello", "-p", tiny_profile, "-v", "sd", "--samples",
                                                  "20", "-n", "30", "--ignore-eos", "--json"], tmp_path,
                                                 ignore_hangup=True)
    try:
        first = proc.stdout.readline()  # (a statistics line on the terminal after each)
        os.close(primary)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert [json.loads(line)["finish_reason"] for line in (first + rest).decode().splitlines()] == ["length"] * 20


def test_a_closed_terminal_ends_a_chat_keeping_the_lines_typed(tiny_profile, tmp_path):
    """A chat whose terminal closed was killed by SIGHUP, and the lines typed in it were lost to the next
    session's Up (the history file is written as a chat ends). Now it ends as on SIGTERM, history kept."""
    history = tmp_path / "history"
    proc, primary = _on_a_terminal_that_hangs_up(["chat", "-p", tiny_profile, "-n", "3"], tmp_path, stdout_on_it=True,
                                                 env={"RSD_CHAT_HISTORY": str(history), "TERM": "xterm"})
    try:
        assert b"rsd chat" in _read_until(primary, "you› ".encode())
        os.write(primary, b"hello there\n")
        assert "you› ".encode() in _read_until(primary, "you› ".encode())
        os.close(primary)
        assert proc.wait(timeout=60) == 129
    finally:
        proc.kill()
    assert history.read_text().splitlines() == ["hello there"]


def test_chat_completes_commands_keys_and_the_paths_save_and_load_name(tmp_path, monkeypatch):
    from rsd_cli.chat import completions

    (tmp_path / "talk.json").write_text("{}")
    (tmp_path / "talks").mkdir()
    assert completions("/sa") == ["/save "] and completions("/set temp") == ["/set temperature "]
    assert completions("/tree o") == ["/tree on", "/tree off"] and completions("hello") == []
    assert completions(f"/load {tmp_path}/ta") == [f"/load {tmp_path}/talk.json", f"/load {tmp_path}/talks/"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert completions("/save ~/talk.") == ["/save ~/talk.json"]  # as typed, with ~


def test_chat_on_a_terminal_recalls_earlier_lines_and_completes_commands(tiny_profile, tmp_path):
    """On a terminal, lines are read with editing: Up recalls the last line (from this session,
    then from the history file the next session reads), Tab completes commands and /set's keys."""
    history, saved = tmp_path / "history", tmp_path / "c.json"
    env = dict(os.environ, RSD_CONFIG_DIR=str(tmp_path), RSD_CHAT_HISTORY=str(history), TERM="xterm", COLUMNS="80")

    def session(*typed: bytes) -> bytes:
        primary, secondary = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "rsd_cli", "chat", "-p", str(tiny_profile), "-n", "3"],
                                stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True)
        os.close(secondary)
        shown = b""
        try:
            shown += _read_until(primary, "you› ".encode())
            for keys in typed:
                os.write(primary, keys)
                shown += _read_until(primary, "you› ".encode())
            os.write(primary, b"/bye\n")
            assert proc.wait(timeout=60) == 0, shown
        finally:
            proc.kill()
            os.close(primary)
        return shown

    session(b"hello there\n", b"\x1b[A\n", b"/set tem\t0\n", f"/sa\t{saved}\n".encode())
    assert [m["content"] for m in json.loads(saved.read_text())["messages"][::2]] == ["hello there"] * 2
    assert history.stat().st_mode & 0o777 == 0o600  # readable by this user only
    import readline

    if readline._READLINE_LIBRARY_VERSION >= "8.1" and "libedit" not in (readline.__doc__ or ""):
        # a paste of several lines (the terminal brackets it) is one message, not one per line
        session(b"\x1b[200~first line\nsecond line\x1b[201~\n", f"/save {saved}\n".encode())
        assert [m["content"] for m in json.loads(saved.read_text())["messages"][::2]] == ["first line\nsecond line"]
    history.write_text("\n".join(history.read_text().splitlines()[:4]) + "\n")  # (the first session's lines)
    shown = session(b"/set max_tokens 2\n", b"\x1b[A\x1b[A\x1b[A\x1b[A\n", f"/save {saved}\n".encode())
    assert b"temperature = 0.0" in shown  # recalled from the first session: four lines up
    assert history.read_text().splitlines()[:5] == ["hello there", "/set temperature 0", f"/save {saved}", "/bye",
                                                    "/set max_tokens 2"]  # a line recalled as is: kept once


def test_inspect_tree_text_json_and_svg(tiny_profile, tmp_path):
    text = invoke("inspect-tree", "hello", "-p", tiny_profile, "-v", "rsd-c", "--branching", "3,2", "--step", "2",
                  input="")
    assert text.exit_code == 0, text.stderr
    assert "step 2 · rsd-c b=(3,2)" in text.stdout
    assert "●" in text.stdout and ("✓" in text.stdout or "✗" in text.stdout)
    assert "token:" in text.stdout  # the correction or bonus token

    as_json = invoke("inspect-tree", "hello", "-p", tiny_profile, "-v", "mss", "--branching", "3,2", "-f", "json",
                     input="")
    record = json.loads(as_json.stdout)
    assert record["step"] == 1 and record["nodes"][0]["status"] == "root"
    statuses = {n["status"] for n in record["nodes"][1:]}
    assert statuses <= {"accepted", "rejected", "not reached"}
    drafted = record["nodes"][1:]
    assert all(0 <= n["q"] <= 1 and 0 <= n["p"] <= 1 and n["draw_order"] >= 1 for n in drafted)
    bound = record["root_acceptance_optimal_transport_bound"]
    assert bound is not None and record["root_acceptance_this_tree"] <= 1 and 0 < bound <= 1
    for check in record["checks"]:
        for rejection in check["rejections"]:
            assert abs(sum(r["probability"] for r in rejection["residual_top"])) <= 1 + 1e-6
            assert all(r["bytes"] == list(r["text"].encode()) for r in rejection["residual_top"])
    assert all(n["bytes"] == list(n["text"].encode()) for n in record["nodes"] + [record["extra"]])  # (whole
    # characters, the tiny tokenizer's: their text's UTF-8)

    svg = tmp_path / "step.svg"
    result = invoke("inspect-tree", "hello", "-p", tiny_profile, "-f", "svg", "-o", svg, input="")
    assert result.exit_code == 0 and svg.read_text().lstrip().startswith("<svg")
    alone = tmp_path / "alone.svg"  # -o alone writes the SVG (it printed the text view, writing nothing)
    result = invoke("inspect-tree", "hello", "-p", tiny_profile, "-o", alone, input="")
    assert result.exit_code == 0 and alone.read_text() == svg.read_text() and result.stdout == ""
    result = invoke("inspect-tree", "hello", "-p", tiny_profile, "-f", "json", "-o", alone, input="")
    assert result.exit_code == 2 and "--output writes an SVG (--format svg); json goes to stdout" in result.stderr

    late = invoke("inspect-tree", "hello", "-p", tiny_profile, "--step", "500", input="")
    assert late.exit_code == 1 and "before step 500" in late.stderr


def test_optimal_transport_bound_for_one_draft_is_one_minus_total_variation():
    import torch

    from rsd_cli.inspect import optimal_root_acceptance

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.3, 0.3])
    assert optimal_root_acceptance(p, q, 1, iid=True) == pytest.approx(float(torch.minimum(p, q).sum()))
    # more i.i.d. drafts can only help
    assert optimal_root_acceptance(p, q, 3, iid=True) >= optimal_root_acceptance(p, q, 1, iid=True)


def test_tree_view_is_readable_at_20_columns_and_without_colour(tiny_pair_dir):
    from rsd_cli.drafting import make_shape
    from rsd_cli.engine import Decoder
    from rsd_cli.render import live_view, tree_view
    from rsd_cli.sampling import SamplingParams
    from rsd_cli.engine import Stats
    from tiny import tiny_model

    decoder = Decoder(tiny_model(40, 2, 0, 0.5), tiny_model(40, 1, 1, 0.5), 40, make_shape("rsd-s", beam_width=3, depth=2),
                      SamplingParams(1.0), set())
    event = next(decoder.generate([1, 5, 6], 10, seed=4))
    out = io.StringIO()
    console = Console(file=out, width=20, color_system=None)
    console.print(tree_view(event))
    console.print(live_view("some text", event, Stats()))
    text = out.getvalue()
    assert "\x1b[" not in text
    assert all(len(line) <= 20 for line in text.splitlines())
    markers = {"✓", "✗", "·"} & set(text)
    assert "●" in text and markers


def test_live_view_keeps_stdout_plain(tiny_profile):
    result = invoke("generate", "hello", "-p", tiny_profile, "--live", "-n", "8", input="", env={"COLUMNS": "20"})
    assert result.exit_code == 0, result.stderr
    assert "●" not in result.stdout and "\x1b[" not in result.stdout
    assert result.stdout.strip()


def test_the_live_view_says_the_prompt_is_being_read_until_the_first_step(monkeypatch):
    """A long prompt takes seconds to read (6 s for 4000 tokens on a 2-core CPU): the live view
    says so instead of showing nothing until the first step."""
    from rich.console import Console

    from rsd_cli import generation

    def slow_first_step(decoder, prompt_ids, *args):
        return [], generation.Stats(), []  # (the view is drawn at once, not at its next refresh)

    monkeypatch.setattr(generation, "complete", slow_first_step)
    console = Console(force_terminal=True, record=True, width=60, file=io.StringIO())
    pair = type("Pair", (), {"tokenizer": None})()
    monkeypatch.setattr(generation, "StopText", lambda tokenizer, *settings: type(
        "Text", (), {"flush": lambda self: "", "text": "", "matched": ""})())
    decoder = type("Decoder", (), {"unread": lambda self, prompt: len(prompt)})()
    generation.stream_completion(pair, decoder, list(range(1234)), 4, 0, out=io.StringIO(), console=console, live=True)
    assert "reading the prompt (1234 tokens)" in console.export_text()


@pytest.mark.parametrize("slow", [True, False])
def test_without_the_live_view_a_slow_prompt_read_is_noted_on_a_terminal(monkeypatch, slow):
    """`rsd chat` (no tree view by default): a prompt that takes a while to read gets a transient
    "reading the prompt" line, counting only what the kept caches do not hold; a quick one none."""
    from rsd_cli import generation

    console = Console(force_terminal=True, record=True, width=60, file=io.StringIO())

    def first_step_after_the_note(decoder, prompt_ids, *args):
        deadline = time.time() + (10 if slow else 0)
        while time.time() < deadline and "reading the prompt" not in console.export_text(clear=False):
            time.sleep(0.01)
        return [], generation.Stats(), []

    monkeypatch.setattr(generation, "complete", first_step_after_the_note)
    monkeypatch.setattr(generation, "READING_NOTE_DELAY", 0.05 if slow else 10)
    monkeypatch.setattr(generation, "StopText", lambda tokenizer, *settings: type(
        "Text", (), {"flush": lambda self: "", "text": "", "matched": ""})())
    pair = type("Pair", (), {"tokenizer": None})()
    decoder = type("Decoder", (), {"unread": lambda self, prompt: len(prompt) - 1000})()
    generation.stream_completion(pair, decoder, list(range(1234)), 4, 0, out=io.StringIO(), console=console,
                                 reading_note=True)
    assert ("reading the prompt (234 tokens)" in console.export_text()) == slow


def test_ctrl_c_during_model_load_and_during_generation(tiny_profile, monkeypatch):
    from rsd_cli import engine, models

    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(models, "load_pair", interrupted_load)
        result = invoke("generate", "hi", "-p", tiny_profile, input="")
    assert result.exit_code == 130 and "interrupted" in result.stderr and "Traceback" not in result.stderr

    real_generate = engine.Decoder.generate

    def interrupted_generate(self, *args, **kwargs):
        for i, event in enumerate(real_generate(self, *args, **kwargs)):
            if i == 2:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(engine.Decoder, "generate", interrupted_generate)
    result = invoke("generate", "hi", "-p", tiny_profile, "-n", "50", "-t", "0", input="")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert result.stdout.strip()  # what was generated before Ctrl-C is kept


def test_ctrl_c_keeps_what_was_generated_in_the_text_the_json_record_and_the_statistics(tiny_profile, monkeypatch):
    """Interrupted after 3 steps: the text streamed so far (a stop string's held-back start
    included), and with --json a record of those tokens with "finish_reason": "interrupted" (after
    the samples before it); exit code 130 either way. Interrupted before any step: an empty record.
    (Samples decoded together: test_cli.)"""
    from rsd_cli import engine

    common = ["-p", tiny_profile, "-n", "40", "-t", "0", "-v", "ar"]
    full = json.loads(invoke("generate", "hi", *common, "--json").stdout)
    real_generate = engine.Decoder.generate
    when = {"calls": 0, "interrupt_call": 1, "steps": 3}  # (ar: a token a step)

    def interrupted_generate(self, *args, **kwargs):
        when["calls"] += 1
        for i, event in enumerate(real_generate(self, *args, **kwargs)):
            if when["calls"] == when["interrupt_call"] and i == when["steps"]:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(engine.Decoder, "generate", interrupted_generate)
    result = invoke("generate", "hi", *common, "--json", "--logprobs", "2")
    assert result.exit_code == 130 and "rsd: interrupted" in result.stderr
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "interrupted" and record["token_ids"] == full["token_ids"][:3]
    assert record["stats"]["new_tokens"] == len(record["logprobs"]) == 3 and "3 steps · 3 tokens" in result.stderr
    when["calls"] = 0
    plain = invoke("generate", "hi", *common)
    assert plain.exit_code == 130 and plain.stdout == record["text"] + "\n"
    when["calls"] = 0  # a stop string whose start the text ends with is held back while streaming: released
    held = invoke("generate", "hi", *common, "--stop", record["text"][-1] + "~never printed~")
    assert held.exit_code == 130 and held.stdout == record["text"] + "\n"
    when.update(calls=0, interrupt_call=2)  # samples one after the other (a drafting variant's)
    samples = invoke("generate", "hi", *common, "--json", "--samples", "3", "-v", "sd")
    assert samples.exit_code == 130
    first, second = (json.loads(line) for line in samples.stdout.splitlines())
    assert first["finish_reason"] in ("length", "eos") and len(first["token_ids"]) > 3  # (a whole answer)
    assert second["finish_reason"] == "interrupted" and second["stats"]["steps"] == 3
    assert len(second["token_ids"]) == second["stats"]["new_tokens"] >= 3
    assert second["seed"] == first["seed"] + 1
    when.update(calls=0, interrupt_call=1, steps=0)
    result = invoke("generate", "hi", *common, "--json")
    record = json.loads(result.stdout)
    assert result.exit_code == 130 and record["token_ids"] == [] and record["finish_reason"] == "interrupted"
    assert "steps ·" not in result.stderr  # no statistics of no step


def test_closed_pipe_ends_quietly(tiny_profile, tmp_path):
    env = dict(os.environ, RSD_CONFIG_DIR=str(tmp_path))
    cmd = (f"{sys.executable} -m rsd_cli generate hello -p {tiny_profile} -n 200 -t 0 2>{tmp_path / 'err'} "
           f"| head -c 1; exit ${{PIPESTATUS[0]}}")
    result = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, stdin=subprocess.DEVNULL)
    assert len(result.stdout) == 1
    assert result.returncode == 0
    assert "Traceback" not in (tmp_path / "err").read_text()
    assert "Exception ignored" not in (tmp_path / "err").read_text()


def _rsd_with_closed(fds: str, *args, tmp_path):
    """rsd run by a shell that closed some of its standard streams first (`2>&-`, `<&-`, `>&-`)."""
    env = dict(os.environ, RSD_CONFIG_DIR=str(tmp_path))
    return subprocess.run(["sh", "-c", f'exec "$0" -m rsd_cli "$@" {fds}', sys.executable, *map(str, args)], env=env,
                          capture_output=True)


def test_closed_stderr_or_stdin_are_taken_as_the_null_device(tiny_profile, tmp_path):
    """`rsd generate ... 2>&-` printed the answer, then failed on the statistics (stderr is None in Python), exit 1;
    a C library's write to fd 2 (torch's warnings) would land in whatever file rsd had opened as fd 2. Closed
    standard streams are now the null device: the answer, exit 0; a closed stdin is an empty one."""
    args = ("generate", "hello", "-p", tiny_profile, "-n", "8", "-t", "0", "--ignore-eos")
    plain = _rsd_with_closed("", *args, tmp_path=tmp_path)
    assert plain.returncode == 0 and plain.stdout
    without_stderr = _rsd_with_closed("2>&-", *args, tmp_path=tmp_path)
    assert (without_stderr.returncode, without_stderr.stdout) == (0, plain.stdout)
    without_stdin = _rsd_with_closed("<&-", *args, tmp_path=tmp_path)
    assert (without_stdin.returncode, without_stdin.stdout) == (0, plain.stdout)
    prompt_from_closed_stdin = _rsd_with_closed("<&-", "generate", "-", "-p", tiny_profile, tmp_path=tmp_path)
    assert prompt_from_closed_stdin.returncode == 2
    assert prompt_from_closed_stdin.stderr.decode() == "rsd: error: the prompt is empty\n"
    chat = _rsd_with_closed("<&-", "chat", "-p", tiny_profile, tmp_path=tmp_path)
    assert chat.returncode == 0 and b"Traceback" not in chat.stderr


def test_a_closed_stdout_is_one_line_and_exit_1_before_any_work(tiny_profile, tmp_path):
    """`rsd generate ... >&-` failed with "AttributeError: 'NoneType' object has no attribute 'write'" and a
    traceback, after loading the models; as `echo hi >&-` fails, rsd says so in one line, before anything."""
    result = _rsd_with_closed(">&-", "generate", "hello", "-p", tiny_profile, "-n", "8", tmp_path=tmp_path)
    assert result.returncode == 1
    assert result.stderr.decode() == ("rsd: error: stdout is closed: what rsd writes there would be lost "
                                      "(>/dev/null discards it)\n")


def test_rsd_ends_without_python_s_teardown_but_runs_exit_hooks_and_keeps_output_and_codes(tiny_profile, tmp_path):
    """`rsd` skips Python's module teardown (0.2-0.5 s once torch is imported) with os._exit, after
    running the exit hooks and flushing stdout and stderr, with the app's exit code."""
    marker, torn_down = tmp_path / "hook-ran", tmp_path / "torn-down"
    script = ("import atexit, sys\n"
              f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
              "class Teardown:\n"  # (an object Python's teardown would destroy)
              f"    def __del__(self, _open=open): _open({str(torn_down)!r}, 'w').write('torn down')\n"
              "held = Teardown()\n"
              "sys.argv = ['rsd'] + sys.argv[1:]\n"
              "from rsd_cli.cli import main\n"
              "main()\n"
              "print('not reached')\n")
    env = dict(os.environ, RSD_CONFIG_DIR=str(tmp_path))

    def rsd(*args):
        return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)

    done = rsd("generate", "hello", "-p", str(tiny_profile), "-n", "3", "-t", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["new_tokens"] == 3 and "not reached" not in done.stdout
    assert marker.read_text() == "ran" and not torn_down.exists()
    marker.unlink()
    usage = rsd("generate", "hello", "-p", str(tiny_profile), "-n", "0")
    assert usage.returncode == 2 and "max_tokens must be at least 1" in usage.stderr and marker.exists()
    marker.unlink()
    failed = rsd("generate", "hello", "-p", str(tmp_path / "missing.toml"))
    assert failed.returncode == 1 and failed.stderr.startswith("rsd: ") and marker.exists()


def test_a_residual_top_line_wraps_between_its_tokens_never_inside_a_label(tiny_profile):
    """Rich wrapped "residual top: ' the' 0.31, …" at any space, cutting a token label (' the') in two at
    80 columns; the line now breaks between two token-probability pairs only."""
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.render import ItemsLine, token_label

    pairs = ["' the' 0.31", "' a b' 0.20", "'\\n' 0.10", "' of' 0.05"]
    console = Console(width=30, record=True, file=io.StringIO(), color_system=None)
    console.print(ItemsLine("rejected node 3; residual top:", pairs))
    assert console.export_text().splitlines() == ["rejected node 3; residual top:", "  ' the' 0.31, ' a b' 0.20,",
                                                  "  '\\n' 0.10, ' of' 0.05"]

    step = ["inspect-tree", "hello", "-p", tiny_profile, "-v", "mss", "--branching", "4,2", "--step", "1", "-t", "1"]
    shown = invoke(*step, env={"COLUMNS": "60"})
    assert shown.exit_code == 0, shown.stderr
    record = json.loads(invoke(*step, "-f", "json").stdout)
    tokenizer = load_pair(load_profile(str(tiny_profile))).tokenizer
    pairs = [f"{token_label(tokenizer, r['token'], 12)} {r['probability']:.2f}" for check in record["checks"]
             for rejection in check["rejections"] for r in rejection["residual_top"]]
    assert pairs, "the step rejected no draft: pick another seed"
    lines = shown.stdout.splitlines()
    assert all(any(pair in line for line in lines) for pair in pairs), shown.stdout
    assert max(map(len, lines)) <= 60


def test_inspect_tree_says_when_the_step_drafted_nothing(tiny_profile):
    """A step `lookup` (or `auto`) decoded plainly has a one-node tree: stderr says why, and which
    variants show a drafted one; a drafted step says nothing more."""
    plain = invoke("inspect-tree", "hello", "-p", tiny_profile, "-v", "lookup", "--raw", input="")
    assert plain.exit_code == 0, plain.stderr
    assert "step 1 · lookup" in plain.stdout and "1 node " in plain.stdout
    assert "step 1 drafted nothing (the context had no n-gram to look up); -v sd, rsd-c or rsd-s shows a drafted " \
           "tree" in plain.stderr
    drafted = invoke("inspect-tree", "hello", "-p", tiny_profile, "-v", "rsd-c", input="")
    assert drafted.exit_code == 0 and "drafted nothing" not in drafted.stderr


@pytest.mark.parametrize("variant", ["rsd-c", "auto"])
def test_the_per_step_table_fits_an_80_column_terminal_without_cutting_a_cell(tiny_profile, variant):
    """--stats on a terminal of 80 columns cut its cells ("accep…", "corre…", "b=(2,2…"): one shape is
    now said in the title, and where the steps' shapes differ (auto) the timings are left out, said so."""
    from rsd_cli.models import load_pair
    from rsd_cli.profiles import load_profile
    from rsd_cli.render import print_table, steps_table
    from rsd_cli.runtime import apply_flags, make_decoder

    profile = apply_flags(load_profile(str(tiny_profile)), {"variant": variant, "temperature": 0.0})
    pair = load_pair(profile)
    events = list(make_decoder(pair, profile).generate([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], 12, 0))
    console = Console(force_terminal=True, record=True, width=80, file=io.StringIO(), color_system=None)
    print_table(console, lambda width: steps_table(events, pair.tokenizer, width))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    assert "correction" in text or "bonus" in text
    if variant == "rsd-c":
        assert text.startswith("per-step statistics · shape rsd-c b=(2,2)") and "│ shape" not in text, text
    else:
        assert len({e.shape.describe() for e in events}) > 1 and "│ shape" not in text and "shape " in text
        assert "left out at this width: draft ms" in text, text
