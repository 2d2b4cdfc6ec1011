"""Anthropic's Messages API on `edge serve` (edge.server.anthropic), driven with the official
`anthropic` client: one server on the default model (qwen2.5-coder-0.5b-instruct) behind
--api-key, greedy answers of a few tokens.

Expected values come from the same server on another path: the text of /v1/chat/completions
for the same messages (and streamed vs not), its token counts, count_tokens vs a real call."""
from __future__ import annotations

import json

import pytest

from tests.server_process import running

anthropic = pytest.importorskip("anthropic", reason="the Messages API tests talk through the official anthropic "
                                                    "client (pip install -e .[test])")
openai = pytest.importorskip("openai")

MODEL = "qwen2.5-coder-0.5b-instruct"
KEY = "sk-ant-test-51c2"
GREEDY = {"extra_body": {"temperature": 0}}      # this anthropic client has no temperature parameter
HELLO = [{"role": "user", "content": "Say hello in French."}]
SYSTEM = ("You are a helpful assistant. Call a tool when you need data; once a tool result is given, answer the "
          "user in one sentence.")       # without it the 0.5b model answers a tool result with the call again
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "The local time of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory):
    with running(["-m", str(qwen_path), "-np", "2", "-c", "2048", "--api-key", KEY],
                 tmp_path_factory.mktemp("anthropic") / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=120)


def _streamed(client, **kw):
    """(the final message, the raw event types) of a streamed call."""
    with client.messages.stream(**kw) as s:
        types = [e.type for e in s]
        return s.get_final_message(), types


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _raw(server, body: dict, path: str = "/v1/messages", **headers):
    status, _, raw = server.request("POST", path, body, headers={"x-api-key": KEY, **headers})
    return status, json.loads(raw)


def _assert_error(status, body, want_status, kind):
    assert status == want_status, body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def test_plain_answer_streamed_and_not_equals_chat(client, chat):
    m = client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "end_turn" and m.stop_sequence is None
    ref = chat.chat.completions.create(model=MODEL, max_tokens=40, messages=HELLO, temperature=0)
    assert _text(m) == ref.choices[0].message.content and "Bonjour" in _text(m)
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    s, types = _streamed(client, model=MODEL, max_tokens=40, messages=HELLO, **GREEDY)
    assert _text(s) == _text(m) and s.stop_reason == "end_turn" and s.usage.output_tokens == m.usage.output_tokens
    assert s.usage.input_tokens + s.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert s.usage.cache_read_input_tokens == ref.usage.prompt_tokens_details.cached_tokens > 0   # the same prompt
    assert types[:2] == ["message_start", "content_block_start"] and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_stop") == 1


def test_stream_framing(server):
    status, ctype, raw = server.request("POST", "/v1/messages", {"model": MODEL, "max_tokens": 3, "stream": True,
                                                                 "temperature": 0, "messages": HELLO},
                                        headers={"x-api-key": KEY})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e.split("\n") for e in raw.decode().strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    data = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in zip(names, data))           # event name = data type
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert deltas and all(d["type"] == "text_delta" for d in deltas)
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 3


def test_system_is_the_chat_system_message(client, chat):
    system = "You are a pirate. Answer like one."
    as_blocks = [{"type": "text", "text": "You are a pirate."}, {"type": "text", "text": "Answer like one."}]
    m = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=HELLO, **GREEDY)
    ref = chat.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": system}, *HELLO])
    assert _text(m) == ref.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    plain = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    with_system = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO).input_tokens
    blocks = client.messages.count_tokens(model=MODEL, system=as_blocks, messages=HELLO).input_tokens
    assert with_system == ref.usage.prompt_tokens != plain
    joined = chat.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": "You are a pirate.\n\nAnswer like one."}, *HELLO])
    assert blocks == joined.usage.prompt_tokens                # the blocks are joined with a blank line


def test_stop_sequences(client):
    full = _text(client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, **GREEDY))
    word = full.split()[1]                                      # "Comment" in "Bonjour! Comment puis-je ..."
    for m in (client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, stop_sequences=["zzz", word],
                                     **GREEDY),
              _streamed(client, model=MODEL, max_tokens=40, messages=HELLO, stop_sequences=["zzz", word], **GREEDY)[0]):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
        assert _text(m) == full[:full.index(word)]


def test_max_tokens(client):
    for m in (client.messages.create(model=MODEL, max_tokens=3, messages=HELLO, **GREEDY),
              _streamed(client, model=MODEL, max_tokens=3, messages=HELLO, **GREEDY)[0]):
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and _text(m)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_round_trip(client, stream):
    ask = (lambda **kw: _streamed(client, **kw)[0]) if stream else client.messages.create
    kw = {"model": MODEL, "max_tokens": 60, "system": SYSTEM, "tools": [WEATHER, TIME], **GREEDY}
    first = ask(messages=PARIS, **kw)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    messages = [*PARIS, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]}]
    second = ask(messages=messages, **kw)
    assert second.stop_reason in ("end_turn", "max_tokens") and [b.type for b in second.content] == ["text"]
    assert "21" in _text(second)


def test_tool_choice_tool_forces_that_tool(client):
    m = client.messages.create(model=MODEL, max_tokens=60, system=SYSTEM, tools=[WEATHER, TIME], messages=PARIS,
                               tool_choice={"type": "tool", "name": "get_time"}, **GREEDY)
    assert m.stop_reason == "tool_use" and [(b.name, b.input) for b in m.content] == [("get_time", {"city": "Paris"})]
    none = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, tools=[WEATHER], messages=PARIS,
                                  tool_choice={"type": "none"}, **GREEDY)
    assert [b.type for b in none.content] == ["text"] and none.stop_reason in ("end_turn", "max_tokens")


def test_json_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}   # extra_body: older clients lack it
    m = client.messages.create(model=MODEL, max_tokens=60, extra_body={**GREEDY["extra_body"], **fmt},
                               messages=[{"role": "user", "content": "Give the largest city of France as JSON."}])
    value = json.loads(_text(m))
    assert set(value) == {"city", "population"} and isinstance(value["city"], str)
    assert isinstance(value["population"], int) and m.stop_reason == "end_turn"


def test_count_tokens_equals_a_real_call(client):
    kw = {"model": MODEL, "system": SYSTEM, "tools": [WEATHER], "messages": PARIS}
    count = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=1, **kw, **GREEDY)
    assert count == m.usage.input_tokens + m.usage.cache_read_input_tokens > 100    # the tools are in the prompt
    assert client.messages.count_tokens(model=MODEL, messages=PARIS).input_tokens < count


def test_any_model_name_is_the_served_model(client, server):
    """Started with -m, the server answers every model name with its model (llama-server's
    behaviour: Claude Code sends claude-* names)."""
    m = client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HELLO)
    assert m.model == MODEL and 1 <= m.usage.output_tokens <= 2
    assert client.messages.count_tokens(model="claude-nope", messages=HELLO).input_tokens > 0


def test_bad_requests_are_invalid_request_errors(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    bad = [({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]},
            "messages.0.content.1"),
           ({"messages": HELLO, "extra_body": {"temperature": 1.5}}, "temperature"),
           ({"messages": [*HELLO, {"role": "assistant", "content": "Bon"}]}, "messages.1"),
           ({"messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
           ({"messages": HELLO, "stop_sequences": [str(i) for i in range(17)]}, "stop_sequences")]
    for kw, where in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=5, **kw)
        assert e.value.status_code == 400 and e.value.body["type"] == "error", kw
        assert e.value.body["error"]["type"] == "invalid_request_error" and where in e.value.body["error"]["message"]
    assert "max_tokens" in _assert_error(*_raw(server, {"model": MODEL, "messages": HELLO}), 400,
                                         "invalid_request_error")
    _assert_error(*_raw(server, {"model": MODEL, "max_tokens": "5", "messages": HELLO}), 400, "invalid_request_error")
    status, _, raw = server.request("POST", "/v1/messages", b"{", headers={"x-api-key": KEY})
    _assert_error(status, json.loads(raw), 400, "invalid_request_error")
    status, _, raw = server.request("GET", "/v1/messages", headers={"x-api-key": KEY})
    _assert_error(status, json.loads(raw), 405, "invalid_request_error")


def test_api_key_in_either_header(server, client, chat):
    body = {"model": MODEL, "max_tokens": 1, "messages": HELLO}
    assert _raw(server, body)[0] == 200                                          # x-api-key
    assert _raw(server, body, **{"x-api-key": "", "Authorization": f"Bearer {KEY}"})[0] == 200
    assert "API key" in _assert_error(*_raw(server, body, **{"x-api-key": "wrong"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=client.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=HELLO)
    # the other routes take x-api-key too, and keep OpenAI's error shape
    status, chat_body = _raw(server, {"model": MODEL, "max_tokens": 1, "messages": HELLO}, "/v1/chat/completions")
    assert status == 200 and chat_body["usage"]["completion_tokens"] == 1
    status, err = _raw(server, body, "/v1/chat/completions", **{"x-api-key": "wrong"})
    assert status == 401 and err["error"]["code"] == "invalid_api_key"


# ---- the translation, without a server: a reasoning answer, the request's blocks --------------------

class FakeRun:
    """A ChatRun's interface (edge.server.app) over given chat deltas: prompt of 10 tokens, 4 cached."""

    model = MODEL

    def __init__(self, deltas: list[dict], finish: str = "stop", n_out: int = 5):
        self.deltas, self.finish, self.n_out, self.fin = deltas, finish, n_out, None

    def prompt_tokens(self) -> int:
        return 10

    def _end(self):
        from edge.server.scheduler import Finished
        self.fin = Finished(self.finish, 10, self.n_out, 4)

    async def chunks(self):
        yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        for d in self.deltas:
            yield {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": self.finish}]}
        self._end()

    async def complete(self):
        message: dict = {"role": "assistant", "content": "".join(d.get("content", "") for d in self.deltas) or None}
        for d in self.deltas:
            if "reasoning_content" in d:
                message["reasoning_content"] = message.get("reasoning_content", "") + d["reasoning_content"]
            if d.get("tool_calls"):
                message.setdefault("tool_calls", []).append(d["tool_calls"][0])
        self._end()
        return {"choices": [{"index": 0, "message": message, "finish_reason": self.finish}]}

    def timing(self):
        return self.fin

    def cancel(self):
        pass


THINKING = [{"reasoning_content": "The user", "reasoning": "The user"}, {"reasoning_content": " greets."},
            {"content": "Hi"}, {"content": "!"}]
CALL = [{"content": "Let me look."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                                       "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]


def _run_async(coro_or_gen):
    import asyncio

    async def collect():
        if hasattr(coro_or_gen, "__anext__"):
            return [x async for x in coro_or_gen]
        return await coro_or_gen
    return asyncio.run(collect())


def _events(frames: list[str]) -> list[dict]:
    out = []
    for frame in frames:
        name, data = frame.rstrip("\n").split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert out[-1]["type"] == name.removeprefix("event: ")
    return out


@pytest.mark.parametrize("deltas,blocks,stop", [(THINKING, ["thinking", "text"], "end_turn"),
                                                (CALL, ["text", "tool_use"], "tool_use")], ids=["thinking", "call"])
def test_answer_blocks_whole_and_streamed(deltas, blocks, stop):
    from pydantic import TypeAdapter

    from edge.server import anthropic as A
    whole = json.loads(_run_async(A._complete(FakeRun(deltas))).body)
    m = anthropic.types.Message.model_validate(whole)                  # every field the client reads
    assert [b.type for b in m.content] == blocks and m.stop_reason == stop
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (6, 4, 5)
    events = _events(_run_async(A._frames(FakeRun(deltas))))
    parse = TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python
    [parse(e) for e in events if e["type"] != "ping"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == blocks and [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    deltas_of = {i: [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == i]
                 for i in (0, 1)}
    if blocks[0] == "thinking":
        assert whole["content"][0] == {"type": "thinking", "thinking": "The user greets.", "signature": ""}
        assert [d["thinking"] for d in deltas_of[0]] == ["The user", " greets."]
        assert [d["text"] for d in deltas_of[1]] == ["Hi", "!"]
    else:
        assert whole["content"][1] == {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}
        assert deltas_of[1] == [{"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}]
    assert events[-2]["delta"]["stop_reason"] == stop and events[-2]["usage"]["input_tokens"] == 6


def test_request_blocks_become_chat_messages():
    from edge.server.anthropic import MessagesRequest, chat_request
    body = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "thinking": {"type": "disabled"}, "stop_sequences": ["END"], "top_k": 1,
        "messages": [{"role": "user", "content": "Weather and time in Paris?"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "Two tools.", "signature": "x"},
                         {"type": "text", "text": "Checking."},
                         {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                         {"type": "tool_use", "id": "t2", "name": "get_time", "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "21 C"}]},
                         {"type": "tool_result", "tool_use_id": "t2", "content": "no clock", "is_error": True},
                         {"type": "text", "text": "Thanks."}]}]})
    chat = chat_request(body)
    got = [(m.role, m.text(), [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []],
            m.tool_call_id) for m in chat.messages]
    assert got == [("system", "Be brief.", [], None), ("user", "Weather and time in Paris?", [], None),
                   ("assistant", "Checking.", [("t1", "get_weather", '{"city": "Paris"}'),
                                               ("t2", "get_time", '{"city": "Paris"}')], None),
                   ("tool", "21 C", [], "t1"), ("tool", "Error: no clock", [], "t2"), ("user", "Thanks.", [], None)]
    assert (chat.reasoning_effort, chat.stop, chat.top_k, chat.max_tokens) == ("none", ["END"], 1, 9)
    effort = MessagesRequest.model_validate({"model": MODEL, "messages": HELLO, "output_config": {"effort": "max"}})
    assert chat_request(effort).reasoning_effort == "xhigh"


def test_cors_preflight_needs_no_key_and_x_api_key_works(server):
    """With --api-key: a browser's preflight (OPTIONS, no credentials) is answered before the
    key check; the request itself needs the key, as Authorization: Bearer or X-Api-Key."""
    conn = server.connection()
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-api-key"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("access-control-allow-origin") == "http://localhost:3000"
    r.read()
    conn.close()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    for headers, want in (({}, 401), ({"X-Api-Key": "wrong"}, 401), ({"X-Api-Key": KEY}, 200),
                          ({"Authorization": f"Bearer {KEY}"}, 200)):
        conn = server.connection()
        conn.request("POST", "/chat/completions", body, headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        assert r.status == want, (headers, r.read())
        r.read()
        conn.close()
