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


def wake_a_prompt_on_ending_signal() -> None:
    """Let SIGTERM end a readline prompt whenever it lands (chat, on a terminal). readline writes its
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
            if caught and caught[0] == signal.SIGTERM:
                for _ in range(100):  # (5 s: the main thread may be in a forward, which no signal cuts)
                    time.sleep(0.05)
                    if ending_signal is not None:
                        break
                    signal.pthread_kill(main, signal.SIGWINCH)

    threading.Thread(target=wake, name="rsd-wake-prompt", daemon=True).start()
