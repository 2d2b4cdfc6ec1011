"""edge.threads.AdaptiveThreads: the thread count under other processes' load, decided from fake
clocks and CPU counters (no timing), and its place in the forward pass."""
import threading

import numba
import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.generate import forward
from edge.models import load_model
from edge.threads import AdaptiveThreads, read_busy_seconds, read_self_seconds, use_threads


class FakeMachine:
    """A clock, /proc/stat busy seconds of the CPUs, this process's CPU seconds, and numba's
    per-thread count (one value: the tests call from one thread unless they say otherwise)."""

    def __init__(self):
        self.t = 100.0
        self.busy = 5000.0
        self.mine = 40.0
        self.threads = 2
        self.sets: list[int] = []

    def run(self, seconds: float, mine: float, others: float) -> None:
        """``seconds`` pass; this process uses ``mine`` cores, other processes ``others``."""
        self.t += seconds
        self.mine += mine * seconds
        self.busy += (mine + others) * seconds

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def policy(self, cpus=(0, 1), **kw) -> AdaptiveThreads:
        return AdaptiveThreads(cpus=cpus, interval=0.1, clock=lambda: self.t,
                               read_busy=lambda c: self.busy, read_self=lambda: self.mine,
                               get_threads=lambda: self.threads, set_threads=self.set, **kw)


def test_drops_to_one_thread_while_another_process_keeps_a_core_and_comes_back():
    m = FakeMachine()
    p = m.policy()
    p.apply()                              # no interval passed yet: nothing measured, no change
    assert (p.limit, m.threads, m.sets) == (None, 2, [])
    m.run(0.1, mine=1.99, others=0.01)     # idle machine: edge alone
    p.apply()
    assert p.others == pytest.approx(0.01) and p.limit is None and m.threads == 2
    m.run(0.1, mine=1.33, others=0.67)     # a busy loop starts: CFS gives it 2/3 of a core
    p.apply()
    assert p.others == pytest.approx(0.67) and p.limit == 1 and m.sets == [1]
    m.run(0.05, mine=1.0, others=1.0)      # within the interval: no new decision
    p.check()
    assert m.sets == [1]
    m.run(0.05, mine=1.0, others=1.0)
    p.check()                              # at 1 thread the busy loop shows as a whole core
    assert p.others == pytest.approx(1.0) and p.limit == 1 and m.sets == [1]
    m.run(0.1, mine=1.0, others=0.0)       # the load stops: back in the next interval, no probing
    p.apply()
    assert p.limit is None and m.sets == [1, 2] and m.threads == 2


def test_cores_taken_round_at_the_threshold_and_at_least_one_thread_stays():
    m = FakeMachine()
    m.threads = 8
    p = m.policy(cpus=tuple(range(8)))
    for others, limit in [(0.45, None), (0.55, 7), (1.4, 7), (1.6, 6), (7.9, 1), (12.0, 1), (0.0, None)]:
        m.run(0.1, mine=1.0, others=others)
        p.apply()
        assert p.limit == limit, others
        assert m.threads == (8 if limit is None else limit)


def test_never_more_threads_than_the_caller_asked():
    m = FakeMachine()
    p = m.policy()
    m.threads = 1                          # the caller asked for one thread (-t 1)
    m.run(0.1, mine=1.0, others=1.0)
    p.apply()
    assert p.limit == 1 and m.sets == []
    m.run(0.1, mine=1.0, others=0.0)       # load gone: still the caller's 1, not the CPU count
    p.apply()
    assert p.limit is None and m.threads == 1 and m.sets == []
    m.run(0.1, mine=1.0, others=1.0)
    p.apply()
    m.threads = 2                          # the caller raises it while the limit holds: capped
    p.apply()
    assert m.threads == 1 and m.sets == [1]
    m.run(0.1, mine=1.0, others=0.0)
    p.apply()                              # ... and gets its 2 when the load goes
    assert m.threads == 2 and m.sets == [1, 2]


def test_off_by_env_or_without_proc_stat(monkeypatch):
    m = FakeMachine()
    off = m.policy(enabled=False)
    m.run(0.1, mine=1.0, others=1.0)
    off.apply()
    assert m.sets == [] and off.limit is None
    blind = AdaptiveThreads(cpus=(0, 1), read_busy=lambda c: None, get_threads=lambda: 2,
                            set_threads=m.set)
    assert not blind.enabled
    monkeypatch.setenv("EDGE_ADAPTIVE_THREADS", "0")
    assert not AdaptiveThreads.from_env().enabled
    monkeypatch.setenv("EDGE_ADAPTIVE_THREADS", "1")
    assert AdaptiveThreads.from_env().enabled == (read_busy_seconds((0,)) is not None)


def test_readers_give_plausible_seconds():
    busy = read_busy_seconds((0,))
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0 and read_self_seconds() > 0
    assert read_busy_seconds((0, 10**6)) is None       # a CPU the machine does not have


def test_each_thread_keeps_its_own_ceiling():
    """numba's count is per thread: a server's scheduler thread asked 1, the main thread 2."""
    m = FakeMachine()
    counts = {}

    def get():
        return counts.setdefault(threading.get_ident(), 2)

    def put(n):
        counts[threading.get_ident()] = n

    p = AdaptiveThreads(cpus=(0, 1), interval=0.1, clock=lambda: m.t, read_busy=lambda c: m.busy,
                        read_self=lambda: m.mine, get_threads=get, set_threads=put)
    m.run(0.1, mine=1.0, others=0.0)
    p.apply()

    def worker():
        put(1)
        p.apply()
        seen.append(get())
    seen = []
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1] and get() == 2


def test_forward_applies_the_limit_on_the_calling_thread(gemma_path):
    """A forward pass (edge.generate.forward: the policy applied before, checked between layers)
    runs its kernels on the policy's thread count, and the logits do not depend on it (greedy
    text is the same whatever the load)."""
    model = load_model(GGUFFile(gemma_path))
    m = FakeMachine()
    asked = numba.get_num_threads()
    seen = []
    policy = AdaptiveThreads(cpus=(0, 1), interval=0.1, clock=lambda: m.t,
                             read_busy=lambda c: m.busy, read_self=lambda: m.mine)
    try:
        tokens = np.array([2, 818, 5279, 529, 7001, 563, 236743, 1, 17, 400])
        cache = model.new_cache(64)
        full = forward(model, tokens, cache, logits_rows=slice(None), threads=policy)
        step = forward(model, [int(np.argmax(full[-1]))], cache, threads=policy)
        seen.append(numba.get_num_threads())
        m.run(0.1, mine=1.0, others=1.0)                 # a busy process: one thread
        cache = model.new_cache(64)
        limited = forward(model, tokens, cache, logits_rows=slice(None), threads=policy)
        seen.append(numba.get_num_threads())
        np.testing.assert_array_equal(full, limited)
        np.testing.assert_array_equal(step, forward(model, [int(np.argmax(full[-1]))], cache, threads=policy))
        m.run(0.1, mine=1.0, others=0.0)                 # gone: the count asked for again
        forward(model, tokens[:1], model.new_cache(64), threads=policy)
        seen.append(numba.get_num_threads())
        assert seen == [asked, 1, asked]
    finally:
        numba.set_num_threads(asked)


def test_use_threads_sets_the_calling_threads_count_clamped_to_numbas_pool():
    asked = numba.get_num_threads()
    try:
        use_threads(1)
        assert numba.get_num_threads() == 1
        use_threads(None)                                # None: as it is
        assert numba.get_num_threads() == 1
        use_threads(10**6)
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
        with pytest.raises(ValueError, match="the thread count must be at least 1, got 0"):
            use_threads(0)
    finally:
        numba.set_num_threads(asked)
