"""`edge serve` on the tiny reasoning model (tests/tiny_reasoning.py) through the openai client:
the <think> block in message.reasoning_content and message.reasoning, streamed as its own
deltas before the content, with the tags whole, split over tokens, opened by the template, or
turned off (chat_template_kwargs, reasoning_effort); --reasoning-budget on a second server.

The model is driven to known text by logit_bias (tiny_reasoning.driving_body), so expected
values are exact strings and token counts."""
from __future__ import annotations

import pytest

from tests.server_process import Server, assert_error
from tests.tiny_reasoning import ANSWER, NO_THINK, OPENED, REASONING, SPACED, SPLIT_TAGS, WHOLE_TAGS, driving_body, \
    write_tiny_reasoning_model

openai = pytest.importorskip("openai", reason="the server tests talk through the official openai client "
                                               "(pip install -e .[test])")

HI = [{"role": "user", "content": "hi"}]
N_PROMPT = 24                  # HI's prompt tokens; the empty think block adds 6, an opened <think> 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_reasoning_model(tmp_path_factory.mktemp("reasoning") / "tiny_think.gguf", pytest.MonkeyPatch())


def _serve(model, folder, *args):
    srv = Server(["-m", str(model), "-np", "2", "-c", "128", *args], folder / "serve.log")
    srv.wait_ready(60)
    return srv


@pytest.fixture(scope="module")
def srv(model, tmp_path_factory):
    s = _serve(model, tmp_path_factory.mktemp("serve"))
    try:
        yield s
    finally:
        s.stop()


def _client(s: Server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0, timeout=60)


def _ask(s: Server, words, stream=False, **fields):
    body = {**driving_body(words), **fields}
    bias = body.pop("logit_bias")
    return _client(s).chat.completions.create(model="tiny_think", messages=HI, stream=stream, logit_bias=bias,
                                               max_tokens=body.pop("max_tokens"), temperature=body.pop("temperature"),
                                               extra_body=body)


def _fields(obj) -> dict:
    return {k: v for k, v in (obj.model_extra or {}).items() if k in ("reasoning_content", "reasoning")}


@pytest.mark.parametrize("words,fields", [(WHOLE_TAGS, {}), (SPLIT_TAGS, {}), (SPACED, {}),
                                          (OPENED, {"chat_template_kwargs": {"open_think": True}})],
                         ids=["whole-tags", "split-tags", "spaces", "opened-by-template"])
def test_reasoning_in_its_own_fields(srv, words, fields):
    r = _ask(srv, words, **fields)
    m = r.choices[0].message
    assert (m.content, _fields(m)) == (ANSWER, {"reasoning_content": REASONING, "reasoning": REASONING})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", len(words))
    assert r.usage.prompt_tokens == N_PROMPT + (3 if fields else 0)


@pytest.mark.parametrize("words,fields", [(WHOLE_TAGS, {}), (SPLIT_TAGS, {}), (SPACED, {}),
                                          (OPENED, {"chat_template_kwargs": {"open_think": True}})],
                         ids=["whole-tags", "split-tags", "spaces", "opened-by-template"])
def test_reasoning_streamed_before_the_content(srv, words, fields):
    """Every reasoning delta comes before every content delta, none holds a piece of a tag,
    and the logprobs of all the tokens arrive."""
    chunks = list(_ask(srv, words, stream=True, logprobs=True, **fields))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    kinds, reasoning, content, n_logprobs = [], "", "", 0
    for ch in chunks[1:-1]:
        choice = ch.choices[0]
        delta, extra = choice.delta, _fields(choice.delta)
        n_logprobs += len(choice.logprobs.content) if choice.logprobs else 0
        if extra:
            assert extra["reasoning_content"] == extra["reasoning"] and delta.content is None, ch
            kinds.append("reasoning")
            reasoning += extra["reasoning"]
            piece = extra["reasoning"]
        else:
            kinds.append("content")
            content += delta.content
            piece = delta.content
        assert "<" not in piece and ">" not in piece and (piece or choice.logprobs), ch   # "": a held token
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "content" in kinds
    assert (reasoning, content) == (REASONING, ANSWER)
    assert n_logprobs == len(words)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].delta.content is None


def test_thinking_turned_off(srv):
    """enable_thinking false (and reasoning_effort "none") reach the template, which writes an
    empty block; the answer has no reasoning fields. Other efforts are accepted."""
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = _ask(srv, NO_THINK, **fields)
        m = r.choices[0].message
        assert (m.content, _fields(m), r.usage.prompt_tokens) == (ANSWER, {}, N_PROMPT + 6), fields
        chunks = list(_ask(srv, NO_THINK, stream=True, **fields))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
        assert not any(_fields(c.choices[0].delta) for c in chunks)
    r = _ask(srv, WHOLE_TAGS, reasoning_effort="high", chat_template_kwargs={"note": "hi <think>", "n": 1.5})
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == (ANSWER, N_PROMPT)


@pytest.mark.parametrize("fields,param,code", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ({"reasoning_effort": 1}, "reasoning_effort", "invalid_value"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "invalid_value"),
    ({"chat_template_kwargs": {"x": [1]}}, "chat_template_kwargs.x", "invalid_value"),
    ({"chat_template_kwargs": {"x": "<|im_start|>system"}}, "chat_template_kwargs.x", "invalid_value"),
    ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs.messages", "invalid_value"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs.self", "invalid_value"),
])
def test_bad_reasoning_fields_are_400(srv, fields, param, code):
    status, body = srv.post("/v1/chat/completions", {"messages": HI, "max_tokens": 1, **fields})
    assert_error(status, body, 400, param=param, code=code)


def test_reasoning_budget(model, tmp_path_factory):
    """--reasoning-budget 1: </think> is forced after one reasoning token; the answer goes on."""
    s = _serve(model, tmp_path_factory.mktemp("budget"), "--reasoning-budget", "1")
    try:
        r = _ask(s, WHOLE_TAGS)
        m = r.choices[0].message
        assert (m.content, _fields(m)) == ("okThe answer is 4.", {"reasoning_content": "Hmm", "reasoning": "Hmm"})
        chunks = list(_ask(s, WHOLE_TAGS, stream=True))
        assert [_fields(c.choices[0].delta).get("reasoning") or c.choices[0].delta.content for c in chunks[1:-1]] \
            == ["Hmm", "ok", "The", " answer", " is", " 4", "."]
    finally:
        s.stop()
