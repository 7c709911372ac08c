"""How many threads a forward on the CPU runs on: torch's count, fewer while the CPU is shared.

A forward of the C layers is one OpenMP region with a few hundred barriers. Where another process
holds a core, a thread that reaches a barrier spins while the thread it waits for is not
scheduled: on the 2-core Xeon, `rsd generate` beside one busy process made 32 tokens a second
instead of 114, beside two 0.8, where one thread made 69 and 45
(benchmarks/results/intel-xeon-busy-cpu). Beside one, most two-thread forwards took 15 ms (7
alone) and one in ten 90-180 ms: the scheduler's time slice, waited out at a barrier. A forward on
torch's layers (a model without quantised blocks, transformers' forward) is hundreds of OpenMP
regions, and fared worse: 2.9 tokens a second beside one busy process (1.5-5.4) instead of 29.3,
where one thread made 17.2 (benchmarks/results/intel-xeon-torch-threads).

So the `Governor` times every forward, and the CPU time the process had during it. Where the
forwards' threads had less than 60% of the time they would have had alone (beside two busy
processes 50% from the first forward on; alone at least 70% on the 2-core Xeon), judged over 30
ms of them at least (the CPU clock counts another thread's time at the scheduler's ticks:
STARVED_WINDOW), the next forwards run on half as many. Now and then it runs a few on half the
threads (or, after halving, twice as many): where those take clearly less time than the mean of
the last forwards of the same model and size on the current count (spikes and all: they are the
cost), their count becomes the one used. A trial stops at its first forwards once they have cost
more than the usual time; it is tried again after twice as many forwards, and after enough that
the time trials lose stays under 2% of the forwards' (a two-thread trial beside two busy processes
costs a second). Where the median of a model's last forwards doubles or halves (a process started
or ended beside them), trials start again at once, against those forwards. The first forward runs
on as many threads as the CPUs other processes' running threads leave (Linux's /proc), halving:
beside two busy processes the prompt's forward on two threads took 1.2 s in some runs (0.17-0.3 s
in others).

A trial of more threads is not run while other processes' running threads leave the CPUs for
fewer (it would starve: on torch's layers one such forward took a second); it counts as lost.

A forward's result in the C library does not depend on its threads (each output is summed by one
thread, in an order of its own; tests/test_blocks.py), so the choice changes the time only, never a
token. On torch's layers it can change a product's last bits (torch's GEMM of 4-8 rows on a
576-wide weight sums in another order on two threads than on one). `RSD_ADAPTIVE_THREADS=0` keeps
torch's count. Compiled CPU graphs hold the thread count they were compiled for in their code: they
run where the governor chooses the CPU's count, and where it chooses fewer the same layers run
uncompiled (compiled, beside one busy process `ar` made 1.3 tokens a second on the 2-core Xeon).

While forwards run on the CPU, the engine's own maths (probabilities, draws,
verification: torch operations on a few rows of the vocabulary) runs on one thread
(`one_thread_maths`): on several, each is an OpenMP region of its own, whose threads beside a busy
process wait as the layers' do (a step's maths took 6.5 ms there instead of 1), and whose sums over
the vocabulary round differently for each thread count; on one they are the same bits whatever else
runs. A forward on torch's layers inside it runs on the governor's count (`run_on_torch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import statistics
import time
from collections import Counter, deque
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

T = TypeVar("T")

KEPT = 32  # a key's last forwards on the current threads, whose mean is its usual time
USUAL = 2  # the fewest forwards a usual time is taken over (beside busy processes a forward can take a second)
LAST = 8  # a key's last forwards, whose median shows a change
CHANGE = 2.0  # the last forwards' median this many times (or 1 / this) what it was: trials start again
TRIAL = 4  # forwards a trial is judged over
WIN = 0.85  # a trial's forwards must take at most this share of their usual time, together
FIRST_WAIT = 32  # forwards between trials at first, after a switch and after a change
LONGEST_WAIT = 4096  # forwards between two trials of a direction at most
COST_SHARE = 0.02  # the time trials lose, as a share of the forwards' time, at most (over MEMORY forwards)
MEMORY = 1000  # forwards over which that is weighed (both sums shrink by 1 / MEMORY a forward)
UNJUDGED = 2  # a trial's forwards without a usual time to compare with, before it ends unjudged
STARVED = 0.6  # forwards whose threads had less than this share of their time on the CPU: fewer threads
# the seconds of forwards on one count that share is judged over, at least: the process's CPU clock
# counts another thread's time only at the scheduler's ticks (4 ms apart on a 250 Hz kernel), so one
# forward of 2.5 ms on two threads read 0.5 or 1.3 of its time on an idle 2-core AMD EPYC, was
# "starved" at the first forward of the answer, and never got its second thread back (0.65x); over
# 15 ms an `sd` answer's forwards still read under 0.6 now and then (a tiny draft's forwards among them)
STARVED_WINDOW = 0.03


@dataclasses.dataclass
class Trial:
    threads: int
    direction: int  # -1: fewer threads than now, +1: more
    forwards: int = 0
    judged: int = 0  # forwards compared with their usual time
    seconds: float = 0.0  # those forwards' time
    usual: float = 0.0  # and the usual time of each, summed


class Governor:
    """Chooses the threads of each forward (`run`) from the times of the forwards before it,
    between 1 and `most`, halving or doubling."""

    def __init__(self, clock=time.perf_counter, cpu_clock=time.process_time, load=None):
        self.clock, self.cpu_clock = clock, cpu_clock  # wall time, and the process's CPU time
        self.load = load or system_load  # () -> (the CPUs this process may use, other processes' threads running) or None
        self.most = 0
        self.threads = 0
        self.switches: list[tuple[int, int]] = []  # (from, to) threads, in order
        self.holding = False  # no trials (while forwards are timed for auto's costs)

    def _reset(self, most: int) -> None:
        self.most = self.threads = most
        known = self.load()
        if known is not None:  # as many threads as the CPUs other processes leave, halving (at least one)
            cpus, busy = known
            while self.threads > 1 and self.threads > cpus - busy:
                self.threads //= 2
        self.recent: dict = {}  # key -> deque of the last KEPT seconds on self.threads
        self.baseline: dict = {}  # key -> the median of its LAST forwards when last set (a change: CHANGE)
        self.count = 0  # forwards run
        self.wait = {-1: FIRST_WAIT, 1: FIRST_WAIT}  # forwards between a direction's trials
        self.starved_wait = FIRST_WAIT // 2  # forwards before more threads are tried after starving (doubling)
        # the count at which each direction is tried next (more threads than other processes leave
        # CPUs for: later, a trial beside busy processes can take a second)
        self.due = {-1: USUAL, 1: USUAL if self.threads == most else FIRST_WAIT}
        self.trial: Trial | None = None
        self.last_key = None  # the key of the last forward (the next one's, most likely)
        self.spent = 0.0  # the forwards' seconds (shrinking by 1 / MEMORY a forward)
        self.lost = 0.0  # the seconds trials lost (shrinking alike)
        self.fallback: float | None = None  # after more threads won a trial: a forward's time before
        self.window = [0, 0.0, 0.0]  # (threads, wall seconds, CPU seconds) of the forwards _starving judges next

    def run(self, key, forward, most: int):
        """forward(threads)'s result, timed: key names what it runs (a model and a token count),
        whose forwards' times are compared with each other only; most: the threads at most."""
        if most != self.most:
            self._reset(most)
        threads = self._choose()
        compiled = compiles()
        start, cpu = self.clock(), self.cpu_clock()
        result = forward(threads)
        seconds = self.clock() - start
        if compiles() != compiled:  # (a graph compiled or loaded inside: the compiler's time, mostly on one
            return result  # thread, says nothing of the threads': neither a usual time, a trial's, nor starving)
        starved = self._starving(threads, seconds, self.cpu_clock() - cpu)
        self._record(key, threads, seconds, starved)
        return result

    def _starving(self, threads: int, seconds: float, cpu: float) -> bool:
        """Whether the forwards on `threads` up to this one starve: their threads on the CPU less than
        STARVED of the time, judged once they have run STARVED_WINDOW seconds together (one long
        forward at once), then afresh; the count changed, afresh at once."""
        if self.window[0] != threads:
            self.window = [threads, 0.0, 0.0]
        self.window[1] += seconds
        self.window[2] += cpu
        if self.window[1] < STARVED_WINDOW:
            return False
        _, wall, used = self.window
        self.window = [threads, 0.0, 0.0]
        return used < STARVED * threads * wall

    @contextlib.contextmanager
    def held(self):
        """No trials inside: every forward on the threads chosen before (forwards timed to compare
        their sizes' costs must all run on the same count)."""
        holding, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = holding

    def _option(self, direction: int) -> int | None:
        threads = self.threads // 2 if direction < 0 else min(self.most, self.threads * 2)
        return threads if 1 <= threads != self.threads else None

    def _choose(self) -> int:
        if (self.trial is None and not self.holding and len(self.recent.get(self.last_key, ())) >= USUAL
                and self.lost <= COST_SHARE * self.spent):
            for direction in (-1, 1):
                threads = self._option(direction)
                if threads and self.count >= self.due[direction]:
                    if direction > 0 and not self._room_for(threads):  # (it would lose: nothing run, the wait doubles)
                        self._end(Trial(threads, direction), lost=True)
                        continue
                    self.trial = Trial(threads, direction)
                    break
        return self.trial.threads if self.trial and not self.holding else self.threads

    def _room_for(self, threads: int) -> bool:
        """Whether other processes' running threads leave this many CPUs free (unknown: True). A trial of
        more threads where they do not would starve, and one forward of it can cost a second (torch's
        layers beside a busy process on the 2-core Xeon)."""
        known = self.load()
        return known is None or known[0] - known[1] >= threads

    def _record(self, key, threads: int, seconds: float, starved: bool) -> None:
        self.count += 1
        self.last_key = key
        self.spent = self.spent * (1 - 1 / MEMORY) + seconds
        self.lost *= 1 - 1 / MEMORY
        recent = self.recent.setdefault(key, deque(maxlen=KEPT))
        trial = self.trial
        if trial is None or threads != trial.threads:
            if self.fallback is not None:  # the first forward on a count that won a trial
                if starved:  # (what it lost counts as a trial's)
                    self.lost += max(seconds - self.fallback, 0.0)
                self.fallback = None
            if starved and threads == self.threads and self._starved():
                return
            recent.append(seconds)
            self._watch(key, recent)
            return
        trial.forwards += 1
        if len(recent) < USUAL:  # nothing to compare with (a size not seen lately)
            if trial.forwards >= UNJUDGED:
                self._end(trial, lost=False)
            return
        trial.judged += 1
        trial.seconds += seconds
        trial.usual += sum(recent) / len(recent)
        if trial.seconds > trial.usual or starved and trial.direction > 0:
            self._end(trial, lost=True)
        elif trial.judged >= TRIAL:
            if trial.seconds < WIN * trial.usual:
                self.fallback = trial.usual / trial.judged if trial.direction > 0 else None
                self._switch(trial.threads)
            else:
                self._end(trial, lost=True)

    def _watch(self, key, recent: deque) -> None:
        """Trials at once where this key's last forwards' median has moved by CHANGE, against them."""
        if len(recent) < LAST:
            return
        last = list(recent)[-LAST:]
        now = statistics.median(last)
        before = self.baseline.setdefault(key, now)
        if now > CHANGE * before or now * CHANGE < before:
            self.baseline[key] = now
            recent.clear()
            recent.extend(last)
            self.wait = {-1: FIRST_WAIT, 1: FIRST_WAIT}
            self.due = {direction: min(due, self.count) for direction, due in self.due.items()}

    def _end(self, trial: Trial, lost: bool) -> None:
        """A trial over without a switch: where it lost, its direction waits twice as long, and what
        it lost counts against COST_SHARE."""
        self.trial = None
        direction = trial.direction
        if lost:
            self.wait[direction] = min(2 * self.wait[direction], LONGEST_WAIT)
            self.lost += max(trial.seconds - trial.usual, 0.0)
        self.due[direction] = self.count + self.wait[direction]

    def _starved(self) -> bool:
        """Half the threads from the next forward on, where a forward's threads did not get the CPU
        to themselves (False: one thread already, or held); more are tried again after twice the
        wait before (a count that wins a trial but then starves again is tried ever more rarely)."""
        fewer = self._option(-1)
        if fewer is None or self.holding:
            return False
        self.starved_wait = min(2 * self.starved_wait, LONGEST_WAIT)
        self._switch(fewer)
        self.wait[1], self.due[1] = self.starved_wait, self.count + self.starved_wait
        return True

    def _switch(self, threads: int) -> None:
        self.switches.append((self.threads, threads))
        self.threads, self.trial = threads, None
        self.recent.clear()
        self.baseline.clear()
        self.wait = {-1: FIRST_WAIT, 1: FIRST_WAIT}
        self.due = {-1: self.count + FIRST_WAIT, 1: self.count + FIRST_WAIT}


def compiles() -> int:
    """How many graphs torch.compile has made in this process (compiled, or read back from its
    cache): a forward during which this grows spent its time compiling. 0 where torch's compiler
    was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


def system_load() -> tuple[int, int] | None:
    """(the CPUs this process may run on, the threads of other processes running or ready to run:
    the fewest of three looks 1 ms apart, a busy process's thread being in each) on Linux, else None.
    (Not the load average: back-to-back runs of rsd itself keep it near 1 on two idle cores.)"""
    try:
        cpus = len(os.sched_getaffinity(0))
        fewest = None
        for look in range(3):
            if look:
                time.sleep(0.001)
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            ours = sum(_running(task) for task in Path("/proc/self/task").iterdir())
            fewest = running - ours if fewest is None else min(fewest, running - ours)
        return cpus, max(fewest, 0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _running(task: Path) -> bool:
    """Whether a thread of this process (its /proc/self/task folder) is running or ready to."""
    try:
        return (task / "stat").read_text().rpartition(")")[2].split()[0] == "R"
    except (OSError, IndexError):
        return False


GOVERNOR = Governor()  # one for the process: every model's forwards share the CPU


def adaptive() -> bool:
    """Whether forwards on the CPU choose their threads (RSD_ADAPTIVE_THREADS=0: never)."""
    return os.environ.get("RSD_ADAPTIVE_THREADS", "1").strip() != "0"


_outside: int | None = None  # torch's threads outside `one_thread_maths`, while inside it


def cpu_threads() -> int:
    """The threads the CPU's work may use: torch's count, outside the engine's one-thread maths."""
    return _outside or torch.get_num_threads()


@contextlib.contextmanager
def _torch_on(threads: int, outside: int | None):
    global _outside
    before, before_outside = torch.get_num_threads(), _outside
    torch.set_num_threads(threads)
    _outside = outside
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _outside = before_outside


def one_thread_maths(events: Iterator) -> Iterator:
    """events (a generator), each step run with torch on one thread; the caller's count between them."""
    try:
        while True:
            outside = cpu_threads()
            lower = outside > 1 and _outside is None and _openmp()
            with _torch_on(1, outside) if lower else contextlib.nullcontext():
                try:
                    event = next(events)
                except StopIteration as stop:
                    return stop.value
            yield event
    finally:
        events.close()


@functools.cache
def _openmp() -> bool:
    """Whether torch's threads are OpenMP's, whose count may change at any time (torch's own pool
    warns at a change after its first parallel work)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


_every_thread = False  # inside every_thread()


@contextlib.contextmanager
def every_thread():
    """Forwards inside run on the CPU's count, not the governor's: compiling graphs (whose code is
    compiled for a thread count) and timing runtimes against each other."""
    global _every_thread
    before, _every_thread = _every_thread, True
    try:
        yield
    finally:
        _every_thread = before


def _governed(most: int) -> bool:
    return most > 1 and adaptive() and not _every_thread


def run_in_c(key, forward: Callable[[int], T], chosen: bool = True) -> T:
    """forward(threads): a forward in rsd's C library (key: its model and token count), on the
    threads the governor chooses (RSD_ADAPTIVE_THREADS=0, one CPU, every_thread or not `chosen`: the
    CPU's count). Counted in FORWARDS."""
    most = cpu_threads()
    if chosen and _governed(most):
        return GOVERNOR.run(key, _counted(forward, governed=True), most)
    return _counted(forward)(most)


def run_on_torch(key, work: Callable[[], T], on_cpu: bool = True) -> T:
    """work(): a forward's work on torch (its layers, a prompt's products; key: its model and token
    count), with torch on the threads the governor chooses where torch's count may change (OpenMP),
    else on the CPU's count, also inside `one_thread_maths`. Inside, cpu_threads() stays the CPU's
    count (kernel verdicts are kept per that count; compiled graphs run only on it). on_cpu=False
    (a GPU's forward): torch's count, not counted in FORWARDS."""
    most = cpu_threads()
    if not on_cpu:
        with _torch_on(most, None) if _outside is not None else contextlib.nullcontext():
            return work()

    def forward(threads: int) -> T:
        with on_threads(threads):
            return work()

    return run_in_c(key, forward, chosen=_openmp())  # (the same choice and count, on torch's threads)


def on_threads(threads: int):
    """A context: torch on `threads` threads, cpu_threads() inside still the CPU's count (kernel
    verdicts are kept per that count)."""
    return _torch_on(threads, cpu_threads())


# the CPU forwards this process ran, by their threads: for the governor's, the count it kept (a trial of
# another count, a few forwards now and then, is counted under the kept one)
FORWARDS: Counter = Counter()


def _counted(forward: Callable[[int], T], governed: bool = False) -> Callable[[int], T]:
    def counted(threads: int) -> T:
        FORWARDS[GOVERNOR.threads if governed else threads] += 1
        return forward(threads)

    return counted
