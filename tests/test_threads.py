"""The thread governor of forwards in the C library (rsd_cli/threads.py), on a simulated CPU whose
forwards take a time that depends on their threads and on what else runs."""

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rsd_cli import threads
from rsd_cli.threads import COST_SHARE, FIRST_WAIT, LONGEST_WAIT, UNJUDGED, USUAL, Governor

IDLE = {1: 0.016, 2: 0.010}  # seconds a forward, by threads: the 2-core Xeon's ratio alone
ONE_BUSY = {1: 0.018, 2: 0.040}  # beside one busy process: two threads wait on each other
TWO_BUSY = {1: 0.024, 2: 1.2}  # beside two: a two-thread forward waits out the scheduler at every barrier
ALONE: dict = {}  # the share of a forward's time its threads spend on the CPU, by threads (1 where not given)


class SimulatedCPU:
    """forward(threads) takes seconds[threads] on the simulated clock, within +-5%, its threads
    on the CPU share[threads] of that time."""

    def __init__(self, seconds: dict, share: dict = ALONE, seed: int = 0):
        self.seconds, self.share, self.now, self.cpu = seconds, share, 0.0, 0.0
        self.random = random.Random(seed)

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.cpu

    def forward(self, threads: int) -> int:
        seconds = self.seconds[threads] * (0.95 + 0.1 * self.random.random())
        self.now += seconds
        self.cpu += seconds * threads * self.share.get(threads, 1.0)
        return threads

    def governor(self, load=None) -> Governor:
        """A governor timing this CPU's forwards; load: what the system would say of its CPUs and
        other processes' running threads, or a function saying it at each look (None: nothing,
        whatever runs beside the tests)."""
        return Governor(clock=self.clock, cpu_clock=self.cpu_clock, load=load if callable(load) else lambda: load)


def run(governor: Governor, cpu: SimulatedCPU, forwards: int, key=("target", 1), most: int = 2) -> list[int]:
    return [governor.run(key, cpu.forward, most) for _ in range(forwards)]


def test_an_idle_cpu_keeps_every_thread_and_tries_fewer_ever_more_rarely():
    cpu = SimulatedCPU(IDLE)
    governor = cpu.governor()
    ran = run(governor, cpu, 5000)
    assert governor.threads == 2 and governor.switches == []
    tried = [i for i, threads in enumerate(ran) if threads == 1]
    assert tried[0] == USUAL  # the first trial, once there is a usual time to compare with
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    assert len(tried) <= 9 and gaps == sorted(gaps) and gaps[-1] >= 2048  # each trial lost: twice the wait
    lost = len(tried) * (IDLE[1] - IDLE[2])
    assert lost < 0.005 * cpu.now


def test_a_busy_process_beside_the_forwards_makes_them_run_on_fewer_threads_and_back_once_it_ends():
    """Its threads on the CPU 70% of the time (not starved: 0.5-0.78 measured), two threads slower:
    found by the trials alone."""
    cpu = SimulatedCPU(IDLE, {2: 0.7})
    governor = cpu.governor()
    run(governor, cpu, 200)
    cpu.seconds = ONE_BUSY  # another process takes a core
    ran = run(governor, cpu, 800)
    # the median of the last forwards doubles: fewer threads are tried at once, and win
    assert governor.switches == [(2, 1)] and ran[:12].count(1) >= 4 and set(ran[16:]) - {2} == {1}
    assert ran[16:].count(2) <= 6  # trials of two threads again, ever more rarely
    cpu.seconds = IDLE  # it ends
    chosen = []
    for _ in range(LONGEST_WAIT):
        governor.run(("target", 1), cpu.forward, 2)
        chosen.append(governor.threads)
    assert governor.switches == [(2, 1), (1, 2)] and chosen[-1] == 2
    assert chosen.index(2) <= 512  # at the next trial of two threads (4 lost before: 512 forwards apart)


def test_trials_beside_two_busy_processes_lose_at_most_a_small_share_of_the_time():
    """A two-thread forward beside two busy processes takes 50x a one-thread one: its trials wait
    long enough after each that the time they lose stays within COST_SHARE."""
    cpu = SimulatedCPU(TWO_BUSY)
    governor = cpu.governor()
    ran = run(governor, cpu, 20000)
    assert governor.threads == 1 and governor.switches == [(2, 1)]
    switched = ran.index(1)
    assert switched == USUAL  # the first trial
    slow = ran[switched:].count(2)  # trials of two threads after the switch
    lost = slow * (TWO_BUSY[2] - TWO_BUSY[1])
    assert 1 <= slow and lost <= 1.2 * COST_SHARE * cpu.now


def test_threads_that_do_not_get_the_cpu_are_halved_from_the_next_forward_on():
    """Beside two busy processes a two-thread forward's threads are on the CPU half its time, from
    the first forward (the prompt's) on: the next runs on one thread, without a trial. One thread
    starves too (it shares a core) but has no fewer to go to: its forwards still make the usual
    time that trials of two threads are judged against (each a second lost: rare)."""
    cpu = SimulatedCPU(TWO_BUSY, {1: 0.5, 2: 0.5})
    governor = cpu.governor()
    ran = run(governor, cpu, 2000)
    assert ran[:2] == [2, 1] and governor.switches == [(2, 1)] and 1 <= ran[2:].count(2) <= 3


def test_a_cpu_quota_halves_the_threads_until_they_get_the_cpu():
    """A container allowed two cores of eight: eight threads get a quarter of their time, four half;
    two run alone. Trials of four lose and grow rarer. (A forward of eight is judged alone, two of
    four together: STARVED_WINDOW.)"""
    quota = SimulatedCPU({8: 0.040, 4: 0.020, 2: 0.010, 1: 0.016}, {8: 0.25, 4: 0.5, 2: 1.0, 1: 1.0})
    governor = quota.governor()
    ran = run(governor, quota, 3000, most=8)
    assert ran[:4] == [8, 4, 4, 2] and governor.switches == [(8, 4), (4, 2)] and governor.threads == 2
    assert ran[4:].count(4) <= 12 and 8 not in ran[4:]


def test_more_threads_that_starve_lose_their_trials_at_once():
    """Two threads faster by the clock but off the CPU half their time: each trial of them stops
    once its forwards have run STARVED_WINDOW together (the third or fourth of 10 ms, before it can
    win), and they are tried ever more rarely."""
    import itertools

    cpu = SimulatedCPU(IDLE, {1: 1.0, 2: 0.5})
    governor = cpu.governor()
    ran = run(governor, cpu, 20000)
    trials = [len(list(run_)) for threads, run_ in itertools.groupby(ran[3:]) if threads == 2]
    assert governor.switches == [(2, 1)] and 2 <= len(trials) <= 12 and max(trials) <= 4


class Ticked(SimulatedCPU):
    """An idle 2-core AMD EPYC, as measured: a forward of the embedded model takes 2.5 ms on two threads,
    3.6 ms on one, each thread on the CPU all the time; but the process's CPU clock counts the second
    thread's time only at the scheduler's ticks, 4 ms apart (a 250 Hz kernel)."""

    TICK = 0.004

    def __init__(self):
        super().__init__({1: 0.0036, 2: 0.0025})
        self.others = 0.0  # the other threads' time, as it was spent

    def cpu_clock(self) -> float:
        return self.cpu + self.TICK * int(self.others / self.TICK)

    def forward(self, threads: int) -> int:
        seconds = self.seconds[threads] * (0.95 + 0.1 * self.random.random())
        self.now += seconds
        self.cpu += seconds
        self.others += seconds * (threads - 1)
        return threads


def test_forwards_shorter_than_the_cpu_clock_s_ticks_keep_their_threads():
    """Judged one at a time, such a forward's threads read 0.5 or 1.3 of its time on the CPU: the first
    that read 0.5 halved the threads (at the answer's first token), and every trial of two threads
    after began with one more (lost), so the answers ran on one thread, 0.65x (227 tokens a second
    against 348 with RSD_ADAPTIVE_THREADS=0). Judged over STARVED_WINDOW, they keep both."""
    cpu = Ticked()
    governor = cpu.governor()
    ran = run(governor, cpu, 5000)
    assert governor.switches == [] and governor.threads == 2 and ran.count(1) <= 40  # (trials of one, lost)


class Bimodal(SimulatedCPU):
    """Beside two busy processes, as measured: most two-thread forwards take 15 ms, their threads on
    the CPU, but every fifth waits out the scheduler for 1.2 s, half its time off it."""

    def __init__(self):
        super().__init__({1: 0.020})
        self.twos = self.collapses = 0

    def forward(self, threads: int) -> int:
        if threads == 1:
            return super().forward(1)
        self.twos += 1
        collapsed = self.twos % 5 == 0
        self.collapses += collapsed
        seconds = 1.2 if collapsed else 0.015
        self.now += seconds
        self.cpu += seconds * threads * (0.5 if collapsed else 1.0)
        return threads


def test_time_lost_to_more_threads_that_win_a_trial_and_then_collapse_stays_a_small_share():
    cpu = Bimodal()
    governor = cpu.governor()
    run(governor, cpu, 20000)
    assert governor.threads == 1 and (1, 2) in governor.switches  # (trials won, then starved)
    assert 1.2 * cpu.collapses <= 1.5 * COST_SHARE * cpu.now + 1.2


@pytest.mark.parametrize("cpus, busy, most, first", [(2, 2, 2, 1), (2, 1, 2, 1), (2, 0, 2, 2), (16, 5, 16, 8),
                                                     (16, 13, 16, 2), (4, 9, 4, 1)])
def test_the_first_forwards_run_on_as_many_threads_as_other_processes_leave_cpus(cpus, busy, most, first):
    """Beside busy processes the first forward (the prompt's) can wait out the scheduler on every
    thread (beside two on the 2-core Xeon: 1.2 s on two threads in some runs): it starts on the
    CPUs other processes' running threads leave, halving; more are tried after FIRST_WAIT forwards,
    not at once."""
    cpu = SimulatedCPU({1: 0.016, 2: 0.010, 4: 0.006, 8: 0.004, 16: 0.003})
    looks = []
    governor = cpu.governor(load=lambda: (cpus, 0) if looks else looks.append(1) or (cpus, busy))  # (they end after it)
    ran = run(governor, cpu, FIRST_WAIT + 10, most=most)
    assert ran[0] == first
    if first < most:
        assert max(ran[:FIRST_WAIT]) == first and governor.threads == 2 * first  # (more threads won)


def test_more_threads_are_not_tried_while_other_processes_leave_no_cpu_for_them():
    """A trial of more threads beside busy processes would starve (one forward of torch's layers beside
    one on the 2-core Xeon took a second): while the system says the CPUs are taken none is run, and
    the looks grow rarer; once the processes end, more threads are tried and win."""
    cpu = SimulatedCPU(ONE_BUSY)
    load = {"busy": 1}
    looks = []
    governor = cpu.governor(load=lambda: looks.append(getattr(governor, "count", 0)) or (2, load["busy"]))
    ran = run(governor, cpu, 5000)
    assert set(ran) == {1} and governor.switches == [] and governor.lost == 0
    gaps = [b - a for a, b in zip(looks[1:], looks[2:])]  # (the first look: the first forward's threads)
    assert gaps == sorted(gaps) and gaps[-1] >= 2048 and len(looks) <= 10
    load["busy"] = 0
    cpu.seconds = IDLE
    chosen = []
    for _ in range(LONGEST_WAIT):
        governor.run(("target", 1), cpu.forward, 2)
        chosen.append(governor.threads)
    assert governor.switches == [(1, 2)] and chosen[-1] == 2


def test_no_trials_while_held_and_none_judged_without_a_usual_time():
    cpu = SimulatedCPU(IDLE)
    governor = cpu.governor()
    with governor.held():
        ran = run(governor, cpu, 300)
        cpu.seconds = ONE_BUSY
        ran += run(governor, cpu, 300)
    assert set(ran) == {2} and governor.switches == []
    # a trial begins after a forward of a size seen USUAL times; where the forwards that follow are of
    # sizes never seen before (prompts), it has nothing to compare them with and ends after UNJUDGED
    cpu.seconds = IDLE
    governor = cpu.governor()
    ran = run(governor, cpu, USUAL)
    ran += [governor.run(("target", 100 + i), cpu.forward, 2) for i in range(40)]
    assert ran[USUAL:USUAL + UNJUDGED] == [1] * UNJUDGED and set(ran[USUAL + UNJUDGED:]) == {2}
    assert governor.switches == [] and governor.wait[-1] == FIRST_WAIT  # (not a lost trial)


def test_a_new_thread_count_from_the_user_starts_afresh():
    cpu = SimulatedCPU(ONE_BUSY)
    governor = cpu.governor()
    run(governor, cpu, 100)
    assert governor.threads == 1
    cpu.seconds = {**ONE_BUSY, 4: 0.006}
    assert run(governor, cpu, 1, most=4) == [4] and governor.threads == 4


class Alternating(Governor):
    """A governor that runs forwards on one thread and two in turn, and says what it ran (the keys)
    and on how many threads (test_blocks and test_compiled use it too)."""

    def __init__(self):
        super().__init__(load=lambda: None)
        self.keys, self.chosen = [], []

    def run(self, key, forward, most: int):
        self.keys.append(key)
        return super().run(key, forward, most)

    def _choose(self) -> int:
        self.chosen.append(1 + len(self.chosen) % 2)
        return self.chosen[-1]


def test_the_maths_between_forwards_runs_on_one_thread_and_torch_forwards_on_all(monkeypatch):
    """one_thread_maths runs each step of a generator with torch on one thread and gives the
    caller's count back between steps, after the last and when closed; run_on_torch gives a
    forward inside it the caller's count (RSD_ADAPTIVE_THREADS=0), or the governor's; cpu_threads
    names the caller's count throughout."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "GOVERNOR", Alternating())
    try:
        seen = []

        def steps():
            for _ in range(3):
                seen.append((torch.get_num_threads(), threads.cpu_threads()))
                threads.run_on_torch("key", lambda: seen.append((torch.get_num_threads(), threads.cpu_threads())))
                yield len(seen)

        monkeypatch.setenv("RSD_ADAPTIVE_THREADS", "0")
        between = [torch.get_num_threads() for _ in threads.one_thread_maths(steps())]
        assert seen == [(1, 2), (2, 2)] * 3 and between == [2, 2, 2] and torch.get_num_threads() == 2
        monkeypatch.delenv("RSD_ADAPTIVE_THREADS")
        seen.clear()
        list(threads.one_thread_maths(steps()))
        assert seen == [(1, 2), (1, 2), (1, 2), (2, 2), (1, 2), (1, 2)]  # (the governor's 1, 2, 1 inside)
        seen.clear()
        threads.run_on_torch("key", lambda: seen.append((torch.get_num_threads(), threads.cpu_threads())),
                             on_cpu=False)  # (a GPU's forward: the caller's count)
        assert seen == [(2, 2)] and torch.get_num_threads() == 2
        events = threads.one_thread_maths(steps())
        next(events)
        events.close()
        assert torch.get_num_threads() == 2 and threads.cpu_threads() == 2

        def failing():
            yield 1
            raise ValueError("a step that fails")

        with pytest.raises(ValueError):
            list(threads.one_thread_maths(failing()))
        assert torch.get_num_threads() == 2 and threads.cpu_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="Linux's /proc")
def test_the_system_counts_a_busy_process_beside_this_one_and_not_this_ones_threads():
    alone = threads.system_load()
    assert alone is not None and alone[0] >= 1
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        beside = threads.system_load()
    finally:
        busy.kill()
        busy.wait()
    assert beside[1] >= 1 and beside[0] == alone[0]


def test_a_forward_that_compiles_says_nothing_of_its_threads(monkeypatch):
    """A forward that compiles a graph (a token count's first, a compiled graph read back from the
    cache) takes hundreds of milliseconds mostly on one thread: measured as a forward, its threads
    would look starved and be halved (on a CPU, fewer threads than the graphs were compiled for run
    the layers uncompiled). Such forwards are neither starving nor a usual time: the threads stay."""
    graphs = {"count": 0}
    monkeypatch.setattr(threads, "compiles", lambda: graphs["count"])

    def compiling(cpu: SimulatedCPU):
        def forward(threads_: int) -> int:
            graphs["count"] += 1
            cpu.now += 0.3  # (the compiler, on one thread of the two)
            cpu.cpu += 0.3
            return threads_
        return forward

    cpu = SimulatedCPU(IDLE)
    governor = cpu.governor()
    for _ in range(3):
        governor.run(("target", 8), compiling(cpu), 2)
        run(governor, cpu, 50)
    assert governor.switches == [] and governor.threads == 2
    monkeypatch.setattr(threads, "compiles", lambda: 0)  # (the same forward, its compiling not seen: starving)
    cpu = SimulatedCPU(IDLE)
    governor = cpu.governor()
    governor.run(("target", 8), compiling(cpu), 2)
    assert governor.switches == [(2, 1)]
