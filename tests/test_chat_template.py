"""Chat templates: llama.cpp goldens, HF rendering rules, sandbox (BUGS.md C1-C3)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import gguf
import pytest

from edge.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
    require_template,
    validate_messages,
)
from edge.gguf_file import GGUFError, GGUFFile
from tests.conftest import GOLDEN, golden

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen_gguf(qwen_path):
    gf = GGUFFile(qwen_path)
    yield gf
    gf.close()


@pytest.fixture(scope="module")
def gemma_gguf(gemma_path):
    gf = GGUFFile(gemma_path)
    yield gf
    gf.close()


@pytest.fixture(scope="module")
def qwen_template(qwen_gguf):
    return ChatTemplate.from_gguf(qwen_gguf)


def _qwen_cases(gid: str = "qwen2.5-coder-0.5b") -> list[dict]:
    """Golden chat cases (collected at import, so they cannot go through the golden() skip)."""
    path = GOLDEN / gid / "chat.json"
    return json.loads(path.read_text(encoding="utf-8"))["cases"] if path.exists() else []


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path):
    gf = GGUFFile(smollm2_path)
    yield ChatTemplate.from_gguf(gf)
    gf.close()


def _render(source: str, messages=USER_HI, **kwargs) -> str:
    return ChatTemplate(source, "<s>", "</s>").render(messages, **kwargs)


def _write_gguf(path: Path, tokens: list[str], bos_id: int | None, eos_id: int | None,
                template: str | None) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


# --- goldens from llama.cpp's side (llama-cpp-python Jinja2ChatFormatter) --------------------

@pytest.mark.parametrize("case", _qwen_cases(), ids=lambda c: c["messages"][-1]["content"])
def test_qwen_golden_rendered_prompt(qwen_template, case):
    rendered = qwen_template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["rendered_prompt"]


@pytest.mark.parametrize("case", _qwen_cases("smollm2-135m"), ids=lambda c: c["messages"][-1]["content"])
def test_smollm2_golden_rendered_prompt(smollm2_template, case):
    """SmolLM2's template adds its default system message when the first message is not one."""
    rendered = smollm2_template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["rendered_prompt"]


def test_qwen_golden_cases_present():
    assert len(golden("qwen2.5-coder-0.5b", "chat.json")["cases"]) == 3


def test_qwen_special_token_text(qwen_template):
    assert qwen_template.bos_token == "<|endoftext|>"
    assert qwen_template.eos_token == "<|im_end|>"


def test_qwen_without_generation_prompt(qwen_template):
    case = golden("qwen2.5-coder-0.5b", "chat.json")["cases"][0]
    rendered = qwen_template.render(case["messages"], add_generation_prompt=False)
    assert rendered + "<|im_start|>assistant\n" == case["rendered_prompt"]
    assert rendered.endswith("reverses a string.<|im_end|>\n")


def test_qwen_tools_use_hf_tojson(qwen_template):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Météo <ville> & co"}}
    call = {"function": {"name": "get_weather", "arguments": {"ville": "Genève"}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "12 °C"}]
    rendered = qwen_template.render(messages, tools=[tool])
    # ensure_ascii off and no HTML escaping (jinja2's own tojson would write \u003c)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' \
           '"description": "Météo <ville> & co"}}\n</tools>' in rendered
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"ville": "Genève"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n12 °C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in rendered


def test_qwen_user_content_none_is_template_error(qwen_template):
    with pytest.raises(ChatTemplateError, match="failed to render: TypeError"):
        qwen_template.render([{"role": "user", "content": None}])


# --- C3: no template -----------------------------------------------------------------------

def test_gemma_has_no_template(gemma_gguf):
    assert golden("gemma3-270m", "chat.json")["has_template"] is False
    assert ChatTemplate.from_gguf(gemma_gguf) is None


def test_require_template_without_template_says_raw(gemma_gguf):
    with pytest.raises(NoChatTemplateError) as info:
        require_template(gemma_gguf, "gemma-3-270m")
    message = str(info.value)
    assert "'gemma-3-270m' has no chat template" in message
    assert "--raw" in message
    assert isinstance(info.value, ChatTemplateError) and isinstance(info.value, ValueError)
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        require_template(None, "m")


def test_require_template_returns_template(qwen_gguf, qwen_template):
    assert require_template(qwen_template, "qwen") is qwen_template
    assert require_template(qwen_gguf, "qwen").source == qwen_template.source
    with pytest.raises(TypeError, match="expected a GGUFFile, ChatTemplate or None"):
        require_template("{{ x }}", "m")


def test_from_gguf_token_text(tmp_path):
    gf = _write_gguf(tmp_path / "t.gguf", ["<s>", "</s>", "a"], 0, 1, "{{ bos_token }}|{{ eos_token }}")
    assert ChatTemplate.from_gguf(gf).render(USER_HI) == "<s>|</s>"
    gf = _write_gguf(tmp_path / "u.gguf", ["<s>", "</s>"], None, None, "[{{ bos_token }}|{{ eos_token }}]")
    assert ChatTemplate.from_gguf(gf).render(USER_HI) == "[|]"
    gf = _write_gguf(tmp_path / "v.gguf", ["<s>", "</s>"], 0, 1, None)
    assert ChatTemplate.from_gguf(gf) is None
    for i, empty in enumerate(("", " \n")):      # renders every conversation as "": no template
        assert ChatTemplate.from_gguf(_write_gguf(tmp_path / f"e{i}.gguf", ["<s>", "</s>"], 0, 1, empty)) is None


def test_from_gguf_bad_token_id(tmp_path):
    gf = _write_gguf(tmp_path / "t.gguf", ["<s>", "</s>", "a"], 0, 5, "x")
    with pytest.raises(GGUFError, match="tokenizer.ggml.eos_token_id = 5 is not an index"):
        ChatTemplate.from_gguf(gf)


# --- C1: template injection ------------------------------------------------------------------

INJECTIONS = [
    "{{ cycler.__init__.__globals__.os.system('touch TARGET') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch TARGET').read() }}",
    "{{ lipsum.__globals__['os'].system('touch TARGET') }}",
    "{{ namespace.__init__.__globals__['__builtins__']['open']('TARGET', 'w').write('x') }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('TARGET', 'w').write('x') }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch TARGET') }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'TARGET']) }}{% endif %}{% endfor %}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['__import__']('os').system('touch TARGET') }}{% endif %}{% endfor %}",
    "{{ ''|attr('__class__')|attr('__mro__') }}{{ strftime_now.__globals__.datetime }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ messages.__class__ }}",
]


@pytest.mark.parametrize("source", INJECTIONS)
def test_injection_fails_and_runs_nothing(tmp_path, source):
    target = tmp_path / "pwned"
    template = ChatTemplate(source.replace("TARGET", str(target)), "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        template.render(USER_HI)
    assert not target.exists()
    assert ChatTemplate("{{ messages[0].content }}", "", "").render(USER_HI) == "hi"


def test_sandbox_is_immutable():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for source in ("{{ messages.pop() }}", "{% set x = [] %}{{ x.append(1) }}",
                   "{{ messages[0].update({'role': 'system'}) }}"):
        with pytest.raises(ChatTemplateError, match="unsafe"):
            _render(source, messages)
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("source", ["{{ 'a' * 10**9 }}", "{{ 10**9 * ['a'] }}", "{{ 2 ** 100000 }}",
                                    "{{ range(10**6)|length }}"])
def test_resource_bombs_are_refused(source):
    with pytest.raises(ChatTemplateError):
        _render(source)


def test_bounded_operators_still_work():
    assert _render("{{ '=' * 3 }}{{ 2 * 'ab' }}{{ [0] * 2 }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 1.5 * 2 }}") \
        == "===abab[0, 0]1024123.0"


# --- C2: errors and loop controls ------------------------------------------------------------

ALTERNATE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
             "{% endif %}{{ m.content }}{% endfor %}")


def test_raise_exception_message_is_carried():
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert _render(ALTERNATE, good) == "ab"
    with pytest.raises(ChatTemplateError) as info:
        _render(ALTERNATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert str(info.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_loop_controls():
    source = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
              "{% if loop.index > 3 %}{% break %}{% endif %}{{ m.content }};{% endfor %}")
    messages = [{"role": r, "content": c} for r, c in
                [("user", "a"), ("system", "s"), ("assistant", "b"), ("user", "c"), ("user", "d")]]
    assert _render(source, messages) == "a;b;"


def test_parse_error():
    with pytest.raises(ChatTemplateError, match=r"does not parse \(line 2\)"):
        ChatTemplate("ok\n{% for x in %}{% endfor %}", "", "")
    with pytest.raises(ChatTemplateError, match="must be a string"):
        ChatTemplate(None, "", "")


def test_runtime_errors_are_template_errors():
    with pytest.raises(ChatTemplateError, match="UndefinedError: 'foo' is undefined"):
        _render("{{ foo() }}")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        _render("{{ 1 // 0 }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        _render("{{ messages[5].content }}x{{ messages[5].content.upper() }}")


# --- HF rendering rules ----------------------------------------------------------------------

def test_trim_and_lstrip_blocks():
    assert _render("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"


def test_tojson_like_hf():
    data = {"b": "é<&>", "a": [1, 2]}
    assert _render("{{ x|tojson }}", x=data) == '{"b": "é<&>", "a": [1, 2]}'
    assert _render("{{ x|tojson(indent=2) }}", x={"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'
    assert _render("{{ x|tojson(separators=(',', ':')) }}", x=data) == '{"b":"é<&>","a":[1,2]}'
    assert _render("{{ x|tojson(sort_keys=true) }}", x=data) == '{"a": [1, 2], "b": "é<&>"}'
    assert _render("{{ x|tojson(ensure_ascii=true) }}", x="é") == '"\\u00e9"'


def test_strftime_now():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = _render("{{ strftime_now('%Y-%m-%d') }}")
    assert rendered in (before, datetime.now().strftime("%Y-%m-%d"))


def test_variables():
    source = ("{{ bos_token }}{{ tools is none }}{{ add_generation_prompt }}{{ extra }}"
              "{{ messages|length }}{{ eos_token }}")
    assert _render(source, add_generation_prompt=False, extra=7) == "<s>TrueFalse71</s>"
    assert _render("{{ tools|length }}", tools=[{}, {}]) == "2"
    with pytest.raises(ChatTemplateError, match=r"\['bos_token'\] are set by render"):
        _render("x", bos_token="<x>")


# --- message validation ----------------------------------------------------------------------

@pytest.mark.parametrize("messages, problem", [
    ({"role": "user", "content": "hi"}, "messages must be a list, got dict"),
    ([], "messages must not be empty"),
    ([{"role": "user", "content": "a"}, "hi"], r"messages\[1\] must be an object, got str"),
    ([{"content": "a"}], r"messages\[0\].role must be a string"),
    ([{"role": 3, "content": "a"}], r"messages\[0\].role must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\].content must be a string or null, got list"),
    ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string or null, got int"),
])
def test_bad_messages(messages, problem):
    with pytest.raises(ChatTemplateError, match=problem):
        validate_messages(messages)
    with pytest.raises(ChatTemplateError, match=problem):
        _render("x", messages)


def test_good_messages_pass():
    validate_messages([{"role": "user", "content": None, "tool_calls": []}, {"role": "x", "content": ""}])
