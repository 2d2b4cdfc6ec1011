"""Knowing when numba compiles: the wait of a cold kernel cache, announced instead of silent.

edge's kernels are compiled by numba the first time they are called with new argument types,
unless numba's on-disk cache (``cache=True``) holds them: on a cold cache the first command
waits about a minute on 2 cores, later ones load the kernels in a second or two. numba fires
its ``numba:compile`` event around each real compile (a kernel loaded from the cache fires
none), so :class:`CompileWatch` tells exactly when a wait is a compile and how far it has got:
the commands print a note or a live count (edge.cli), the chat shows it in its status bar.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from numba.core import event


class CompileWatch(event.Listener):
    """Counts numba's compiles while it is entered (``with CompileWatch(...)``), in any thread.

    ``on_first()`` is called when the first compile starts (then ``started`` is its
    ``time.monotonic()``), ``on_progress(count, name)`` after each compile ends (``count``
    compiles so far, ``name`` the Python name of the function just compiled). Callbacks run on
    the compiling thread and must be quick; an exception in one is not raised into numba.
    """

    def __init__(self, on_first: Callable[[], None] | None = None,
                 on_progress: Callable[[int, str], None] | None = None):
        self.on_first = on_first
        self.on_progress = on_progress
        self.count = 0
        self.started: float | None = None
        self.depth = 0
        self._lock = threading.Lock()

    @property
    def compiling(self) -> bool:
        """Whether a compile is running now."""
        return self.depth > 0

    @property
    def seconds(self) -> float:
        """Seconds since the first compile started (0 before)."""
        return 0.0 if self.started is None else time.monotonic() - self.started

    def on_start(self, ev) -> None:
        with self._lock:
            self.depth += 1
            first = self.started is None
            if first:
                self.started = time.monotonic()
        if first and self.on_first is not None:
            _quietly(self.on_first)

    def on_end(self, ev) -> None:
        with self._lock:
            self.depth -= 1
            self.count += 1
            count = self.count
        if self.on_progress is not None:
            dispatcher = (ev.data or {}).get("dispatcher")
            name = getattr(getattr(dispatcher, "py_func", None), "__name__", "?")
            _quietly(self.on_progress, count, name)

    def __enter__(self) -> CompileWatch:
        event.register("numba:compile", self)
        return self

    def __exit__(self, *exc) -> None:
        event.unregister("numba:compile", self)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:       # a display problem must not break a compile
        pass
