"""Two ``transformers`` trainers in one process, taking turns one optimizer step at a time.

A small per-step overhead cannot be read off two whole runs made one after the other on a shared machine: the
neighbours' load drifts by tens of percent from one second to the next, and it hits the two runs differently.
Here each trainer runs ``train()`` in its own thread, and a turn token lets exactly one of them run at a time,
handed over at every ``on_step_begin``. Step i of one arm and step i of the other run back to back, so a drift slower
than a step hits both alike, and the pair of step times compares like with like.

Each arm gets the random stream it would get alone: its setup (``train()`` up to its first step) runs by itself
after ``set_seed``, and the global random states (Python, numpy, torch) are swapped at every hand-over, outside the
timed part. With the same seed both arms then sample the same rollouts, as two separate runs would; the guard draws
no random numbers. Per step, an arm's slice runs from taking the turn to handing it over (the next ``on_step_begin``,
or the end of ``train()``): wall time (``perf_counter``) and this thread's CPU time (``thread_time``).

With ``cpu`` given, both arms' threads run on that one CPU (Linux). Left to the scheduler, each thread keeps to the
CPU it last ran on, so one arm can spend a whole pair on a CPU whose neighbours are busier than the other's: A/A
pairs (both arms unguarded) read 0.96-1.14 per pair here unpinned, 0.95-1.01 pinned. Only one arm runs at a time, so
sharing a CPU takes nothing from either; it suits single-threaded arms only (an arm's worker threads would share it).
"""

from __future__ import annotations

import os
import threading
import time

from transformers import TrainerCallback, set_seed

from rl_guard.control.state import rng_state, set_rng_state


class Lockstep:
    def __init__(self, arms: int = 2, cpu: int | None = None):
        self.arms, self.cpu = arms, cpu
        self._cv = threading.Condition()
        self._turn: int | None = None  # None: setups still running, one at a time
        self._done = [False] * arms
        self._ready = [False] * arms
        self.callbacks = [_Turns(self, arm) for arm in range(arms)]

    def run(self, trainers, seed: int, first: int = 0) -> None:
        """``trainer.train()`` for every trainer, in turns; ``first``: which arm takes the first step."""
        order = [first] + [a for a in range(self.arms) if a != first]
        threads, errors = [], []
        for arm in order:  # setups one at a time, each from the seed, as a run alone would have it
            set_seed(seed)
            thread = threading.Thread(target=self._train, args=(trainers[arm], arm, errors), daemon=True)
            threads.append(thread)
            thread.start()
            with self._cv:
                self._cv.wait_for(lambda arm=arm: self._ready[arm])  # ready at its first step, or done (it failed)
        with self._cv:
            self._turn = first if not self._done[first] else self._next(first)
            self._cv.notify_all()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _train(self, trainer, arm: int, errors: list) -> None:
        try:
            if self.cpu is not None:
                os.sched_setaffinity(0, {self.cpu})  # 0: this thread only
            trainer.train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            with self._cv:
                self._done[arm] = self._ready[arm] = True
                if self._turn == arm or self._turn is None:
                    self._turn = self._next(arm)
                self._cv.notify_all()

    def _next(self, arm: int):
        """The next arm after ``arm`` that has steps left (``arm`` itself if it is the last one)."""
        for k in range(1, self.arms + 1):
            other = (arm + k) % self.arms
            if not self._done[other]:
                return other
        return None

    def _hand_over(self, arm: int) -> None:
        with self._cv:
            if self._turn is None:  # this arm's setup is over: it waits for the others'
                self._ready[arm] = True
            else:
                self._turn = self._next(arm)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == arm)


def shared_cpu() -> int | None:
    """A CPU both arms can share (the lowest this process may use), or None where threads cannot be pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return min(os.sched_getaffinity(0))


class Sequential:
    """The arms one after the other, each a whole ``train()`` in the calling thread, as a user runs one trainer: the
    way to see what depends on the thread that drives the trainer (torch's OpenMP workers and BLAS's threads belong to
    it), which ``Lockstep``'s one thread per arm changes. Drift of the machine's load between the runs is not
    cancelled: compare several pairs, and their order alternated. Same callbacks and timing as ``Lockstep``."""

    def __init__(self, arms: int = 2):
        self.arms = arms
        self.callbacks = [_Turns(self, arm) for arm in range(arms)]

    def run(self, trainers, seed: int, first: int = 0) -> None:
        for arm in [first] + [a for a in range(self.arms) if a != first]:
            set_seed(seed)
            trainers[arm].train()

    def _hand_over(self, arm: int) -> None:  # one arm at a time already
        pass


class _Turns(TrainerCallback):
    """The arm's side: hands the turn over at every step's start and times its own slices."""

    def __init__(self, lockstep: Lockstep, arm: int):
        self.lockstep, self.arm = lockstep, arm
        self.spans: list[tuple[float, float]] = []  # perf_counter at the start and the end of each slice
        self.cpu: list[float] = []
        self._rng = None
        self._start: tuple[float, float] | None = None

    @property
    def wall(self) -> list[float]:
        return [end - start for start, end in self.spans]

    def _end_slice(self) -> None:
        if self._start is not None:
            self.spans.append((self._start[0], time.perf_counter()))
            self.cpu.append(time.thread_time() - self._start[1])
            self._start = None
        self._rng = rng_state()

    def on_step_begin(self, args, state, control, **kwargs):
        self._end_slice()
        self.lockstep._hand_over(self.arm)
        set_rng_state(self._rng)
        self._start = (time.perf_counter(), time.thread_time())

    def on_train_end(self, args, state, control, **kwargs):
        self._end_slice()
