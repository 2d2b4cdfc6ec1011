"""OpenAI's Responses API on `edge serve` (edge.server.responses), driven with the official
`openai` client (responses.create, responses.stream, responses.parse): one server on the
default model (qwen2.5-coder-0.5b-instruct), greedy answers of a few tokens.

Expected values come from the same server on another path: the text and token counts of
/v1/chat/completions for the same messages, and streamed vs not."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tests.server_process import running

openai = pytest.importorskip("openai", reason="the server tests talk through the official openai client "
                                               "(pip install -e .[test])")

MODEL = "qwen2.5-coder-0.5b-instruct"
HELLO = "Say hello in French."
SYSTEM = ("You are a helpful assistant. Call a tool when you need data; once a tool result is given, answer the "
          "user in one sentence.")       # without it the 0.5b model answers a tool result with the call again
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "The local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARIS = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory):
    with running(["-m", str(qwen_path), "-np", "2", "-c", "2048"],
                 tmp_path_factory.mktemp("responses") / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120)


def _streamed(client, **kw):
    """(the final response, the event types) through the client's accumulation (responses.stream)."""
    with client.responses.stream(**kw) as s:
        types = [e.type for e in s]
        return s.get_final_response(), types


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_plain_answer_streamed_and_not_equals_chat(client):
    r = client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed" and r.model == MODEL
    assert r.incomplete_details is None and r.error is None
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    assert item.content[0].annotations == []
    ref = _chat(client, [{"role": "user", "content": HELLO}], max_tokens=40)
    assert r.output_text == ref.choices[0].message.content and "Bonjour" in r.output_text
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    s, types = _streamed(client, model=MODEL, input=HELLO, temperature=0, max_output_tokens=40)
    assert s.output_text == r.output_text and s.status == "completed" and s.usage.output_tokens == u.output_tokens
    assert s.usage.input_tokens_details.cached_tokens == ref.usage.prompt_tokens_details.cached_tokens > 0
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    events = list(client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=40,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_stream_framing(server):
    status, ctype, raw = server.request("POST", "/v1/responses", {"model": MODEL, "input": HELLO, "stream": True,
                                                                  "max_output_tokens": 2, "temperature": 0})
    assert status == 200 and ctype.startswith("text/event-stream")
    for frame in raw.decode().strip().split("\n\n"):
        name, data = frame.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


def test_instructions_are_the_system_message(client):
    r = client.responses.create(model=MODEL, instructions="You are a pirate.", input=HELLO, temperature=0,
                                max_output_tokens=8)
    ref = _chat(client, [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": HELLO}],
                max_tokens=8)
    assert r.output_text == ref.choices[0].message.content and r.instructions == "You are a pirate."
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    plain = client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=1)
    assert plain.usage.input_tokens != r.usage.input_tokens
    # the same as items: a developer message, then the user's as input_text parts
    items = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"role": "developer", "content": "You are a pirate."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": HELLO}]}])
    assert (items.output_text, items.usage.input_tokens) == (r.output_text, r.usage.input_tokens)


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text
    events = list(client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_call_round_trip(client, stream):
    ask = (lambda **kw: _streamed(client, **kw)[0]) if stream else client.responses.create
    kw = {"model": MODEL, "instructions": SYSTEM, "tools": [WEATHER, TIME], "temperature": 0, "max_output_tokens": 60}
    first = ask(input=PARIS, **kw)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert call.id.startswith("fc_")
    second = ask(input=[{"role": "user", "content": PARIS},
                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": json.dumps({"temp_c": 21, "sky": "sunny"})}], **kw)
    assert [o.type for o in second.output] == ["message"] and "21" in second.output_text


def test_tool_choice_named_function(client):
    r = client.responses.create(model=MODEL, instructions=SYSTEM, input=PARIS, tools=[WEATHER, TIME], temperature=0,
                                max_output_tokens=60, tool_choice={"type": "function", "name": "get_time"})
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [("function_call", "get_time",
                                                                              {"city": "Paris"})]


class City(BaseModel):
    city: str
    population: int


def test_json_schema_output_parses_and_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    ask = "Give the largest city of France as JSON."
    r = client.responses.create(model=MODEL, input=ask, temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    parsed = client.responses.parse(model=MODEL, input=ask, temperature=0, max_output_tokens=60, text_format=City)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.model_dump() == value
    obj = client.responses.create(model=MODEL, input=ask, temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_store_is_accepted_and_previous_response_id_refused(client):
    r = client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=1, store=True,
                                metadata={"k": "v"})
    assert r.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=HELLO, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]


def test_errors(client, server):
    assert client.responses.create(model="gpt-5-codex", input=HELLO, max_output_tokens=1).model == MODEL   # -m: any name
    bad = [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
            "input.0.content.0"),
           ({"input": HELLO, "tools": [{"type": "web_search"}]}, "tools.0.type"),
           ({"input": HELLO, "tools": [{**WEATHER, "name": "bad name!"}]}, "tools.0.name"),
           ({"input": HELLO, "temperature": 3}, "temperature"),
           ({"input": HELLO, "max_output_tokens": 0}, "max_output_tokens"),
           ({"input": HELLO, "reasoning": {"effort": "huge"}}, "reasoning.effort"),
           ({"input": HELLO, "text": {"format": {"type": "json_schema", "name": "x",
                                                  "schema": {"type": "intger"}}}}, "text.format"),
           ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    status, body = server.post("/v1/responses", {"model": MODEL})
    assert status == 400 and body["error"]["param"] == "input"


# ---- the translation, without a server ------------------------------------------------------------

def test_answer_items_whole_and_streamed_validate():
    """A reasoning answer and a call through the Responses shapes, each event checked against the
    openai package's types (the run is a stand-in: tests/test_server_anthropic.FakeRun)."""
    from pydantic import TypeAdapter

    from edge.server import responses as R
    from tests.test_server_anthropic import CALL, THINKING, FakeRun, _events, _run_async

    class Tok:
        def encode(self, text, add_special, parse_special):
            return text.split()

    body = R.ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "max_output_tokens": 5})
    parse = TypeAdapter(openai.types.responses.ResponseStreamEvent).validate_python
    for deltas, kinds in ((THINKING, ["reasoning", "message"]), (CALL, ["message", "function_call"])):
        for finish, status in (("stop", "completed"), ("length", "incomplete")):
            status = "completed" if deltas is CALL else status      # a whole call: the answer is complete
            run = FakeRun(deltas, finish)
            run.engine = type("E", (), {"tokenizer": Tok()})
            whole = openai.types.responses.Response.model_validate(
                json.loads(_run_async(R._complete(R._Answer(body, run))).body))
            assert [o.type for o in whole.output] == kinds and whole.status == status
            assert whole.usage.input_tokens == 10 and whole.usage.input_tokens_details.cached_tokens == 4
            assert whole.usage.output_tokens_details.reasoning_tokens == (3 if kinds[0] == "reasoning" else 0)
            run = FakeRun(deltas, finish)
            run.engine = type("E", (), {"tokenizer": Tok()})
            events = [parse(e) for e in _events(_run_async(R._frames(R._Answer(body, run))))]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].type == f"response.{status}"
            same = {"exclude": {"id", "created_at", "output"}}
            assert events[-1].response.model_dump(**same) == whole.model_dump(**same)
            assert [o.model_dump() for o in events[-1].response.output] == [
                {**o.model_dump(), "id": n.id} for o, n in zip(whole.output, events[-1].response.output)]
            assert [e.item.type for e in events if e.type == "response.output_item.done"] == kinds
            if kinds[0] == "reasoning":
                assert [e.delta for e in events if e.type == "response.reasoning_text.delta"] == ["The user", " greets."]
                assert whole.output[0].content[0].text == "The user greets." and whole.output[1].content[0].text == "Hi!"
            else:
                assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [
                    '{"city": "Paris"}'] == [whole.output[1].arguments]
            assert whole.output[-1].status == status and whole.output[0].status == "completed"


def test_input_items_become_chat_messages():
    from edge.server.responses import ResponsesRequest, chat_request
    body = ResponsesRequest.model_validate({"model": MODEL, "instructions": "Be brief.", "reasoning": {"effort": "none"},
                                            "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}]})
    chat = chat_request(body)
    got = [(m.role, m.text(), [(c.id, c.function.name) for c in m.tool_calls or []], m.tool_call_id)
           for m in chat.messages]
    assert got == [("system", "Be brief.", [], None), ("user", "Weather in Paris?", [], None),
                   ("assistant", "Checking.", [("c1", "get_weather"), ("c2", "get_time")], None),
                   ("tool", "21 C", [], "c1"), ("tool", "noon", [], "c2")]
    assert chat.reasoning_effort == "none"
