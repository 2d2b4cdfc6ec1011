"""A render budget for untrusted Jinja2 templates (a GGUF's chat template).

jinja2's ``ImmutableSandboxedEnvironment`` stops a template from reaching Python internals but
not from spending: nested loops, recursive macros and ``'x'|center(2000000000)`` hang the
process or allocate gigabytes. :class:`BoundedEnvironment` renders under a :class:`Budget`:

- steps: every loop iteration, call (macros included) and filter is a step, and so is every
  :data:`CHARS_PER_STEP` characters an operation builds; at most :data:`MAX_STEPS` plus
  :data:`STEPS_PER_INPUT_ITEM` per item of the input (a message, a tool, a list or dict entry);
- size: no string, list or dict a template builds, and no output, exceeds :data:`MAX_SIZE`
  plus :data:`SIZE_PER_INPUT` times the size of the input, where the size of a value is about
  the length of its text (a container's is the sum of its parts, shared parts counted each
  time); operations that scale a size by an argument (``center``, ``*``, ``%05000d``,
  ``replace``, ``join``, ``indent``, ``batch`` ...) are checked *before* they allocate; lists
  and dicts nest at most :data:`MAX_DEPTH` deep and integers have at most :data:`MAX_INT_BITS`;
- safety nets: a wall-clock deadline (:data:`MAX_SECONDS`) checked at every step, and the
  growth of the process's anonymous memory (:data:`MAX_MEMORY` plus :data:`MEMORY_PER_INPUT`
  per unit of input size), looked at every :data:`MEMORY_CHECK_CHARS` built characters.

Loops, ``~`` and output are counted by rewriting the parsed template (For iterables, Concat
nodes, Output nodes and list/tuple/dict literals go through the ``_edge_*`` filters below);
operators, calls and str.format through the sandbox's hooks; every filter is wrapped. A budget
overrun raises :class:`RenderBudgetError` naming the budget and its limit.
"""
from __future__ import annotations

import contextvars
import inspect
import json
import re
import resource
import time
import types
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro, Undefined, markup_join
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedFormatter,
    SecurityError,
)
from jinja2.utils import Namespace, _PassArg, pass_context
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

MAX_STEPS = 1_000_000  # loop iterations, calls and filters for an empty input
MACRO_STEPS = 20  # steps a call of a macro (or caller()) costs: it runs a whole template body
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


def _anon_rss() -> int | None:
    """Bytes of anonymous resident memory of this process (Linux), else the peak RSS."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _leaf_size(value: Any, limit: int) -> int:
    """Size of a non-container: about the length of its text."""
    if type(value) is str or isinstance(value, _TEXT):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, Namespace):  # mutable: it may grow to the limit after it is stored
        return limit
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
            size += _leaf_size(child, 0) + 2
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
            if rss is not None and self._rss0 is not None and rss - self._rss0 > self.max_memory:
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
                size += _leaf_size(root, 0)
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
        limit = self.max_size if what is not None else 0
        cap = limit if what is not None else float("inf")
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
                    size, depth = _leaf_size(child, limit), 0
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
        if not isinstance(value, _CONTAINERS):
            if type(value) is int and value.bit_length() > MAX_INT_BITS:
                self.fail("size", f"{what} is an integer of {_n(value.bit_length())} bits; "
                          f"the limit is {_n(MAX_INT_BITS)}")
            return _leaf_size(value, self.max_size), 0
        known = self._known(id(value))
        if known is None:
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
        elif type(value) is int:
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
        if isinstance(iterable, str):
            self.check_len(5 * len(iterable), what)
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


def _width(b: Budget, text: str, what: str) -> int:
    """A width or precision written in a format; refused when over the size limit."""
    if len(text) > 12:
        b.check_len(10 ** 12, what)
    n = int(text)
    b.check_len(n, what)
    return n


def check_printf(b: Budget, fmt: Any, args: Any, what: str) -> None:
    """Refuse ``fmt % args`` when its result could be over the size limit."""
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
                total += n if isinstance(n, int) and n > 0 else 0
                b.check_len(total, what)
            elif part:
                total += _width(b, part, what)
        index += key is None
        total += biggest * (10 if conversion in "ra" else 1) + 24
        b.check_len(total, what)


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, refusing a field width or a result over the size limit."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any):
        super().__init__(env, **kwargs)
        self._total = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        b = current()
        for digits in _DIGITS.findall(format_spec):
            _width(b, digits, "a str.format field")
        b.text_size(value, "a str.format field")
        rv = super().format_field(value, format_spec)
        self._total += len(rv)
        b.check_len(self._total, "the result of str.format")
        return rv


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# -------------------------------------------------------------------- methods
def _check_pad(b: Budget, s: Any, name: str, width: Any = 0, *_: Any) -> None:
    if isinstance(width, int):
        b.check_len(max(len(s), width), f"str.{name}()")


def _check_expandtabs(b: Budget, s: Any, name: str, tabsize: Any = 8) -> None:
    if isinstance(tabsize, int):
        b.check_len(len(s) + s.count(b"\t" if isinstance(s, (bytes, bytearray)) else "\t")
                    * max(tabsize, 0), f"str.{name}()")


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


def _check_replace(b: Budget, s: Any, name: str, old: Any = "", new: Any = "",
                   count: Any = -1) -> None:
    n = replaced_len(s, old, new, count)
    if n is not None:
        b.check_len(n, f"str.{name}()")


def _check_split(b: Budget, s: Any, name: str, sep: Any = None, maxsplit: Any = -1) -> None:
    pieces = s.count(sep) + 1 if _same_kind(s, sep) and sep else len(s) // 2 + 1
    if isinstance(maxsplit, int) and maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    b.check_len(len(s) + 4 * pieces, f"the result of str.{name}()")


def _check_translate(b: Budget, s: Any, name: str, table: Any = None) -> None:
    if isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        b.check_len(len(s) * max(longest, 1), f"str.{name}()")


def _check_to_bytes(b: Budget, n: Any, name: str, length: Any = 1, *_: Any, **__: Any) -> None:
    if isinstance(length, int):
        b.check_len(length, f"int.{name}()")


_METHOD_CHECKS = {
    "center": _check_pad, "ljust": _check_pad, "rjust": _check_pad, "zfill": _check_pad,
    "expandtabs": _check_expandtabs, "replace": _check_replace, "split": _check_split,
    "rsplit": _check_split, "translate": _check_translate, "to_bytes": _check_to_bytes,
}


def _call_method(b: Budget, method: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Check a call of a str/bytes/int method that can scale a size by an argument; a join
    gets its items collected (within the limit) and summed before it allocates."""
    owner, name = method.__self__, method.__name__
    if name == "join" and isinstance(owner, _TEXT) and len(args) == 1 and not kwargs:
        items = b.items(args[0], f"the items of {type(owner).__name__}.join()")
        b.check_len(sum(len(x) for x in items if isinstance(x, _TEXT))
                    + len(owner) * max(len(items) - 1, 0), f"{type(owner).__name__}.join()")
        return (items,), kwargs
    check = _METHOD_CHECKS.get(name)
    if check is not None:
        try:
            bound = inspect.signature(check).bind(b, owner, name, *args, **kwargs)
        except TypeError:
            return args, kwargs  # the method raises its own error
        check(*bound.args, **bound.kwargs)
    return args, kwargs


# -------------------------------------------------------------------- environment
class BoundedNamespace(Namespace):
    """jinja2's ``namespace()`` whose content stays within the size limit."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        Namespace.__init__(*args, **kwargs)
        self = args[0]
        b = current()
        b.size(self._Namespace__attrs, "a namespace")
        b.built(CHARS_PER_STEP)

    def __setitem__(self, name: str, value: Any) -> None:
        attrs = dict(self._Namespace__attrs)
        attrs[name] = value
        current().size(attrs, f"namespace attribute {name!r}")
        super().__setitem__(name, value)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    b = current()
    if isinstance(n, int) and isinstance(max, int):
        b.check_len(n * max * 12, "lipsum()")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, rendering under the current :class:`Budget`: operators, calls,
    str.format, slices and output are checked; an unsafe attribute fails at once (jinja2
    would return an undefined that prints as "" and fails only when used)."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})  # -, / and // cannot grow a value

    def __init__(self, **options: Any):
        super().__init__(finalize=_finalize, **options)
        self.globals["namespace"] = BoundedNamespace
        self.globals["lipsum"] = _lipsum
        for name, func in list(self.filters.items()):
            self.filters[name] = wrap_filter(name, func)
        self.filters.update(_edge_loop=_edge_loop, _edge_concat=_edge_concat,
                            _edge_emit=_edge_emit, _edge_value=_edge_value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        b = current()
        kinds = (type(left), type(right))
        if kinds == (str, str) and op == "+":  # the common case first
            n = len(left) + len(right)
            b.check_len(n, "the result of '+'")
            b.built(n)
            return left + right
        if kinds == (int, int) and op == "+":
            return b.result(left + right, "the result of '+'")
        what = f"the result of {op!r}"
        if op == "+" and isinstance(left, (list, tuple)) and type(left) is type(right):
            (ls, ld), (rs, rd) = b.measure(left, what), b.measure(right, what)
            b.check_len(ls + rs - 2, what)
            rv = left + right
            b.remember(rv, ls + rs - 2, max(ld, rd))
            b.built(8 * len(rv))
            return rv
        if op == "*" and isinstance(left, (list, tuple)) and type(right) is int:
            return _repeat(b, left, right, what)
        if op == "*" and isinstance(right, (list, tuple)) and type(left) is int:
            return _repeat(b, right, left, what)
        if op == "+" and isinstance(left, _TEXT) and isinstance(right, _TEXT):
            b.check_len(len(left) + len(right), what)
        elif op == "*":
            check_repeat(b, left, right, what)
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
            b.fail("size", f"a {left.bit_length()}-bit integer ** {right} would have more than "
                   f"{_n(MAX_INT_BITS)} bits")
        elif op == "%" and isinstance(left, str):
            check_printf(b, left, right, "%-formatting")
        return b.result(self.binop_table[op](left, right), what)

    def getitem(self, obj: Any, argument: Any) -> Any:
        rv = super().getitem(obj, argument)
        if isinstance(argument, slice) and isinstance(rv, (*_TEXT, list, tuple)):
            current().built(len(rv))
        return rv

    def wrap_str_format(self, value: Any) -> Any:
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) \
                or value.__name__ not in ("format", "format_map") \
                or not isinstance(value.__self__, str):
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            formatter = (_BoundedEscapeFormatter(self, escape=fmt.escape)
                         if isinstance(fmt, Markup) else _BoundedFormatter(self))
            return type(fmt)(formatter.vformat(fmt, args, kwargs))

        return wrapper

    def call(self, context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        if not self.is_safe_callable(obj):
            raise SecurityError(f"{obj!r} is not safely callable")
        b = current()
        b.step(MACRO_STEPS if isinstance(obj, Macro) else 1)
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (b.loop(args[0]),) + args[1:]
        elif isinstance(obj, (types.BuiltinMethodType, types.MethodType)) and \
                isinstance(getattr(obj, "__self__", None), (*_TEXT, int)):
            args, kwargs = _call_method(b, obj, args, kwargs)
        args = tuple(b.bounded(a, "the items of a call's argument") if _is_iterator(a)
                     else a for a in args)
        return b.result(context.call(obj, *args, **kwargs), "the result of a call")


def _repeat(b: Budget, seq: list | tuple, count: int, what: str) -> list | tuple:
    """``seq * count`` within the size limit, its size known without walking it."""
    size, depth = b.measure(seq, what)
    total = 2 + max(count, 0) * (size - 2)
    b.check_len(total, what)
    rv = seq * count
    b.remember(rv, total, depth)
    b.built(8 * len(rv))
    return rv


def check_repeat(b: Budget, left: Any, right: Any, what: str) -> None:
    """Refuse ``left * right`` when it would be over the size or integer limits."""
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            b.fail("size", f"{what} would have more than {_n(MAX_INT_BITS)} bits")
        return
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (*_TEXT, list, tuple)) and isinstance(count, int) and count > 1:
            b.check_len(b.text_size(seq, what) * count, what)


# -------------------------------------------------------------------- rewritten nodes
@pass_context
def _finalize(context, value: Any) -> str:
    b = current()
    text = b.text(value, "an output value")
    b.emit(len(text))
    return text


@pass_context
def _edge_loop(context, iterable: Any) -> Any:
    return current().loop(iterable)


@pass_context
def _edge_concat(context, values: list[Any]) -> str:
    b = current()
    parts = [b.text(v, "an operand of '~'") for v in values]
    total = sum(len(p) for p in parts)
    b.check_len(total, "the result of '~'")
    b.built(total)
    return markup_join(parts) if context.eval_ctx.autoescape else "".join(parts)


@pass_context
def _edge_emit(context, chars: int) -> str:
    current().emit(chars)
    return ""


@pass_context
def _edge_value(context, value: Any) -> Any:
    return current().result(value, "a list, tuple or dict literal")


def _wrapped(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def _constant(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Const):
        return True
    if isinstance(node, (nodes.List, nodes.Tuple, nodes.Dict, nodes.Pair)):
        return all(_constant(child) for child in node.iter_child_nodes())
    return False


class _Instrument(NodeTransformer):
    """Rewrites a parsed template so that loops, ``~``, output and literals are counted."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _wrapped(node.iter, "_edge_loop")
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return _wrapped(nodes.List(node.nodes, lineno=node.lineno), "_edge_concat")

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        static = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
        if static:
            node.nodes.insert(0, _wrapped(nodes.Const(static, lineno=node.lineno), "_edge_emit"))
        return node

    def _literal(self, node: nodes.Expr) -> nodes.Expr:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load" or _constant(node):
            return node
        return _wrapped(node, "_edge_value")

    visit_List = visit_Tuple = visit_Dict = _literal


def compile_template(env: BoundedEnvironment, source: str) -> jinja2.Template:
    """Parse ``source``, rewrite it for the budget and compile it.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    tree = _Instrument().visit(env.parse(source))
    tree.set_environment(env)
    return env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)


# -------------------------------------------------------------------- filters
def _int(x: Any) -> int:
    return x if isinstance(x, int) else 0


def _check_center(b, value, width=80):
    b.check_len(max(b.text_size(value, "the center filter"), _int(width)), "the center filter")


def _check_indent(b, s, width=4, first=False, blank=False):
    unit = len(width) if isinstance(width, str) else _int(width)
    b.check_len(unit, "the indent filter's width")
    text = s if isinstance(s, str) else ""
    b.check_len(len(text) + unit * (text.count("\n") + 2), "the indent filter")


def _check_format(b, value, *args, **kwargs):
    check_printf(b, value, kwargs or args, "the format filter")


def _check_wordwrap(b, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = s if isinstance(s, str) else ""
    if len(text) > SLOW_FILTER_CHARS:
        b.fail("size", f"the wordwrap filter takes at most {_n(SLOW_FILTER_CHARS)} characters")
    sep = wrapstring if isinstance(wrapstring, str) else "\n"
    b.check_len(len(text) * (1 + len(sep)), "the wordwrap filter")


def _check_replace_filter(b, s, old, new, count=None):
    what = "the replace filter"
    n = replaced_len(b.text(s, what), b.text(old, what), b.text(new, what),
                     -1 if count is None else count)
    b.check_len(n or 0, what)


def _check_join(b, value, d="", attribute=None):
    items = b.items(value, "the items of the join filter")
    b.built(len(items) * CHARS_PER_STEP // 16)
    sizes = sum(len(x) if type(x) is str else b.text_size(x, "an item of the join filter")
                for x in items)
    b.check_len(sizes + b.text_size(d, "the join filter's separator") * max(len(items) - 1, 0),
                "the join filter")
    return items


def _check_batch(b, value, linecount, fill_with=None):
    if fill_with is not None:
        b.check_len(_int(linecount) * (b.text_size(fill_with, "batch") + 2), "the batch filter")


def _check_slice(b, value, slices, fill_with=None):
    fill = 0 if fill_with is None else b.text_size(fill_with, "slice") + 2
    b.check_len(_int(slices) * (4 + fill), "the slice filter")


def _check_list(b, value):
    return b.items(value, "the list filter")


def _check_urlize(b, value, trim_url_limit=None, nofollow=False, target=None, rel=None,
                  extra_schemes=None):
    if isinstance(value, str) and len(value) > SLOW_FILTER_CHARS:
        b.fail("size", f"the urlize filter takes at most {_n(SLOW_FILTER_CHARS)} characters")
    for extra in (target, rel):
        if isinstance(extra, str) and len(extra) > 256:
            b.fail("size", "the urlize filter's target and rel take at most 256 characters")


_FILTER_CHECKS = {
    "center": _check_center, "indent": _check_indent, "format": _check_format,
    "wordwrap": _check_wordwrap, "replace": _check_replace_filter, "join": _check_join,
    "batch": _check_batch, "slice": _check_slice, "list": _check_list, "urlize": _check_urlize,
}
_FIRST_ARG = {_PassArg.context: lambda c: c, _PassArg.eval_context: lambda c: c.eval_ctx,
              _PassArg.environment: lambda c: c.environment}


def wrap_filter(name: str, func: Any) -> Any:
    """``func`` as a filter that costs a step, checks its arguments (for the filters that can
    scale a size by an argument) and its result."""
    first = _FIRST_ARG.get(_PassArg.from_obj(func))
    check = _FILTER_CHECKS.get(name)
    signature = inspect.signature(check) if check else None
    what = f"the result of the {name} filter"

    @pass_context
    def bounded(context, value: Any, *args: Any, **kwargs: Any) -> Any:
        b = current()
        b.step()
        if _is_iterator(value):
            value = b.bounded(value, f"the items given to the {name} filter")
        if check is not None:
            try:
                bound = signature.bind(b, value, *args, **kwargs)
            except TypeError:
                bound = None  # the filter raises its own error
            if bound is not None:
                replacement = check(*bound.args, **bound.kwargs)
                if replacement is not None:
                    value = replacement
        if first is None:
            return b.result(func(value, *args, **kwargs), what)
        return b.result(func(first(context), value, *args, **kwargs), what)

    bounded.__name__ = bounded.__qualname__ = name
    return bounded


@pass_context
def _sum(context, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja2's sum filter, adding through the bounded ``+`` (Python's sum of lists is
    quadratic in C, out of reach of the deadline)."""
    env = context.environment
    values = iterable if attribute is None else map(
        jinja2.filters.make_attrgetter(env, attribute), iterable)
    total = start
    for value in values:
        current().step()
        total = env.call_binop(context, "+", total, value)
    return total


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """``json.dumps`` (as Hugging Face's tojson filter), streamed within the size limit when
    ``indent`` or ``separators`` are given; ``indent`` is at most MAX_JSON_INDENT."""
    b = current()
    unit = len(indent) if isinstance(indent, str) else _int(indent)
    if unit > MAX_JSON_INDENT:
        b.fail("size", f"tojson's indent is {_n(unit)}; the limit is {MAX_JSON_INDENT}")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    if indent is None and separators is None:  # at most 12 characters per character of value
        b.text_size(value, "the value given to tojson")
        return encoder.encode(value)
    parts, total = [], 0
    for chunk in encoder.iterencode(value):
        total += len(chunk)
        b.check_len(total, "the result of tojson")
        parts.append(chunk)
    return "".join(parts)


def make_environment() -> BoundedEnvironment:
    """The environment chat templates render in: Hugging Face's options (trim_blocks,
    lstrip_blocks, loop controls, its tojson) under the render budget."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = wrap_filter("tojson", tojson)
    env.filters["sum"] = wrap_filter("sum", _sum)
    return env


