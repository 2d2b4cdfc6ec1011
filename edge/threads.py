"""How many threads edge's kernels use: fewer while other processes keep cores busy.

Why: edge's numba kernels run parallel loops (prange) on numba's OpenMP threading layer, which
splits every loop statically across the threads and ends it at a barrier; a decode step runs
some 150-200 such loops. When another process keeps a core busy, the OS deschedules one of
edge's threads for a time slice (milliseconds) again and again, every loop waits for it while
the other thread spins at the barrier, and decode collapses: on 2 cores, beside one busy-loop
process, gemma-3-270m decode fell from about 105 to 23 tokens/s (4 beside a compile) and
qwen2.5-coder-0.5b from 62 to 18, where one thread keeps 64 and 42 (README, Speed).
Handing out work dynamically does not help here (numba's OpenMP `omp for` is static whatever
the chunk size, a descheduled thread still holds the barrier), the TBB layer is slower on an
idle machine, and libgomp's wait-policy settings trade idle speed for contended speed.

So :class:`AdaptiveThreads` measures how many cores other processes keep busy and runs the
kernels on ``min(threads asked, cpus - round(others))`` threads, at least one, re-deciding
every ``interval`` seconds (checked between layers, so a long prefill adapts too). "Others" is
the busy CPU time of the CPUs this process may run on (/proc/stat: user, nice, system, irq,
softirq, steal) minus this process's own CPU time (getrusage), over the last interval. That
figure does not depend on how many threads edge runs, so no probing is needed: the full
thread count comes back in the first interval after the other load stops. On an idle machine
the only cost is a clock read per layer and a /proc/stat read (about 20 us) per interval.

Never more threads than the caller asked for: the count numba had on the calling thread when
the caller last set it (:func:`use_threads`, e.g. ``-t``) is the ceiling, per thread, as
numba's own setting is. Off with EDGE_ADAPTIVE_THREADS=0 (the thread count then stays as set),
and off where /proc/stat cannot be read (not Linux).
"""
from __future__ import annotations

import math
import os
import resource
import threading
import time
from collections.abc import Callable

ENV_VAR = "EDGE_ADAPTIVE_THREADS"
DEFAULT_INTERVAL = 0.1      # seconds between decisions
DEFAULT_THRESHOLD = 0.5     # a core counts as taken when others use at least this much of it


def read_busy_seconds(cpus: tuple[int, ...]) -> float | None:
    """CPU seconds the CPUs ``cpus`` have spent busy since boot (user + nice + system + irq +
    softirq + steal, from /proc/stat's per-CPU lines; steal is time the hypervisor gave to
    others). None when /proc/stat cannot be read or lacks a CPU."""
    want = {f"cpu{c}" for c in cpus}
    ticks = 0
    found = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                parts = line.split()
                if parts[0].decode() in want:
                    v = parts[1:9]
                    ticks += int(v[0]) + int(v[1]) + int(v[2]) + int(v[5]) + int(v[6]) + int(v[7])
                    found += 1
    except (OSError, ValueError, IndexError):
        return None
    if found != len(want):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def read_self_seconds() -> float:
    """CPU seconds this process has used (all threads, user + system), from getrusage."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _allowed_cpus() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _numba_get() -> int:
    import numba
    return numba.get_num_threads()


def use_threads(n: int | None) -> None:
    """Set numba's thread count for the calling thread: the one place edge sets it.

    Args:
        n: threads for the kernels the calling thread runs, clamped to
            numba.config.NUMBA_NUM_THREADS (the size of numba's pool); None leaves numba's
            setting as it is.
    Raises:
        ValueError: n < 1.
    """
    if n is None:
        return
    if n < 1:
        raise ValueError(f"the thread count must be at least 1, got {n}")
    import numba
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class AdaptiveThreads:
    """The thread-count policy of one model's forward passes (see the module docstring).

    Args:
        enabled: False keeps numba's thread count as the caller set it (apply() does nothing).
        cpus: the CPUs this process may run on (default: its affinity mask).
        interval: seconds between decisions.
        threshold: the share of a core other processes must use for it to count as taken.
        clock, read_busy, read_self, get_threads, set_threads: the time source (seconds), the
            busy CPU seconds of ``cpus`` (None: unknown), this process's CPU seconds, and
            numba's per-thread get/set; replaced by fakes in tests.

    The caller of a forward pass (edge.generate.forward) calls :meth:`apply` before it and passes
    :meth:`check` as the model's per-layer callback; :attr:`limit` is the current ceiling from
    other processes' load (None: no limit), :attr:`others` the cores they used in the last
    interval. Not thread-safe across concurrent forwards of one model (a forward is not
    reentrant anyway); different threads calling in turn each keep their own ceiling.
    """

    def __init__(self, enabled: bool = True, cpus: tuple[int, ...] | None = None,
                 interval: float = DEFAULT_INTERVAL, threshold: float = DEFAULT_THRESHOLD,
                 clock: Callable[[], float] = time.monotonic,
                 read_busy: Callable[[tuple[int, ...]], float | None] = read_busy_seconds,
                 read_self: Callable[[], float] = read_self_seconds,
                 get_threads: Callable[[], int] = _numba_get,
                 set_threads: Callable[[int], None] = use_threads):
        self.cpus = tuple(cpus) if cpus is not None else _allowed_cpus()
        self.interval = interval
        self.threshold = threshold
        self._clock, self._read_busy, self._read_self = clock, read_busy, read_self
        self._get, self._set = get_threads, set_threads
        self._local = threading.local()
        self.limit: int | None = None
        self.others: float | None = None
        self._last = self._sample()            # (clock, busy seconds, self seconds) or None
        self._due = self._clock() + interval
        self.enabled = bool(enabled) and self._last is not None

    @classmethod
    def from_env(cls) -> "AdaptiveThreads":
        """The default policy: on unless EDGE_ADAPTIVE_THREADS is 0, off, false or no."""
        value = os.environ.get(ENV_VAR, "1").strip().lower()
        return cls(enabled=value not in ("0", "off", "false", "no"))

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._read_busy(self.cpus)
        return None if busy is None else (self._clock(), busy, self._read_self())

    def update(self) -> int | None:
        """Re-decide :attr:`limit` when ``interval`` has passed since the last decision; returns
        it. The cores taken by others are ``floor(others + 1 - threshold)``, ``others`` being
        their CPU seconds per second over the interval; the limit is the CPUs minus those, at
        least 1, or None when none is taken."""
        now = self._clock()
        if now < self._due:
            return self.limit
        self._due = now + self.interval
        prev, cur = self._last, self._sample()
        self._last = cur
        if prev is None or cur is None or cur[0] <= prev[0]:
            self.limit = None                  # nothing to compare with: no limit
            return None
        self.others = max(0.0, ((cur[1] - prev[1]) - (cur[2] - prev[2])) / (cur[0] - prev[0]))
        taken = math.floor(self.others + 1.0 - self.threshold)
        self.limit = max(1, len(self.cpus) - taken) if taken > 0 else None
        return self.limit

    def check(self, layer: int = -1) -> None:
        """apply() if a decision is due (cheap otherwise: one clock read). Between layers: the
        model calls it as ``layer_callback(layer)`` before each layer (``layer`` is unused)."""
        if self.enabled and self._clock() >= self._due:
            self.apply()

    def apply(self) -> None:
        """Set the calling thread's numba thread count to min(what its caller asked, limit).

        Call before running kernels (before each forward pass; :meth:`check` between layers). What the
        caller asked is numba's count on this thread whenever it differs from what apply()
        last set there (the caller changed it, or the thread is new)."""
        if not self.enabled:
            return
        limit = self.update()
        tl = self._local
        current = self._get()
        if current != getattr(tl, "applied", None):
            tl.asked = current
        want = tl.asked if limit is None else min(tl.asked, limit)
        if want != current:
            self._set(want)
        tl.applied = want
