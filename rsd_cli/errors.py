class RsdError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


class UsageError(RsdError):
    """Bad command-line input; exit code 2."""


# The signal that ended the run, where one did (SIGTERM: `timeout`, `kill`, a process manager; SIGHUP: the
# terminal closed), or None. rsd treats it as Ctrl-C — what was generated is written out, --json records
# included — then exits 128 + its number; a chat ends instead of going on.
ending_signal: int | None = None


def take_ending_signals() -> None:
    """Take SIGTERM, and SIGHUP unless it is ignored (`nohup`: the run is to outlive its terminal), as Ctrl-C."""
    import signal

    signal.signal(signal.SIGTERM, end_on_signal)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, end_on_signal)


def leave_ending_signals() -> None:
    """Their defaults again (the answer is out: such a signal now just ends the process)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is end_on_signal:
            signal.signal(signum, signal.SIG_DFL)


def ended_by() -> str:
    """What ended the run, in the words of the line rsd leaves: terminated (SIGTERM), hung up (SIGHUP)."""
    import signal

    return "hung up" if ending_signal == signal.SIGHUP else "terminated"


def end_on_signal(signum, frame) -> None:
    """A signal handler: raise KeyboardInterrupt, as Ctrl-C does, once; a second such signal ends the
    process at once (its default), for whoever sent it and would not wait."""
    import signal

    global ending_signal
    ending_signal = signum
    signal.signal(signum, signal.SIG_DFL)
    if signum == signal.SIGHUP:
        drop_what_goes_to_a_hung_up_terminal()
    raise KeyboardInterrupt


def point_at_null(fd: int) -> None:
    """Descriptor fd opened on the null device (what it held, if anything, closed)."""
    import os

    null = os.open(os.devnull, os.O_RDWR)  # (where fd is closed and the lowest free: fd itself)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def hung_up(code: int | None) -> bool:
    """Whether an I/O error's number is a hung-up terminal's (EIO; ENXIO on BSDs)."""
    import errno

    return code in (errno.EIO, errno.ENXIO)


def drop_what_goes_to_a_hung_up_terminal() -> None:
    """A terminal that hung up fails every write (EIO): the standard streams still on it are pointed at
    the null device, so the lines left to write there go nowhere and what goes elsewhere (records to a
    file or pipe, a history file) is still written. A terminal still there (`kill -HUP`) is kept."""
    import termios

    for fd in (0, 1, 2):
        try:
            termios.tcgetattr(fd)  # (a terminal still there)
        except termios.error as e:
            if hung_up(e.args[0]):  # (not ENOTTY: a file or pipe; nor EBADF: closed)
                point_at_null(fd)


def wake_a_prompt_on_ending_signal() -> None:
    """Let SIGTERM (or SIGHUP) end a readline prompt whenever it lands (chat, on a terminal). readline writes its
    prompt, then waits in select() on stdin, and only an interrupted select runs Python's signal
    handlers: a signal landing between the two (likely on a loaded machine, where the prompt's
    write hands the CPU to the terminal) only set Python's flag, and the chat hung until a key. The
    C handler also writes the signal's number to a wakeup pipe; a thread reading it interrupts the
    main thread with SIGWINCH (readline's resize handler: a redraw at most) until the handler has
    run. Call it from the main thread, once readline is loaded."""
    import os
    import signal
    import threading
    import time

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main = threading.main_thread().ident

    def wake() -> None:
        while True:
            caught = os.read(read_end, 1)
            if caught and caught[0] in (signal.SIGTERM, signal.SIGHUP):
                for _ in range(100):  # (5 s: the main thread may be in a forward, which no signal cuts)
                    time.sleep(0.05)
                    if ending_signal is not None:
                        break
                    signal.pthread_kill(main, signal.SIGWINCH)

    threading.Thread(target=wake, name="rsd-wake-prompt", daemon=True).start()


class OutlivesItsTerminal:
    """A standard stream on a terminal whose writes outlive the terminal: one that hung up (closed, with
    the run under `nohup` or `disown`ed, so no SIGHUP ended it) fails every write with EIO, which would end
    the run at its next line of statistics; such writes are dropped instead (the streams still on it are
    pointed at the null device) and the run goes on, writing what goes elsewhere (a file, a pipe)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _outlived(self, error: OSError) -> bool:
        if not hung_up(error.errno):
            return False
        drop_what_goes_to_a_hung_up_terminal()
        return True

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            if not self._outlived(e):
                raise
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if not self._outlived(e):
                raise
            self._stream.flush()  # (what it held, now to the null device)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def outlive_the_terminal() -> None:
    """sys.stdout and sys.stderr, where they are a terminal, as OutlivesItsTerminal."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            on_a_terminal = stream.isatty()
        except (AttributeError, ValueError):
            continue
        if on_a_terminal:
            setattr(sys, name, OutlivesItsTerminal(stream))
