"""A render budget for untrusted Jinja2 templates (a GGUF's chat template).

jinja2's ``ImmutableSandboxedEnvironment`` stops a template from reaching Python internals but
not from spending: nested loops, recursive macros and ``'x'|center(2000000000)`` hang the
process or allocate gigabytes. :mod:`edge.template_sandbox` renders under a :class:`Budget`:

- steps: every loop iteration, call and filter is a step (a macro call :data:`MACRO_STEPS`),
  and so is every :data:`CHARS_PER_STEP` characters an operation builds; at most
  :data:`MAX_STEPS` plus :data:`STEPS_PER_INPUT_ITEM` per item of the input (a list element
  or a dict entry: a message, a tool, a field of one);
- size: no string, list or dict a template builds, and no output, exceeds :data:`MAX_SIZE`
  plus :data:`SIZE_PER_INPUT` times the size of the input, where the size of a value is about
  the length of its text (a container's is the sum of its parts, shared parts counted each
  time); operations that scale a size by an argument (``center``, ``*``, ``%05000d``,
  ``replace``, ``join``, ``indent``, ``batch`` ...) are checked *before* they allocate; lists
  and dicts nest at most :data:`MAX_DEPTH` deep and integers have at most :data:`MAX_INT_BITS`;
- safety nets: a wall-clock deadline (:data:`MAX_SECONDS`) checked at every step, and the
  growth of the process's anonymous memory (:data:`MAX_MEMORY` plus :data:`MEMORY_PER_INPUT`
  bytes per unit of input size), looked at every :data:`MEMORY_CHECK_CHARS` built characters.

A budget overrun raises :class:`RenderBudgetError` naming the budget and its limit.
"""
from __future__ import annotations

import contextvars
import re
import resource
import sys
import time
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

import jinja2
from jinja2.runtime import Undefined
from jinja2.utils import Namespace

MAX_STEPS = 1_000_000  # loop iterations, calls and filters for an empty input
MACRO_STEPS = 50  # steps a call of a macro (or caller()) costs: it runs a template body
STEPS_PER_INPUT_ITEM = 1_000  # more steps per message, tool, list element or dict entry
CHARS_PER_STEP = 1024  # building this many characters costs one step
MAX_SIZE = 1 << 22  # characters of any built value or of the output, for an empty input
SIZE_PER_INPUT = 8  # more characters per character of input
MAX_SECONDS = 10.0  # wall clock of one render
MAX_MEMORY = 256 << 20  # bytes the process may grow by during a render, for an empty input
MEMORY_PER_INPUT = 32  # more bytes per character of input
MEMORY_CHECK_CHARS = 32 << 20  # built characters between two looks at the process's memory
MAX_DEPTH = 256  # nesting of a built list, tuple or dict (C code recurses on it unguarded)
MAX_INT_BITS = 1 << 16  # bits of an integer a template computes
RECENT_SIZES = 8  # sizes of values just built that are kept (with the values)
MAX_JSON_INDENT = 64  # tojson's indent, in spaces or characters
SLOW_FILTER_CHARS = 1 << 20  # input of the pure-Python text filters (wordwrap, urlize)

_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CONTAINERS = (list, tuple, dict, set, frozenset, *_VIEWS)  # concrete types: isinstance is fast
_BUILT = (list, tuple, dict, set, frozenset)
_TEXT = (str, bytes, bytearray)
_CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("edge_render_budget",
                                                                          default=None)


class RenderBudgetError(jinja2.TemplateError):
    """A template went over one of its render budgets; the message names it and its limit."""


def _n(x: int) -> str:
    return f"{x:,}"


def _anon_rss() -> int:
    """Bytes of anonymous resident memory of this process (Linux: resident minus file-backed,
    so that model weights paged in by another thread do not count), else its peak RSS."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB elsewhere


def _leaf_size(value: Any) -> int:
    """Size of a non-container: about the length of its text."""
    if type(value) is str or isinstance(value, _TEXT):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, float):
        return 24
    return 16


_SCALARS = frozenset({int, float, bool, type(None)})


def _flat_size(value: Any) -> int | None:
    """Size of a container of strings and numbers only (most of them), else None."""
    size = 2
    for child in _children(value):
        kind = type(child)
        if kind is str:
            size += len(child) + 2
        elif kind in _SCALARS:
            size += _leaf_size(child) + 2
        else:
            return None
    return size


def _is_iterator(value: Any) -> bool:
    return hasattr(type(value), "__next__")


def _children(value: Any) -> Iterator[Any]:
    """Elements of a container; a dict's keys and values."""
    return chain.from_iterable(value.items()) if isinstance(value, dict) else iter(value)


class Budget:
    """What one render may still spend (see the module docstring).

    Args:
        variables: the template's variables; their size scales the limits.
    """

    def __init__(self, variables: Mapping[str, Any]):
        self._memo: dict[int, tuple[int, int]] = {}  # input containers: (size, depth)
        self._recent: dict[int, tuple[Any, int, int]] = {}  # values just built
        self._items = 0
        items, size = self._measure_input(list(variables.values()))
        self.input_size = size
        self.max_steps = MAX_STEPS + STEPS_PER_INPUT_ITEM * items
        self.max_size = MAX_SIZE + SIZE_PER_INPUT * size
        self.max_memory = MAX_MEMORY + MEMORY_PER_INPUT * size
        self.steps = 0
        self.output = 0
        self._chars = 0  # built characters not yet turned into steps
        self._unchecked = 0  # built characters since the last look at memory
        self.deadline = time.monotonic() + MAX_SECONDS
        self._rss0 = _anon_rss()

    # ---------------------------------------------------------------- accounting
    def fail(self, budget: str, detail: str) -> None:
        raise RenderBudgetError(f"chat template exceeded its {budget} budget: {detail}")

    def step(self, n: int = 1) -> None:
        """Count ``n`` steps; check the step budget and the deadline."""
        self.steps += n
        if self.steps > self.max_steps:
            self.fail("step", f"more than {_n(self.max_steps)} loop iterations, calls and filters "
                      f"({_n(MAX_STEPS)} + {_n(STEPS_PER_INPUT_ITEM)} per input item)")
        if time.monotonic() > self.deadline:
            self.fail("time", f"rendering took more than {MAX_SECONDS:g} s")

    def built(self, chars: int) -> None:
        """Count ``chars`` characters (or list slots) an operation built."""
        self._chars += chars
        if self._chars >= CHARS_PER_STEP:
            steps, self._chars = divmod(self._chars, CHARS_PER_STEP)
            self.step(steps)
        self._unchecked += chars
        if self._unchecked >= MEMORY_CHECK_CHARS:
            self._unchecked = 0
            rss = _anon_rss()
            if rss - self._rss0 > self.max_memory:
                self.fail("memory", f"the process grew by more than {self.max_memory >> 20} MiB "
                          f"({MAX_MEMORY >> 20} MiB + {MEMORY_PER_INPUT} bytes per unit of input)")

    def emit(self, chars: int) -> None:
        """Count ``chars`` characters of output (in any buffer: top level, macro, set block)."""
        self.output += chars
        if self.output > self.max_size:
            self.fail("output", f"more than {_n(self.max_size)} characters of output "
                      f"({self._size_rule()})")

    def _size_rule(self) -> str:
        return f"{_n(MAX_SIZE)} + {SIZE_PER_INPUT} per character of input"

    def check_len(self, n: int, what: str) -> None:
        """Refuse to build a value of ``n`` characters or slots (checked before building it)."""
        if n > self.max_size:
            self.fail("size", f"{what} would be {_n(n)} characters long; the limit is "
                      f"{_n(self.max_size)} ({self._size_rule()})")

    # ---------------------------------------------------------------- sizes
    def _measure_input(self, roots: list[Any]) -> tuple[int, int]:
        """(items, size) of the input; the size of each of its containers is kept."""
        size = 0
        for root in roots:
            if isinstance(root, _CONTAINERS):
                size += self._walk(root, None, self._memo)[0]
            else:
                size += _leaf_size(root)
        return self._items, size

    def _known(self, key: int) -> tuple[int, int] | None:
        known = self._memo.get(key)
        if known is None:
            recent = self._recent.get(key)
            if recent is not None:
                known = recent[1:]
        return known

    def remember(self, value: Any, size: int, depth: int) -> None:
        """Keep the size of a value just built (the last RECENT_SIZES of them, so that a list
        grown by ``+`` in a loop is not walked again at each step)."""
        self._recent[id(value)] = (value, size, depth)
        if len(self._recent) > RECENT_SIZES:
            del self._recent[next(iter(self._recent))]

    def _walk(self, root: Any, what: str | None, memo: dict[int, tuple[int, int]]
              ) -> tuple[int, int]:
        """(size, depth) of the container ``root``: a post-order walk, iterative (a deep value
        cannot overflow the Python stack), visiting each distinct container once and keeping
        their sizes in ``memo``. With ``what`` (a template's value), refuses one over the size
        limit or nested deeper than MAX_DEPTH; without (the input), counts its items."""
        cap = self.max_size if what is not None else float("inf")
        if what is not None:  # a built value: walking it costs a step per 16 of its containers
            self.built(CHARS_PER_STEP * len(root) // 16)
        stack = [[root, _children(root), 2, 1]]
        active = {id(root)}
        while True:
            frame = stack[-1]
            for child in frame[1]:
                if type(child) is str:  # the common case first
                    frame[2] += len(child) + 2
                    if frame[2] > cap:
                        self._check_walk(stack, frame, what)
                    continue
                if isinstance(child, _CONTAINERS):
                    key = id(child)
                    got = memo.get(key) if what is None else self._known(key) or memo.get(key)
                    if got is None:
                        flat = _flat_size(child)
                        if flat is not None:
                            got = memo[key] = (flat, 1)
                            if what is None:
                                self._items += len(child)
                        elif key in active:
                            got = (5, 0)  # a cycle (only an input can have one), printed [...]
                        else:
                            if what is not None:
                                self.built(CHARS_PER_STEP * len(child) // 16)
                            stack.append([child, _children(child), 2, 1])
                            active.add(key)
                            break
                    size, depth = got
                else:
                    if isinstance(child, Namespace) and what is not None:
                        self.fail("size", f"{what} holds a namespace(), which can grow after it "
                                  "is stored: it cannot be put in a list, a dict or a namespace")
                    size, depth = _leaf_size(child), 0
                frame[2] += size + 2
                if depth >= frame[3]:
                    frame[3] = depth + 1
                if what is not None:
                    self._check_walk(stack, frame, what)
            else:
                stack.pop()
                node = frame[0]
                active.discard(id(node))
                memo[id(node)] = result = (frame[2], frame[3])
                if what is None:
                    self._items += len(node)
                if not stack:
                    return result
                parent = stack[-1]
                parent[2] += result[0] + 2
                parent[3] = max(parent[3], result[1] + 1)
                if what is not None:
                    self._check_walk(stack, parent, what)

    def _check_walk(self, stack: list, frame: list, what: str) -> None:
        if frame[2] > self.max_size:  # a part of the value is already over the limit
            self.fail("size", f"{what} would be more than {_n(self.max_size)} characters long "
                      f"({self._size_rule()})")
        if frame[3] + len(stack) - 1 > MAX_DEPTH:
            self.fail("nesting", f"{what} nests lists or dicts more than {MAX_DEPTH} deep")

    def measure(self, value: Any, what: str) -> tuple[int, int]:
        """(size, depth) of ``value``, size being about the length of its text (a container's is
        the sum of its parts, shared parts counted each time); refuses a value over the size
        limit, nested deeper than MAX_DEPTH or an integer of more than MAX_INT_BITS."""
        if isinstance(value, Namespace):
            return self.measure(value._Namespace__attrs, what)
        if not isinstance(value, _CONTAINERS):
            if type(value) is int and value.bit_length() > MAX_INT_BITS:
                self.fail("size", f"{what} is an integer of {_n(value.bit_length())} bits; "
                          f"the limit is {_n(MAX_INT_BITS)}")
            return _leaf_size(value), 0
        known = self._known(id(value))
        if known is None:
            flat = _flat_size(value)
            if flat is not None:  # strings and numbers only: no walk
                self.check_len(flat, what)
                return flat, 1
            known = self._walk(value, what, {})
            if id(value) not in self._memo:
                self.remember(value, *known)
        return known

    def size(self, value: Any, what: str) -> int:
        """The size of ``value`` (see :meth:`measure`)."""
        return self.measure(value, what)[0]

    def text_size(self, value: Any, what: str) -> int:
        """About the length of ``str(value)``, without building it."""
        if isinstance(value, str):
            return len(value)
        if isinstance(value, Undefined):
            return 0
        return self.size(value, what)

    def result(self, value: Any, what: str) -> Any:
        """Check and count a value an operation just built; returns it."""
        if type(value) is str or isinstance(value, _TEXT):
            self.check_len(len(value), what)
            self.built(len(value))
        elif isinstance(value, _BUILT):
            self.measure(value, what)
            self.built(8 * len(value))
        elif type(value) is int and value.bit_length() > MAX_INT_BITS:
            self.measure(value, what)
        return value

    def text(self, value: Any, what: str) -> str:
        """``str(value)``, refused when it would be over the size limit."""
        if type(value) is str:
            return value
        self.text_size(value, what)
        return self.result(str(value), what)

    # ---------------------------------------------------------------- iteration
    def loop(self, iterable: Any) -> Any:
        """``iterable`` with a step per item; an iterator's items together stay within the size
        limit (a loop may collect them all for ``loop.length``)."""
        return _Counted(iterable, self)

    def bounded(self, iterator: Any, what: str) -> Iterator[Any]:
        """Items of ``iterator`` (a step each), refused once their sizes add up to more than
        the limit."""
        total = 0
        for item in iterator:
            self.step()
            total += self.text_size(item, what) + 2
            self.check_len(total, what)
            yield item

    def items(self, iterable: Any, what: str) -> list[Any]:
        """``list(iterable)`` within the size limit."""
        if isinstance(iterable, _CONTAINERS):
            return list(iterable)
        if isinstance(iterable, (str, range)):  # a list of characters or of numbers
            self.check_len((5 if isinstance(iterable, str) else 16) * len(iterable), what)
            return list(iterable)
        return list(self.bounded(iter(iterable), what))


class _Counted:
    """An iterable for a ``for`` loop that costs a step per item (see :meth:`Budget.loop`)."""

    __slots__ = ("_budget", "_iterable")

    def __init__(self, iterable: Any, budget: Budget):
        self._iterable = iterable
        self._budget = budget

    def __len__(self) -> int:
        return len(self._iterable)  # TypeError when unsized: LoopContext then collects the items

    def __iter__(self) -> Iterator[Any]:
        budget, step = self._budget, self._budget.step
        it = self._iterable
        if _is_iterator(it):
            it = budget.bounded(it, "the items of a loop")
        for item in it:
            step()
            yield item


def current() -> Budget:
    """The budget of the render under way (a fresh empty-input one outside a render)."""
    budget = _CURRENT.get()
    return budget if budget is not None else Budget({})


def render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render ``template`` with ``variables`` under a fresh :class:`Budget`.

    Raises:
        RenderBudgetError: a budget was exceeded (and any error the template raises).
    """
    token = _CURRENT.set(Budget(variables))
    try:
        return template.render(**variables)
    finally:
        _CURRENT.reset(token)


# -------------------------------------------------------------------- formatting
_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.DOTALL)
_DIGITS = re.compile(r"\d+")


def check_width(b: Budget, text: str, what: str) -> int:
    """The width or precision ``text`` (digits) of a format field.

    Raises:
        RenderBudgetError: it is over the size limit.
    """
    if len(text) > 12:
        b.check_len(10 ** 12, what)
    n = int(text)
    b.check_len(n, what)
    return n


def check_printf(b: Budget, fmt: Any, args: Any, what: str) -> None:
    """Refuse ``fmt % args`` when its result could be over the size limit: an upper bound of
    its length from the literal text, each field's width and precision and the biggest argument.

    Raises:
        RenderBudgetError: naming ``what``.
    """
    if not isinstance(fmt, str):
        return
    positional = list(args) if isinstance(args, tuple) else [args]
    values = positional + (list(args.values()) if isinstance(args, Mapping) else [])
    biggest = max((b.text_size(v, what) for v in values), default=0)
    total, index = len(fmt), 0
    for m in _PRINTF.finditer(fmt):
        key, width, precision, conversion = m.groups()
        if conversion == "%":
            continue
        for part in (width, precision):
            if part == "*":
                n = positional[index] if index < len(positional) else 0
                index += 1
                total += abs(n) if isinstance(n, int) else 0  # a negative width pads too
                b.check_len(total, what)
            elif part:
                total += check_width(b, part, what)
        index += key is None
        total += biggest * (10 if conversion in "ra" else 1) + 24
        b.check_len(total, what)


def _same_kind(s: Any, x: Any) -> bool:
    return isinstance(x, str) if isinstance(s, str) else isinstance(x, (bytes, bytearray))


def replaced_len(s: Any, old: Any, new: Any, count: Any) -> int | None:
    """Length of ``s.replace(old, new, count)`` without building it (None: wrong types)."""
    if not (_same_kind(s, old) and _same_kind(s, new)):
        return None
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))
