"""The chat template's render budget: a model's template cannot hang a turn, take gigabytes or
crash the process, and real templates render exactly as a plain jinja2 sandbox renders them."""
from __future__ import annotations

import functools
import json
import os
import resource
import select
import signal
import time
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge.chat_template import ChatTemplate, ChatTemplateError

TEMPLATES = Path(__file__).parent / "data" / "templates"
USER_HI = [{"role": "user", "content": "hi"}]
PAGE = resource.getpagesize()


def _render(source: str, messages=USER_HI, **kwargs) -> str:
    return ChatTemplate(source, "<s>", "</s>").render(messages, **kwargs)


# --- attacks, each rendered in a forked child under an address-space limit --------------------

def _statm(field: int) -> int:
    return int(Path("/proc/self/statm").read_text().split()[field]) * PAGE


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _render_in_child(source: str, headroom: int) -> dict:
    vm = _statm(0)
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    except OSError:
        pass
    rss0, t0 = _statm(1), time.monotonic()
    try:
        _render(source)
        out = {"outcome": "rendered"}
    except ChatTemplateError as e:
        out = {"outcome": type(e).__name__, "message": str(e)}
    except BaseException as e:  # noqa: BLE001 (MemoryError, RecursionError ...: reported)
        out = {"outcome": type(e).__name__, "message": str(e)[:300]}
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["grew_mib"] = round((_peak_rss() - rss0) / 2 ** 20, 1)
    return out


def _render_isolated(source: str, timeout: float = 30.0, headroom: int = 1 << 30) -> dict:
    """Render ``source`` in a forked child whose address space may grow by ``headroom`` bytes;
    returns its outcome, seconds and peak memory growth, or how it ended when it did not say."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(r)
            os.write(w, json.dumps(_render_in_child(source, headroom)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    try:
        if not select.select([r], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            return {"outcome": f"still rendering after {timeout:g} s (killed)"}
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if not data:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {status}"
        return {"outcome": f"the child died ({how})"}
    return json.loads(data)


def _doubling(op: str, seed: str, times: int) -> str:
    return (f"{{% set ns = namespace(s={seed}) %}}{{% for i in range({times}) %}}"
            f"{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}{{{{ ns.s|length }}}}")


FOUR_MB = " ~ ".join(["('x' * 1000000)"] * 4)
ATTACKS = {  # id: (template, the budget it must exceed)
    "nested-range-loops": ("{% for a in range(100000) %}{% for b in range(100000) %}"
                           "{% endfor %}{% endfor %}", "step"),
    "center-filter": ("{{ 'x'|center(2000000000) }}", "size"),
    "format-filter-width": ("{{ '%02000000000d'|format(1) }}", "size"),
    "percent-width": ("{{ '%02000000000d' % 1 }}", "size"),
    "percent-star-width": ("{{ '%*d' % (2000000000, 1) }}", "size"),
    "percent-negative-star-width": ("{{ '%*d' % (-2000000000, 1) }}", "size"),
    "concat-doubling": (_doubling("~", "'ab'", 31), "size"),
    "plus-doubling": (_doubling("+", "'ab'", 31), "size"),
    "list-doubling": (_doubling("+", "[1]", 40), "size"),
    "macro-exponential-recursion": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}"
                                    "{% endif %}{% endmacro %}{{ f(60) }}", "step"),
    "str-center": ("{{ 'x'.center(2000000000) }}", "size"),
    "str-ljust": ("{{ 'x'.ljust(2000000000, '*') }}", "size"),
    "str-rjust": ("{{ 'x'.rjust(2000000000) }}", "size"),
    "str-zfill": ("{{ '1'.zfill(2000000000) }}", "size"),
    "str-expandtabs": ("{{ ('\t' * 1000).expandtabs(2000000) }}", "size"),
    "str-replace": ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", "size"),
    "str-format-width": ("{{ '{:>2000000000}'.format('x') }}", "size"),
    "str-format-nested-width": ("{{ '{:{w}}'.format('x', w=2000000000) }}", "size"),
    "str-format-many-fields": ("{{ ('{0}' * 300000).format('x' * 10000) }}", "size"),
    "str-join-separator": ("{{ ('y' * 1000000).join(range(10000)|map('string')) }}", "size"),
    "join-repeated-big-list": ("{{ (['x' * 1000000] * 1000)|join }}", "size"),
    "join-filter-separator": ("{{ range(10000)|join('y' * 1000000) }}", "size"),
    "replace-filter-empty": ("{{ ('x' * 100000)|replace('', 'y' * 100000) }}", "size"),
    "batch-huge-count": ("{{ [1]|batch(2000000000, 'x')|list|length }}", "size"),
    "slice-huge-count": ("{{ [1]|slice(2000000000)|list|length }}", "size"),
    "indent-width": ("{{ 'a\nb'|indent(2000000000) }}", "size"),
    "wordwrap-wrapstring": ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='z' * 100000) }}", "size"),
    "tojson-indent": ("{{ [[1]]|tojson(indent=2000000000) }}", "size"),
    "lipsum": ("{{ lipsum(100000000) }}", "size"),
    "int-to-bytes": ("{{ (1).to_bytes(2000000000, 'big') }}", "size"),
    "int-squaring": ("{% set ns = namespace(x=3) %}{% for i in range(40) %}"
                     "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}", "size"),
    "shared-list-tree": ("{% set ns = namespace(x=['ab']) %}{% for i in range(40) %}"
                         "{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x|string|length }}", "size"),
    "deep-tuple-hash": ("{% set ns = namespace(t=()) %}{% for i in range(1000) %}{% for j in range(1000) %}"
                        "{% set ns.t = (ns.t,) %}{% endfor %}{% endfor %}{{ ns.t in {} }}", "nesting"),
    "map-then-list": ("{{ range(100000)|map('center', 100000)|list|length }}", "size"),
    "loop-length-of-generator": ("{% for x in range(100000)|map('center', 100000) %}"
                                 "{{ loop.length }}{% endfor %}", "size"),
    "sum-of-lists": ("{{ range(100000)|batch(1)|sum(start=[])|length }}", "step"),
    "loop-output": ("{% for i in range(100000) %}{% for j in range(10) %}" + "x" * 100
                    + "{% endfor %}{% endfor %}", "output"),
    "macro-recursion-holding-strings": ("{% macro m(n) %}{% set a = " + FOUR_MB + " ~ n %}"
                                        "{% if n %}{{ m(n - 1) }}{% endif %}{{ a|length }}"
                                        "{% endmacro %}{{ m(100) }}", "memory"),
}


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="measures memory through /proc")
@pytest.mark.parametrize("source, budget", ATTACKS.values(), ids=ATTACKS.keys())
def test_attack_is_refused_in_bounded_time_and_memory(source, budget):
    """Each of these hangs, takes gigabytes (a MemoryError under the child's 1 GiB limit),
    renders hundreds of megabytes or crashes the interpreter without a budget."""
    out = _render_isolated(source)
    assert out["outcome"] == "ChatTemplateBudgetError", out
    assert out["message"].startswith(f"chat template exceeded its {budget} budget: "), out
    assert out["seconds"] < 8, out  # the deterministic budgets stop it long before the deadline
    assert out["grew_mib"] < (450 if budget == "memory" else 64), out


def test_budget_error_names_the_budget_and_its_limit(monkeypatch):
    from edge import template_budget
    from edge.chat_template import ChatTemplateBudgetError

    with pytest.raises(ChatTemplateBudgetError) as info:
        _render("{{ 'x'|center(2000000000) }}")
    assert str(info.value) == (
        "chat template exceeded its size budget: the center filter would be 2,000,000,000 characters "
        "long; the limit is 4,194,688 (4,194,304 + 8 per character of input)")
    monkeypatch.setattr(template_budget, "MAX_STEPS", 1000)
    with pytest.raises(ChatTemplateBudgetError) as info:
        _render("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    assert str(info.value) == (
        "chat template exceeded its step budget: more than 4,000 loop iterations, calls and "
        "filters (1,000 + 1,000 per input item)")


def test_budget_scales_with_the_input():
    from edge.template_budget import Budget

    messages = [{"role": "user", "content": "x" * 1000} for _ in range(1000)]
    budget = Budget({"messages": messages})
    assert budget.input_size == 2 + 1000 * (2 + (4 + 2) + (4 + 2) + (7 + 2) + (1000 + 2) + 2)
    assert budget.max_size == 4_194_304 + 8 * budget.input_size == 12_410_320
    assert budget.max_steps == 1_000_000 + 1_000 * (1000 + 1000 * 2) == 4_000_000


def test_deadline_is_checked_as_rendering_goes(monkeypatch):
    from edge import template_budget

    monkeypatch.setattr(template_budget, "MAX_SECONDS", 0.05)
    source = "{% for i in range(100000) %}{% for j in range(5) %}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"exceeded its time budget: rendering took more than 0\.05 s"):
        _render(source)  # 500,000 steps: within the step budget, over 0.05 s
    assert time.monotonic() - t0 < 5


def test_namespace_cannot_be_put_in_a_list():
    """A namespace can grow after it is stored, so a list holding one could outgrow the limit."""
    with pytest.raises(ChatTemplateError, match="holds a namespace"):
        _render("{% set ns = namespace(a=1) %}{% set x = [ns] %}{{ x|length }}")
    assert _render("{% set ns = namespace(a=[1, 2]) %}{% set ns.a = ns.a + [3] %}{{ ns.a }}{{ ns }}") \
        == "[1, 2, 3]<Namespace {'a': [1, 2, 3]}>"


# --- real templates render as a plain sandbox renders them, also for big chats ----------------

def _reference(source: str) -> jinja2.Template:
    """The template in a plain jinja2 sandbox set up as transformers does (no budget)."""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in <city> & co",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"}, "days": {"type": "integer"}}}}}
CALL = {"id": "abcDEF123", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Genève", "days": 2}}}
# template: (has a system role, takes tools)
REAL = {
    "Qwen-Qwen2.5-7B-Instruct": (True, True),
    "Qwen-Qwen3-0.6B": (True, True),
    "meta-llama-Llama-3.1-8B-Instruct": (True, True),
    "mistralai-Mistral-Nemo-Instruct-2407": (True, True),
    "microsoft-Phi-3.5-mini-instruct": (True, False),
    "google-gemma-2-2b-it": (False, False),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (True, False),
    "Reka-Edge": (True, False),
}


def _chat(system: bool, turns: int, content: str = "") -> list[dict]:
    messages = [{"role": "system", "content": "You are helpful."}] if system else []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} é <b> {content}"})
        messages.append({"role": "assistant", "content": f"<think>\nhm {i}\n</think>\n\nanswer {i} {content}",
                         "reasoning_content": f"thinking {i}"})
    return messages + [{"role": "user", "content": f"last {content}"}]


def _tool_chat(system: bool) -> list[dict]:
    return (_chat(system, 1)[:-1] + [{"role": "user", "content": "Weather in Genève?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "12 °C", "tool_call_id": CALL["id"], "name": "get_weather"},
            {"role": "assistant", "content": "It is 12 °C."}, {"role": "user", "content": "thanks"}])


@functools.cache
def _templates(name: str) -> tuple[jinja2.Template, ChatTemplate]:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return _reference(source), ChatTemplate(source, "<s>", "</s>")


def _same_as_reference(name: str, messages: list[dict], **kwargs) -> str:
    reference, template = _templates(name)
    variables = {"tools": None, "add_generation_prompt": True, **kwargs}
    expected = reference.render(**variables, messages=messages, bos_token="<s>", eos_token="</s>")
    rendered = template.render(messages, **variables)
    assert rendered == expected
    return rendered


def test_real_template_fixtures_present():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(REAL)


@pytest.mark.parametrize("name", REAL)
def test_real_template_renders_as_before(name):
    system, tools = REAL[name]
    for add_generation_prompt in (True, False):
        text = _same_as_reference(name, _chat(system, 2), add_generation_prompt=add_generation_prompt)
        assert "question 1 é <b>" in text
    if tools:
        text = _same_as_reference(name, _tool_chat(system), tools=[TOOL])
        assert "get_weather" in text and "Genève" in text
    if name == "Qwen-Qwen3-0.6B":
        assert "<think>\n\n</think>" in _same_as_reference(name, _chat(system, 1), enable_thinking=False)


@pytest.mark.parametrize("name", REAL)
def test_real_template_renders_a_thousand_messages(name):
    text = _same_as_reference(name, _chat(REAL[name][0], 500, "words " * 20))
    assert "question 499 é <b>" in text and len(text) > 500 * 240


@pytest.mark.parametrize("name", REAL)
def test_real_template_renders_a_one_megabyte_message(name):
    text = _same_as_reference(name, _chat(REAL[name][0], 1) + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "long " * 200_000}])
    assert text.count("long") == 200_000


def test_quadratic_template_renders_a_full_context_chat():
    """Reka Edge grows the whole prompt with ``~`` in a namespace, copying it at each step:
    1,000 messages of 500 characters (about a 128k-token context) copy a gigabyte of text,
    which stays within the step budget (it scales with the input)."""
    text = _same_as_reference("Reka-Edge", _chat(True, 500, "x" * 480))
    assert len(text) > 1000 * 480
