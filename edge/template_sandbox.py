"""The bounded sandbox chat templates render in: jinja2's immutable sandbox whose operators,
calls, str.format, slices, filters and output are checked against the current render budget
(:mod:`edge.template_budget`).

Loops, ``~``, output and list/tuple/dict literals have no sandbox hook, so the parsed template
is rewritten (:func:`compile_template`): a For's iterable, a Concat, every Output node and
every non-constant literal go through the ``_edge_*`` filters below.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
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
from jinja2.utils import Namespace, pass_context
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from edge.template_budget import (
    _DIGITS,
    _TEXT,
    CHARS_PER_STEP,
    MACRO_STEPS,
    MAX_INT_BITS,
    Budget,
    _is_iterator,
    _n,
    _same_kind,
    check_printf,
    check_width,
    current,
    replaced_len,
)
from edge.template_filters import bounded_sum, tojson, wrap_filter


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, refusing a field width or a result over the size limit."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any):
        super().__init__(env, **kwargs)
        self._total = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        b = current()
        for digits in _DIGITS.findall(format_spec):
            check_width(b, digits, "a str.format field")
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
_METHOD_SIGNATURES = {name: inspect.signature(check) for name, check in _METHOD_CHECKS.items()}


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
            bound = _METHOD_SIGNATURES[name].bind(b, owner, name, *args, **kwargs)
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
            formatter = self.wrap_str_format(obj)  # a str.format that came around getattr
            if formatter is not None:
                obj = formatter
            else:
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


def make_environment() -> BoundedEnvironment:
    """The environment chat templates render in: Hugging Face's options (trim_blocks,
    lstrip_blocks, loop controls, its tojson) under the render budget."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = wrap_filter("tojson", tojson)
    env.filters["sum"] = wrap_filter("sum", bounded_sum)
    return env
