"""Ollama's API on `edge serve` (edge.server.ollama) through the official `ollama` Python client.

One server per module on the default model (qwen2.5-coder-0.5b-instruct, -np 2, -c 1024):
/api/chat and /api/generate streamed and not, options (num_predict caps eval_count; greedy
equals /v1/chat/completions' and /v1/completions' greedy text for the same input), format json
and a schema, a tool call round trip with arguments as an object, logprobs, load / unload,
list() / show() / ps(), /api/version and GET /, and errors in Ollama's shape (404 for an unknown
model, 400 for a bad request, 415, 501). Raw HTTP (http.client) checks the NDJSON framing and
the error bodies. Greedy and short answers throughout.

Expected values come from the model file (edge.gguf_file, edge.store's registry), from the same
server's OpenAI routes, and from Ollama's docs/api.md for the shapes.
"""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest

from edge.server.app import ROOT_TEXT
from edge.server.protocol import parse_keep_alive

import edge
from edge.gguf_file import GGUFFile
from edge.server import ollama as O
from edge.server import protocol as P
from edge.store import REGISTRY, list_models
from tests.server_process import running, start_post

ollama = pytest.importorskip("ollama", reason="the Ollama API tests talk through the official ollama client "
                                               "(pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI routes give the expected texts (pip install -e .[test])")

MODEL = "qwen2.5-coder-0.5b-instruct"
N_CTX = 1024
HELLO = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory):
    with running(["-m", str(qwen_path), "-np", "2", "-c", str(N_CTX)],
                 tmp_path_factory.mktemp("oserve") / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120)


def _ndjson(raw: bytes) -> list[dict]:
    """The objects of an NDJSON body; asserts one JSON object per line, each line ended."""
    text = raw.decode()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text[:-1].split("\n")]


def _error(server, method: str, path: str, body=None, headers=None) -> tuple[int, str]:
    """(status, message) of a request that fails; asserts Ollama's shape {"error": str}."""
    status, _, raw = server.request(method, path, body, headers=headers)
    out = json.loads(raw)
    assert set(out) == {"error"} and isinstance(out["error"], str) and out["error"], out
    return status, out["error"]


def _assert_stats(r, prompt_tokens: int | None = None, completion_tokens: int | None = None):
    """The done object's durations (ns) and counts."""
    assert r.done is True
    assert r.eval_count >= 1 and r.prompt_eval_count >= 1
    if prompt_tokens is not None:
        assert r.prompt_eval_count == prompt_tokens
    if completion_tokens is not None:
        assert r.eval_count == completion_tokens
    assert r.prompt_eval_duration > 0 and r.eval_duration > 0 and r.load_duration >= 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    assert r.total_duration < 120 * 10**9


# ---- without a server -----------------------------------------------------------------------------

def test_keep_alive_parsing():
    """Ollama's durations (Go's time.ParseDuration) and numbers, as seconds; negative: None (kept)."""
    cases = {0: 0.0, "0": 0.0, 300: 300.0, 2.5: 2.5, "5m": 300.0, "1h30m": 5400.0, "300ms": 0.3,
             "1.5h": 5400.0, "-1": None, -1: None, "-1m": None, "10": 10.0, "90s": 90.0}
    for value, want in cases.items():
        assert parse_keep_alive(value) == want, value
    for bad in ("5 minutes", "m", "5x", "1h-3m", "", None):
        with pytest.raises(P.APIError) as e:
            parse_keep_alive(bad)
        assert e.value.status == 400 and e.value.param == "keep_alive"


def test_keep_alive_reaches_the_chat_request():
    """keep_alive is passed as given in the chat / completion request the model pool reads."""
    body = O.ChatBody.model_validate({"model": MODEL, "messages": HELLO, "keep_alive": "10m"})
    req = P.ChatCompletionRequest.model_validate({**O._Ollama._sampling(body), "messages": HELLO})
    assert req.keep_alive == "10m" and parse_keep_alive(req.keep_alive) == 600.0
    body = O.GenerateBody.model_validate({"model": MODEL, "prompt": "x", "keep_alive": -1})
    assert P.CompletionRequest.model_validate({**O._Ollama._sampling(body), "prompt": "x"}).keep_alive == -1
    assert P.ChatCompletionRequest.model_validate({"messages": HELLO}).keep_alive is None


def test_names_and_numbers():
    assert O.edge_name("qwen2.5-coder-0.5b-instruct:latest") == "qwen2.5-coder-0.5b-instruct"
    assert O.edge_name("hf.co/u/r:Q4_K_M") == "hf.co/u/r:Q4_K_M"
    assert O.ollama_name("smollm2-135m-instruct") == "smollm2-135m-instruct:latest"
    assert O.ollama_name("hf.co/u/r:Q4_K_M") == "hf.co/u/r:Q4_K_M"
    # Ollama's format.HumanNumber
    assert [O.human_number(n) for n in (7_615_616_512, 8_000_000_000, 494_032_768, 135_000_000, 12_345, 999)] == \
        ["7.6B", "8B", "494.03M", "135M", "12K", "999"]


def test_ndjson_errors():
    """An error before the first line raises (the route answers with its status); a later one
    is a last line {"error": ...}; the run is cancelled either way."""
    class Run:
        cancelled = 0

        def cancel(self):
            self.cancelled += 1

    async def objects(fail_at):
        for i in range(3):
            if i == fail_at:
                raise P.APIError(503, "the KV cache's file system is full")
            yield {"i": i}

    async def body(resp):
        return b"".join([chunk async for chunk in resp.body_iterator])

    run = Run()
    with pytest.raises(P.APIError):
        asyncio.run(O._ndjson(objects(0), run))
    assert run.cancelled == 1

    async def later():
        resp = await O._ndjson(objects(2), run)
        assert resp.media_type == "application/x-ndjson"
        return await body(resp)
    assert _ndjson(asyncio.run(later())) == [{"i": 0}, {"i": 1}, {"error": "the KV cache's file system is full"}]
    assert run.cancelled == 2


# ---- models -----------------------------------------------------------------------------------------

def test_root_and_version(server):
    status, ctype, raw = server.request("GET", "/")
    assert (status, raw) == (200, ROOT_TEXT.encode()) and ctype.startswith("text/plain")
    assert server.request("HEAD", "/")[0] == 200
    assert server.get("/api/version") == (200, {"version": O.OLLAMA_API_VERSION, "edge_version": edge.__version__})


def test_list(client, qwen_path):
    """list() of a -m server: its one model (the chat routes answer 404 for the others; a
    router server lists every readable pulled model), tagged :latest, with the file's size,
    mtime, the registry's SHA-256 and details from the GGUF header."""
    models = {m.model: m for m in client.list().models}
    assert set(models) == {f"{MODEL}:latest"} and f"{MODEL}:latest" in {f"{m['name']}:latest" for m in list_models()}
    m = models[f"{MODEL}:latest"]
    st = qwen_path.stat()
    assert m.size == st.st_size == REGISTRY[MODEL].size
    assert m.digest == REGISTRY[MODEL].sha256
    assert m.modified_at == datetime.fromtimestamp(st.st_mtime, timezone.utc)
    gf = GGUFFile(qwen_path)
    try:
        n_params = sum(t.n_elements for t in gf.tensors.values())
        assert gf.get_int("general.file_type") == 15          # llama_ftype MOSTLY_Q4_K_M
    finally:
        gf.close()
    assert n_params == 630_167_424
    assert m.details.model_dump() == {"parent_model": "", "format": "gguf", "family": "qwen2", "families": ["qwen2"],
                                      "parameter_size": "630.17M", "quantization_level": "Q4_K_M"}


def test_show(client, qwen_path, smollm2_path):
    s = client.show(f"{MODEL}:latest")
    gf = GGUFFile(qwen_path)
    try:
        template = gf.get_str("tokenizer.chat_template")
    finally:
        gf.close()
    assert s.template == template
    assert s.capabilities == ["completion", "tools"]          # Qwen2.5's template renders tools
    assert s.modelinfo["general.architecture"] == "qwen2"
    assert s.modelinfo["qwen2.context_length"] == 32768
    assert s.modelinfo["general.parameter_count"] == 630_167_424
    assert s.modelinfo["tokenizer.ggml.tokens"] == []         # arrays only with verbose, as Ollama
    assert s.parameters.split() == ["num_ctx", str(N_CTX)]
    assert f"FROM {qwen_path}" in s.modelfile
    assert s.details.family == "qwen2"
    small = client.show("smollm2-135m-instruct")              # pulled, not loaded
    assert small.capabilities == ["completion"] and small.modelinfo["llama.context_length"] == 8192
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and e.value.error == 'model "llama3.2" not found'


def test_ps(client, qwen_path):
    (m,) = client.ps().models
    assert m.model == m.name == f"{MODEL}:latest"
    assert (m.size, m.size_vram, m.context_length) == (qwen_path.stat().st_size, 0, N_CTX)
    assert m.digest == REGISTRY[MODEL].sha256
    assert m.expires_at.year > 2300                            # kept: "Forever" in `ollama ps`
    assert m.details.quantization_level == "Q4_K_M"


def test_load_and_unload(client):
    """No prompt / no messages: the model is loaded (done_reason "load"); with keep_alive 0,
    "unload" (one model per server: it stays)."""
    r = client.generate(model=MODEL)
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    r = client.generate(model=MODEL, keep_alive=0)
    assert (r.done, r.done_reason) == (True, "unload")
    r = client.chat(model=MODEL, messages=[], keep_alive="10m")
    assert (r.done, r.done_reason, r.message.content) == (True, "load", "")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope")
    assert e.value.status_code == 404


# ---- generation ---------------------------------------------------------------------------------

def test_chat_greedy_equals_openai(client, oai):
    r = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 24})
    want = oai.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=24)
    assert r.message.role == "assistant"
    assert r.message.content == want.choices[0].message.content and len(r.message.content) > 20
    assert r.done_reason == want.choices[0].finish_reason == "length"
    _assert_stats(r, want.usage.prompt_tokens, want.usage.completion_tokens)
    assert r.model == MODEL


def test_chat_streamed_equals_not(client):
    parts = list(client.chat(model=f"{MODEL}:latest", messages=HELLO, options={**GREEDY, "num_predict": 16},
                             stream=True))
    whole = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 16})
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) > 3
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.message.content == "" and last.done_reason == "length" and last.model == f"{MODEL}:latest"
    _assert_stats(last, whole.prompt_eval_count, 16)


def test_stream_is_the_default_ndjson(server):
    """Without "stream", /api/chat streams (Ollama's default): application/x-ndjson lines."""
    status, ctype, raw = server.request("POST", "/api/chat", {"model": MODEL, "messages": HELLO,
                                                              "options": {**GREEDY, "num_predict": 4}})
    assert status == 200 and ctype == "application/x-ndjson"
    lines = _ndjson(raw)
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert set(lines[-1]) == {"model", "created_at", "message", "done", "done_reason", "total_duration",
                              "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                              "eval_duration"}
    assert lines[-1]["eval_count"] == 4 and lines[-1]["done_reason"] == "length"
    assert all(x["created_at"].endswith("Z") for x in lines)


def test_client_gone_mid_stream(server):
    """A client that closes the stream after its first line: the generation is cancelled and
    its KV blocks freed."""
    before = server.wait_idle()
    conn = start_post(server, "/api/chat", {"model": MODEL, "messages": HELLO, "options": {"num_predict": 400}})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.readline())["done"] is False
    conn.close()
    after = server.wait_idle(10)
    assert after["edge_generation_tokens_total"] - before["edge_generation_tokens_total"] < 400


def test_num_predict(client):
    r = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 5})
    assert (r.eval_count, r.done_reason) == (5, "length")
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Reply with the single word: yes"}],
                    options={**GREEDY, "num_predict": -1, "num_ctx": 32768, "num_gpu": 99, "not_an_option": 1})
    assert r.done_reason == "stop" and 1 <= r.eval_count < 10      # -1: no limit; the answer ends by itself


def test_options_sample(client):
    """Sampling options reach the sampler: the same seed gives the same text, top_k 1 is greedy."""
    opts = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 7, "num_predict": 12}
    a = client.chat(model=MODEL, messages=HELLO, options=opts)
    b = client.chat(model=MODEL, messages=HELLO, options=opts)
    assert a.message.content == b.message.content
    greedy = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 12})
    top1 = client.chat(model=MODEL, messages=HELLO, options={"temperature": 1.5, "top_k": 1, "num_predict": 12})
    assert top1.message.content == greedy.message.content
    stop = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 24, "stop": ["def"]})
    assert "def" not in stop.message.content and stop.done_reason == "stop"


def test_generate(client, oai):
    """prompt through the chat template equals chat with that user message; raw: true equals
    /v1/completions on the prompt as it is; streamed equals not."""
    opts = {**GREEDY, "num_predict": 10}
    r = client.generate(model=MODEL, prompt=HELLO[0]["content"], options=opts)
    chat = client.chat(model=MODEL, messages=HELLO, options=opts)
    assert r.response == chat.message.content and r.done_reason == "length"
    assert r.context is None
    _assert_stats(r, chat.prompt_eval_count, 10)
    system = client.generate(model=MODEL, prompt=HELLO[0]["content"], system="Answer in French.", options=opts)
    want = client.chat(model=MODEL, messages=[{"role": "system", "content": "Answer in French."}, *HELLO],
                       options=opts)
    assert system.response == want.message.content
    raw = client.generate(model=MODEL, prompt="def add(a, b):", raw=True, options=opts)
    cmpl = oai.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=10)
    assert raw.response == cmpl.choices[0].text and raw.prompt_eval_count == cmpl.usage.prompt_tokens
    parts = list(client.generate(model=MODEL, prompt="def add(a, b):", raw=True, options=opts, stream=True))
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done and parts[-1].eval_count == 10


def test_format_json(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a person's name "
                                                                      "and age."}],
                    format="json", options={**GREEDY, "num_predict": 48})
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    r = client.generate(model=MODEL, prompt="Ollama is 22 years old. Reply in JSON.", format=schema,
                        options={**GREEDY, "num_predict": 48}, stream=False)
    value = json.loads(r.response)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and r.done_reason == "stop"


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
      city: The city's name

    Returns:
      str: the weather
    """
    return "sunny, 21 C"


def test_tool_call_round_trip(client, oai):
    """A call comes back with its arguments as an object; the call and the tool's answer sent
    back give the same text as the OpenAI route's for the same history."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(model=MODEL, messages=ask, tools=[get_weather], options={**GREEDY, "num_predict": 48})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert r.message.content == "" and r.done_reason == "stop"
    streamed = [p for p in client.chat(model=MODEL, messages=ask, tools=[get_weather], stream=True,
                                       options={**GREEDY, "num_predict": 48}) if p.message.tool_calls]
    assert [p.message.tool_calls[0].function.model_dump() for p in streamed] == [call.function.model_dump()]

    history = [*ask, r.message, {"role": "tool", "content": get_weather("Paris"), "tool_name": "get_weather"}]
    answer = client.chat(model=MODEL, messages=history, options={**GREEDY, "num_predict": 16})
    openai_history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": get_weather("Paris"), "name": "get_weather"}]
    want = oai.chat.completions.create(model=MODEL, messages=openai_history, temperature=0, max_tokens=16)
    assert answer.message.content == want.choices[0].message.content and answer.message.content


def test_logprobs(client):
    r = client.chat(model=MODEL, messages=HELLO, logprobs=True, top_logprobs=2, options={**GREEDY, "num_predict": 6})
    assert len(r.logprobs) == r.eval_count == 6
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == lp.logprob   # greedy


def test_think(client):
    """think false passes (the template's enable_thinking off); true on a model that does not
    reason is Ollama's 400."""
    plain = client.chat(model=MODEL, messages=HELLO, options={**GREEDY, "num_predict": 8})
    off = client.chat(model=MODEL, messages=HELLO, think=False, options={**GREEDY, "num_predict": 8})
    assert off.message.content == plain.message.content and off.message.thinking is None
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=HELLO, think=True)
    assert (e.value.status_code, e.value.error) == (400, f'"{MODEL}" does not support thinking')


# ---- errors -----------------------------------------------------------------------------------------

def test_unknown_model(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=HELLO)
    assert (e.value.status_code, e.value.error) == (404, 'model "llama3.2" not found, try pulling it first')
    with pytest.raises(ollama.ResponseError) as e:      # streamed: the status before any line
        list(client.generate(model="llama3.2", prompt="hi", stream=True))
    assert e.value.status_code == 404


def test_bad_requests(server, client):
    """400s in Ollama's shape, naming the field; 415 without JSON's content type; 501 for
    routes edge does not serve."""
    chat = {"model": MODEL, "messages": HELLO}
    cases = [
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({**chat, "options": {"temperature": "hot"}}, "options.temperature"),
        ({**chat, "options": {"temperature": 3}}, "options.temperature"),
        ({**chat, "options": {"typical_p": 0.5}}, "options.typical_p"),
        ({**chat, "format": "yaml"}, "format"),
        ({**chat, "keep_alive": "soon"}, "keep_alive"),
        ({**chat, "think": "very"}, "think"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"messages": HELLO}, "model is required"),
    ]
    for body, words in cases:
        status, message = _error(server, "POST", "/api/chat", body)
        assert status == 400 and words in message, (body, message)
    for extra, words in (({"suffix": "x"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"),
                         ({"context": [1, 2]}, "context"), ({"images": ["aGk="]}, "images"),
                         ({"raw": True, "system": "s"}, "raw mode")):
        status, message = _error(server, "POST", "/api/generate", {"model": MODEL, "prompt": "hi", **extra})
        assert status == 400 and words in message, (extra, message)
    status, message = _error(server, "POST", "/api/chat", json.dumps(chat).encode(),
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and "Content-Type: application/json" in message
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=HELLO, options={"num_predict": 4, "stop": ["x"] * 17})
    assert e.value.status_code == 400 and e.value.error.startswith("options.stop")
    for method, path in (("POST", "/api/create"), ("DELETE", "/api/delete"),
                         ("POST", "/api/copy"), ("POST", "/api/push"), ("POST", "/api/blobs/sha256:00")):
        status, message = _error(server, method, path, {"model": MODEL})
        assert status == 501 and message.startswith(f"{path}: edge does not"), (path, message)
    assert client.pull(MODEL).status == "success"              # already pulled
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 501 and "edge pull" in e.value.error
