"""Filters under the render budget: every jinja2 filter costs a step and has its result
checked; the ones that scale a size by an argument (center, indent, format, wordwrap, replace,
join, batch, slice, list) are checked before they run, the slow pure-Python ones (wordwrap,
urlize, pprint) take at most SLOW_FILTER_CHARS; sum adds through the bounded ``+`` and tojson
streams when it indents."""
from __future__ import annotations

import inspect
import json
from typing import Any

import jinja2
from jinja2.utils import _PassArg, pass_context

from edge.template_budget import (
    CHARS_PER_STEP,
    MAX_JSON_INDENT,
    SLOW_FILTER_CHARS,
    _is_iterator,
    _n,
    check_printf,
    current,
    replaced_len,
)


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


def _check_pprint(b, value):
    if b.text_size(value, "the value given to pprint") > SLOW_FILTER_CHARS:
        b.fail("size", f"the pprint filter takes at most {_n(SLOW_FILTER_CHARS)} characters")


_FILTER_CHECKS = {
    "center": _check_center, "indent": _check_indent, "format": _check_format,
    "wordwrap": _check_wordwrap, "replace": _check_replace_filter, "join": _check_join,
    "batch": _check_batch, "slice": _check_slice, "list": _check_list, "urlize": _check_urlize,
    "pprint": _check_pprint,
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
def bounded_sum(context, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
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
