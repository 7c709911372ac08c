class RsdError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


class UsageError(RsdError):
    """Bad command-line input; exit code 2."""


# The signal that ended the run, where one did (SIGTERM: `timeout`, `kill`, a process manager), or None. rsd
# treats it as Ctrl-C — what was generated is written out, --json records included — then exits 128 + its
# number; a chat ends instead of going on.
ending_signal: int | None = None


def end_on_signal(signum, frame) -> None:
    """A signal handler: raise KeyboardInterrupt, as Ctrl-C does, once; a second such signal ends the
    process at once (its default), for whoever sent it and would not wait."""
    import signal

    global ending_signal
    ending_signal = signum
    signal.signal(signum, signal.SIG_DFL)
    raise KeyboardInterrupt
