"""`edge serve` end to end (issue 5; BUGS.md S1-S7, T2, C1-C2, P1-P2).

A real `edge serve` process on the default model (qwen2.5-coder-0.5b-instruct, -np 4, -c 2048)
is driven with the official `openai` client and with raw HTTP (http.client) for the SSE framing
and malformed requests (the process: tests/server_process.py; the tiny model's C1, C2, API key
and Unix socket: tests/test_server_tiny.py). Short-lived ones check --max-queue 1 with -np 1 on
Qwen, where a third request gets 503, and that SIGINT lets the running stream and the waiting
request finish.

Expected values come from llama.cpp's goldens (../shared/golden) or from the same server on
another path (streamed vs not, concurrent vs alone); token counts are exact.
"""
from __future__ import annotations

import base64
import http.client
import json
import math
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from tests.conftest import golden
from tests.server_process import Server, assert_error, sse_events, start_post

openai = pytest.importorskip("openai", reason="the server tests talk through the official openai client "
                                               "(pip install -e .[test])")

QWEN = "qwen2.5-coder-0.5b"
N_CTX = 2048
N_PARALLEL = 4
FRANCE = "The capital of France is"
NO_EOG = {"151643": -100, "151645": -100}       # <|endoftext|>, <|im_end|> banned: generation runs on


@pytest.fixture(scope="session")
def server(qwen_path, tmp_path_factory):
    srv = Server(["-m", str(qwen_path), "-np", str(N_PARALLEL), "-c", str(N_CTX)],
                 tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(server):
    status, body = server.get("/v1/models")
    assert status == 200
    return body["data"][0]["id"]


def _chat(client, model_id, content: str, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": content}], **kw)


def _complete(client, model_id, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model_id, prompt=prompt, **kw)


def _streamed_chat(client, model_id, content: str, **kw) -> tuple[str, str]:
    """(text, finish_reason) of a streamed greedy chat."""
    text, finish = [], None
    for chunk in _chat(client, model_id, content, stream=True, **kw):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _golden_tokenize_cases() -> list[dict]:
    return golden(QWEN, "tokenize.json")["cases"]


# ---- health, models, metrics, tokenize ------------------------------------------------------

def test_health_and_models(server, client, model_id, qwen_path):
    assert server.get("/health") == (200, {"status": "ok"})
    gf = GGUFFile(qwen_path)
    try:
        name, n_vocab = gf.get_str("general.name"), len(gf.get("tokenizer.ggml.tokens"))
    finally:
        gf.close()
    models = client.models.list().data
    assert [m.id for m in models] == [qwen_path.stem] == [model_id]
    status, body = server.get("/v1/models")
    assert body["data"][0]["meta"] == {"n_ctx": N_CTX, "n_vocab": n_vocab, "architecture": "qwen2",
                                       "size": qwen_path.stat().st_size}
    assert (body["data"][0]["status"], body["data"][0]["context_length"]) == ("loaded", N_CTX)
    # the GGUF's general.name names the model too
    r = _complete(client, name, [9707], max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_metrics_names_and_counts(server, client, model_id):
    before = server.wait_idle()
    kinds = {"edge_prompt_tokens_total": "counter", "edge_generation_tokens_total": "counter",
             "edge_prefix_cache_hit_tokens_total": "counter", "edge_requests_finished_total": "counter",
             "edge_requests_running": "gauge", "edge_requests_waiting": "gauge", "edge_kv_blocks_used": "gauge",
             "edge_kv_blocks_free": "gauge", "edge_time_to_first_token_seconds": "histogram",
             "edge_time_per_output_token_seconds": "histogram"}
    for name, kind in kinds.items():
        assert before[f"TYPE {name}"] == kind, name
    assert before["edge_kv_blocks_free"] > 0
    prompt = golden(QWEN, "greedy.json")["cases"][1]["prompt"]    # no end-of-generation in 48 tokens
    r = _complete(client, model_id, prompt, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    after = server.wait_idle()

    def delta(name):
        return after[name] - before[name]

    assert delta("edge_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("edge_generation_tokens_total") == 4
    assert delta("edge_prefix_cache_hit_tokens_total") == r.usage.prompt_tokens_details.cached_tokens
    assert delta("edge_requests_finished_total") == 1
    assert delta("edge_time_to_first_token_seconds_count") == 1
    assert delta("edge_time_per_output_token_seconds_count") == 3
    ttft = "edge_time_to_first_token_seconds"
    assert after[ttft + '_bucket{le="+Inf"}'] == after[ttft + "_count"]
    assert after["edge_kv_blocks_free"] == before["edge_kv_blocks_free"]


def test_tokenize_matches_llama_cpp(server):
    """/tokenize gives llama.cpp's ids with parse_special on and off (T2); /detokenize turns
    either back into the text."""
    for case in _golden_tokenize_cases():
        for special in (1, 0):
            status, body = server.post("/tokenize", {"content": case["text"], "parse_special": bool(special)})
            assert status == 200
            assert body["tokens"] == case[f"ids_bos0_special{special}"], (case["text"], special)
            status, body = server.post("/detokenize", {"tokens": case[f"ids_bos0_special{special}"]})
            assert body["content"] == base64.b64decode(case["detok_bytes_b64"]).decode("utf-8", "replace")
    assert server.post("/tokenize", {"content": "Hello world"})[1] == {"tokens": [9707, 1879]}
    assert server.post("/detokenize", {"tokens": [9707, 1879]})[1] == {"content": "Hello world"}


# ---- generation: goldens, usage, logprobs -----------------------------------------------------

def test_chat_greedy_matches_llama_cpp(client, model_id):
    case = golden(QWEN, "chat.json")["cases"][1]           # "What is 2+2?" with a system message
    r = client.chat.completions.create(model=model_id, messages=case["messages"], temperature=0, max_tokens=32)
    assert r.object == "chat.completion" and r.model == model_id
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == case["greedy_reply_text"]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(case["prompt_ids"])
    assert r.usage.completion_tokens == len(case["greedy_reply_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_greedy_matches_llama_cpp(server, client, model_id):
    case = golden(QWEN, "greedy.json")["cases"][1]           # llama.cpp's top-2 gap >= 0.55 on these
    n = 12
    r = _complete(client, model_id, case["prompt"], max_tokens=n)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(case["prompt_ids"])
    want = server.post("/detokenize", {"tokens": case["greedy_ids"][:n]})[1]["content"]
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n


def test_logprobs_match_llama_cpp_logits(server, model_id):
    """Completions top-20 logprobs of the first generated token against the log-softmax of
    llama.cpp's last-position logits, for every golden prompt. Not bit-equal: the server gives
    every row one arithmetic whatever the batch (llama.cpp's one-row kernels for most types,
    the tiled / GEMV structure for Q6_K, Q5_0, Q8_0), llama.cpp the kernels of the prompt's
    batch size. Measured (2026-11-30) over the top-20 logits of all positions of these prompts:
    mean |difference| 0.058, 99th percentile 0.23, max 0.44 -- rounding moved through 24
    layers, as between llama.cpp's own batch sizes. Bars: mean < 0.1, max < 0.6."""
    z = np.load(golden(QWEN, "logits.npz"))
    diffs = []
    for p in range(4):
        ids, logits = z[f"p{p}_ids"].tolist(), z[f"p{p}_last_logits"].astype(np.float64)
        ref = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        status, body = server.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                       "logprobs": 20})
        assert status == 200
        top = body["choices"][0]["logprobs"]["top_logprobs"][0]
        order = np.argsort(-ref)
        for tok in order[:10]:          # (the server's top 20 may swap near-ties further down)
            piece = server.post("/detokenize", {"tokens": [int(tok)]})[1]["content"]
            diffs.append(abs(top[piece] - ref[tok]))
        if ref[order[0]] - ref[order[1]] > 0.6:       # a clear first choice is the same
            first = server.post("/detokenize", {"tokens": [int(order[0])]})[1]["content"]
            assert max(top, key=top.get) == first
    assert np.mean(diffs) < 0.1 and max(diffs) < 0.6, (np.mean(diffs), max(diffs))


def test_max_tokens_exact(client, model_id):
    """S2: max_tokens = k gives exactly k tokens and finish_reason "length" (chat,
    max_completion_tokens, completions; streamed too)."""
    for k in (1, 5):
        r = _chat(client, model_id, "Write a long poem about the sea.", max_tokens=k, logprobs=True)
        assert (r.usage.completion_tokens, r.choices[0].finish_reason, len(r.choices[0].logprobs.content)) == \
            (k, "length", k)
    r = _chat(client, model_id, "Write a long poem about the sea.", max_completion_tokens=3)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    r = _complete(client, model_id, FRANCE, max_tokens=7)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    chunks = list(_complete(client, model_id, FRANCE, max_tokens=7, stream=True,
                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-2].choices[0].finish_reason == "length"


def test_cached_tokens_on_repeated_prompt(server, client, model_id):
    prompt = "Prefix cache check 4f1c: " + "lorem ipsum dolor sit amet " * 6
    first = _complete(client, model_id, prompt, max_tokens=1)
    second = _complete(client, model_id, prompt, max_tokens=1)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert first.choices[0].text == second.choices[0].text


def test_chat_logprobs_shape(server, model_id):
    """S4: logprobs.content[i] = {token, logprob, bytes, top_logprobs}; greedy picks the top one."""
    req = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0, "max_tokens": 6,
           "logprobs": True, "top_logprobs": 3}
    status, body = server.post("/v1/chat/completions", req)
    assert status == 200
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 6
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 3
        for t in c["top_logprobs"]:
            assert set(t) == {"token", "logprob", "bytes"} and t["bytes"] == list(t["token"].encode())
        values = [t["logprob"] for t in c["top_logprobs"]]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-9
        assert (c["token"], c["logprob"]) == (c["top_logprobs"][0]["token"], values[0])
    # logprobs without top_logprobs: content entries with empty top_logprobs
    status, body = server.post("/v1/chat/completions", {**req, "top_logprobs": None})
    assert [c["top_logprobs"] for c in body["choices"][0]["logprobs"]["content"]] == [[]] * 6
    assert [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]] == [c["logprob"] for c in content]


def test_completion_logprobs_shape(client, model_id):
    r = _complete(client, model_id, FRANCE, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == value and top[tok] == value and value <= 0


def test_streamed_equals_not_streamed(client, model_id):
    """Greedy text, finish_reason and logprobs are the same streamed or not (chat, completions)."""
    kw = {"max_tokens": 12, "logprobs": True, "top_logprobs": 2}
    r = _chat(client, model_id, "Explain recursion in one sentence.", **kw)
    text, finish, lps = [], None, []
    for chunk in _chat(client, model_id, "Explain recursion in one sentence.", stream=True, **kw):
        c = chunk.choices[0]
        text.append(c.delta.content or "")
        finish = c.finish_reason or finish
        lps += c.logprobs.content if c.logprobs else []
    assert "".join(text) == r.choices[0].message.content and finish == r.choices[0].finish_reason
    assert [(x.token, x.logprob) for x in lps] == [(x.token, x.logprob) for x in r.choices[0].logprobs.content]

    r = _complete(client, model_id, "def quicksort(xs):", max_tokens=12)
    chunks = list(_complete(client, model_id, "def quicksort(xs):", max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason == "length"


# ---- stop strings (S1) ------------------------------------------------------------------------

def test_stop_string_across_tokens(client, model_id):
    n = 12
    full = _complete(client, model_id, FRANCE, max_tokens=n, logprobs=0)
    text, tokens = full.choices[0].text, full.choices[0].logprobs.tokens
    # a stop string made of the end of one token and the start of the next, found in no token
    k = next(k for k in range(1, len(tokens)) if len(tokens[k - 1].strip()) >= 2 and len(tokens[k].strip()) >= 2
             and text.find(tokens[k - 1][-2:] + tokens[k][:2]) == len("".join(tokens[:k])) - 2)
    stop = tokens[k - 1][-2:] + tokens[k][:2]
    assert not any(stop in t for t in tokens), (stop, tokens)
    want = text[: text.index(stop)]
    n_until_stop = k + 1

    r = _complete(client, model_id, FRANCE, max_tokens=n, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens == n_until_stop
    streamed = list(_complete(client, model_id, FRANCE, max_tokens=n, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want       # nothing of the stop string leaked
    assert streamed[-1].choices[0].finish_reason == "stop"

    # of several stop strings the earliest match cuts; one that never completes changes nothing,
    # also when the text ends with its start (held back, then released at the end)
    later, earlier = "".join(tokens[7:9]), "".join(tokens[3:5])
    cut = min(text.index(later), text.index(earlier))
    r = _complete(client, model_id, FRANCE, max_tokens=n, stop=[later, earlier])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:cut], "stop")
    r = _complete(client, model_id, FRANCE, max_tokens=n, stop=[text[-2:] + "@@never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, "length")


def test_chat_stop(client, model_id):
    case = golden(QWEN, "chat.json")["cases"][1]
    reply = case["greedy_reply_text"]                            # "2 + 2 equals 4."
    r = client.chat.completions.create(model=model_id, messages=case["messages"], temperature=0, stop=["equals"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (reply[: reply.index("equals")], "stop")
    text, finish = "", None
    for chunk in client.chat.completions.create(model=model_id, messages=case["messages"], temperature=0,
                                                stop="equals", stream=True):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (text, finish) == (reply[: reply.index("equals")], "stop")


# ---- sampling (P1, P2) ------------------------------------------------------------------------

def test_seed(client, model_id):
    """P2: same seed, same text; different seeds differ; a seed leaves the other samplers on.
    P1: top_p 0 and tiny temperatures are greedy."""
    prompt, kw = "Once upon a time", {"max_tokens": 8, "temperature": 1.0}
    texts = [_complete(client, model_id, prompt, seed=s, **kw).choices[0].text for s in (1, 2, 3, 4)]
    assert _complete(client, model_id, prompt, seed=3, **kw).choices[0].text == texts[2]
    assert len(set(texts)) >= 3, texts
    greedy = _complete(client, model_id, prompt, max_tokens=8).choices[0].text
    assert _complete(client, model_id, prompt, seed=5, extra_body={"top_k": 1}, **kw).choices[0].text == greedy
    assert _complete(client, model_id, prompt, seed=5, top_p=0.0, **kw).choices[0].text == greedy
    assert _complete(client, model_id, prompt, seed=5, max_tokens=8, temperature=1e-30).choices[0].text == greedy


def test_logit_bias(client, model_id):
    hello = _complete(client, model_id, FRANCE, max_tokens=3, logit_bias={"9707": 100})
    assert hello.choices[0].text == "HelloHelloHello"
    first = _complete(client, model_id, FRANCE, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]
    assert first == " Paris"
    banned = _complete(client, model_id, FRANCE, max_tokens=1, logit_bias={"12095": -100})   # 12095 = " Paris"
    assert banned.choices[0].text not in ("", " Paris")


# ---- SSE framing (S3) -------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_sse_framing(server, route):
    chat = route == "/v1/chat/completions"
    req = {"temperature": 0, "max_tokens": 6}
    req.update({"messages": [{"role": "user", "content": "Say hello."}]} if chat else {"prompt": FRANCE})
    server.post(route, req)                                  # warm the prefix cache, as the two below
    status, plain = server.post(route, req)
    assert status == 200
    streamed = {**req, "stream": True, "stream_options": {"include_usage": True}}
    status, ctype, raw = server.request("POST", route, streamed)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in deltas)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    if chat:
        assert deltas[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in deltas[1:])
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in deltas)
        assert text == plain["choices"][0]["message"]["content"]
    else:
        assert "".join(c["choices"][0]["text"] for c in deltas) == plain["choices"][0]["text"]
    # without include_usage: no usage anywhere, the finish chunk comes just before [DONE]
    status, _, raw = server.request("POST", route, {**req, "stream": True})
    events = sse_events(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- bad requests (S5, S2, S4, S7) --------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (route, body, param, code)
    ("/v1/chat/completions", b'{"messages": [', None, "invalid_json"),
    ("/v1/chat/completions", b"", None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", None, "invalid_json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None,
     "invalid_json"),
    ("/v1/chat/completions", b'\xff\xfe{"messages": []}', None, "invalid_json"),
    ("/v1/chat/completions", {}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "unsupported_content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]},
     "messages.1.content", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "5"}, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "0.5"}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "temperature": 2.5}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "temperature": -0.1}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 1.5}, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "top_p": -0.5}, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "seed": 1.5}, "seed", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "stop": 5}, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "n": 17}, "n", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "n": 0}, "n", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "stop": [str(i) for i in range(17)]}, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools.0.function.name", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}}, "response_format",
     "unsupported_value"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "intger"}}}}, "response_format", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "response_format": "json"}, "response_format", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"151936": 1}}, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"9707": 1e300}}, "logit_bias.9707", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage", "invalid_value"),
    ("/v1/completions", {"max_tokens": 1}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [-1]}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "unsupported_value"),
    ("/tokenize", {"content": 5}, "content", "invalid_value"),
    ("/detokenize", {"tokens": [-5]}, "tokens", "invalid_value"),
]


def _bad_request_id(i: int, route: str, param) -> str:
    return f"{i}-{route.removeprefix('/v1/').strip('/').split('/')[0]}-{param}"


@pytest.mark.parametrize("route,body,param,code", BAD_REQUESTS,
                         ids=[_bad_request_id(i, r, p) for i, (r, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_then_good_one(server, route, body, param, code):
    status, _, raw = server.request("POST", route, body)
    assert_error(status, json.loads(raw), 404 if code == "model_not_found" else 400, param=param, code=code)
    status, good = server.post("/v1/completions", {"prompt": [9707], "max_tokens": 1})
    assert status == 200 and good["usage"]["completion_tokens"] == 1


def test_model_names_a_request_may_use(server, qwen_path):
    """The model's id, its file name and the registry's alias all name it (as `-m` takes them)."""
    status, models = server.get("/v1/models")
    for name in (models["data"][0]["id"], qwen_path.name, "qwen2.5-coder-0.5b"):
        status, body = server.post("/v1/completions", {"model": name, "prompt": [9707], "max_tokens": 1})
        assert status == 200 and body["usage"]["completion_tokens"] == 1, (name, body)


def test_unknown_fields_ignored(server):
    status, body = server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "frequency": 3,
                                                        "response_format_x": {"a": [1]}, "user": "me",
                                                        "response_format": {"type": "text"}, "tools": []})
    assert status == 200 and body["usage"]["completion_tokens"] == 1


def test_404_and_405(server):
    status, _, raw = server.request("GET", "/v1/nothing")
    assert assert_error(status, json.loads(raw), 404, code="not_found")["message"] == "no route /v1/nothing"
    for method, path in (("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("DELETE", "/health")):
        status, _, raw = server.request(method, path)
        assert method in assert_error(status, json.loads(raw), 405, code="method_not_allowed")["message"]


def test_context_length_exceeded(server, client, model_id):
    """S7: 400 naming the prompt's token count and n_ctx; nothing is truncated or generated."""
    status, body = server.post("/v1/completions", {"prompt": [9707] * 2100, "max_tokens": 1})
    err = assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    assert "2100" in err["message"] and str(N_CTX) in err["message"]
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (2100, N_CTX)     # llama-server's figures
    status, body = server.post("/v1/completions", {"prompt": [9707] * (N_CTX + 1), "max_tokens": 1})
    assert f"{N_CTX + 1} tokens" in assert_error(status, body, 400, code="context_length_exceeded")["message"]

    content = "hello " * 2100
    n_content = len(server.post("/tokenize", {"content": content, "parse_special": False})[1]["tokens"])
    n_empty = _chat(client, model_id, "", max_tokens=1).usage.prompt_tokens
    before = server.wait_idle()
    status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    msg = assert_error(status, body, 400, param="messages", code="context_length_exceeded")["message"]
    assert str(n_empty + n_content) in msg and str(N_CTX) in msg
    after = server.wait_idle()
    assert after["edge_prompt_tokens_total"] == before["edge_prompt_tokens_total"]


def test_huge_prompt_refused_without_tokenizing(server):
    """A prompt that cannot fit n_ctx whatever its tokens (more bytes than n_ctx times the
    longest token) is refused at once, not after tokenizing megabytes; the message says so."""
    big = "x" * 5_000_000
    for route, body, param in (("/v1/completions", {"prompt": big}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages")):
        t0 = time.monotonic()
        status, out = server.post(route, body)
        msg = assert_error(status, out, 400, param=param, code="context_length_exceeded")["message"]
        assert time.monotonic() - t0 < 3 and "the prompt has at least" in msg and str(N_CTX) in msg


def test_user_text_cannot_forge_a_turn(server, client, model_id):
    """T2: "<|im_start|>" typed in a chat message is plain text (14 tokens, not 4)."""
    case = next(c for c in _golden_tokenize_cases() if c["text"] == "<|im_start|>Hello World<|im_end|>")
    plain, special = case["ids_bos0_special0"], case["ids_bos0_special1"]
    assert server.post("/tokenize", {"content": case["text"], "parse_special": False})[1]["tokens"] == plain
    n_empty = _chat(client, model_id, "", max_tokens=1).usage.prompt_tokens
    n_forged = _chat(client, model_id, case["text"], max_tokens=1).usage.prompt_tokens
    assert n_forged - n_empty == len(plain) != len(special)


# ---- concurrency and disconnects (S6) ---------------------------------------------------------

def test_concurrent_streams_equal_alone(server, client, model_id):
    """16 streamed greedy chats at once all complete, each with the text it gets served alone."""
    prompts = [f"Give one fact about the number {i}." for i in range(16)]
    kw = {"max_tokens": 10}
    max_running, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            max_running[0] = max(max_running[0], server.metrics()["edge_requests_running"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _streamed_chat(client, model_id, p, **kw), prompts))
    finally:
        done.set()
        watcher.join()
    assert max_running[0] == N_PARALLEL
    alone = [_streamed_chat(client, model_id, p, **kw) for p in prompts]
    assert together == alone
    assert all(finish in ("stop", "length") and text for text, finish in alone)
    assert len({text for text, _ in alone}) > 8              # the outputs are the prompts' own
    server.wait_idle()


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_frees_its_sequence(server, stream):
    """A client that closes its socket mid-generation leaves no running sequence or KV block."""
    _client_gone(server, stream)


def _client_gone(server: Server, stream: bool) -> None:
    before = server.wait_idle()
    conn = start_post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 400, "temperature": 0, "stream": stream,
                                              "logit_bias": NO_EOG})
    if stream:
        r = conn.getresponse()
        assert r.status == 200
        assert json.loads(sse_events(r.readline() + r.readline())[0])["choices"][0]["text"]
    deadline = time.monotonic() + 30
    while server.metrics()["edge_generation_tokens_total"] - before["edge_generation_tokens_total"] < 3:
        assert time.monotonic() < deadline, "no tokens generated"
        time.sleep(0.05)
    m = server.metrics()
    assert m["edge_requests_running"] == 1 and m["edge_kv_blocks_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = server.wait_idle(5)
    assert after["edge_generation_tokens_total"] - before["edge_generation_tokens_total"] < 200


# ---- a full queue, Ctrl+C ------------------------------------------------------------------------

def test_queue_full_then_sigint_drains(qwen_path, tmp_path):
    """-np 1 --max-queue 1: with one request running and one waiting, a third gets 503
    queue_full. SIGINT then lets the running stream finish (all tokens, [DONE]) and serves the
    waiting request; the process says so ("stopping after the 2 running request(s)") and exits
    with status 130 and "interrupted", as every edge command does on Ctrl+C. Before that, a non-streamed request whose
    client went away must not leave its handler waiting for events forever (that hung exit)."""
    srv = Server(["-m", str(qwen_path), "-np", "1", "-c", "256", "--max-queue", "1"], tmp_path / "serve.log")
    try:
        srv.wait_ready(120)
        _client_gone(srv, stream=False)
        prompt = golden(QWEN, "greedy.json")["cases"][1]["prompt"]       # 48 tokens without end-of-generation
        n = 30
        running = start_post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  "stream": True, "stream_options": {"include_usage": True}})
        r = running.getresponse()
        first = r.readline() + r.readline()
        waiting = start_post(srv, "/v1/completions", {"prompt": FRANCE, "max_tokens": 3, "temperature": 0})
        deadline = time.monotonic() + 10
        while srv.metrics()["edge_requests_waiting"] != 1:
            assert time.monotonic() < deadline, "the second request is not waiting"
            time.sleep(0.02)
        status, body = srv.post("/v1/completions", {"prompt": FRANCE, "max_tokens": 3})
        assert "--max-queue 1" in assert_error(status, body, 503, param=None, code="queue_full")["message"]

        srv.proc.send_signal(signal.SIGINT)
        rest = r.read()
        events = sse_events(first + rest)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == n
        assert len(sse_events(rest)) >= n // 2                  # most of the stream came after SIGINT
        w = waiting.getresponse()
        assert w.status == 200 and json.loads(w.read())["usage"]["completion_tokens"] == 3
        assert srv.proc.wait(15) == 128 + signal.SIGINT, srv.log_text()
        lines = srv.log_text().splitlines()
        assert "edge serve: stopping after the 2 running request(s) (Ctrl+C again: at once)" in lines, lines
        assert lines[-1] == "interrupted" and "Traceback" not in srv.log_text(), lines
    finally:
        srv.stop()


def test_second_sigint_exits_at_once_without_traceback(gemma_path, tmp_path):
    """Ctrl+C twice during a long stream: the server exits at once with status 130 and one line,
    not uvicorn's tracebacks of the cancelled requests; the client sees the stream end early."""
    srv = Server(["-m", str(gemma_path), "-np", "1", "-c", "512"], tmp_path / "serve.log")
    try:
        srv.wait_ready(120)
        running = start_post(srv, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400,
                                                  "temperature": 0, "stream": True})
        r = running.getresponse()
        r.readline()
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(10) == 128 + signal.SIGINT
        try:
            rest = r.read()
        except http.client.IncompleteRead as e:              # the chunked stream was cut
            rest = e.partial
        assert b"[DONE]" not in rest
        log = srv.log_text()
        assert "Traceback" not in log and "interrupted: running requests dropped" in log, log
    finally:
        srv.stop()


def test_llama_server_habits(server, client, model_id):
    """llama-server's ways: the OpenAI routes without /v1, any model name served by the one -m
    model, n choices, system_fingerprint."""
    import openai as _openai

    bare = _openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0)
    assert [m.id for m in bare.models.list().data] == [model_id]
    r = bare.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=3, temperature=0)
    assert r.model == model_id and r.system_fingerprint.startswith("edge-") and r.usage.completion_tokens == 3
    c = bare.completions.create(model="local-model", prompt="def add(a, b):", max_tokens=3, temperature=0)
    assert c.model == model_id and c.usage.completion_tokens == 3
    assert server.get("/v1/health") == (200, {"status": "ok"})
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=4, temperature=0, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) == 1             # greedy: the same choice thrice
    assert r.usage.completion_tokens == sum(4 for _ in r.choices) and r.usage.prompt_tokens < 40
    chunks = list(client.chat.completions.create(model=model_id, messages=HI, max_tokens=4, temperature=0, n=2,
                                                 stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == r.choices[0].message.content
    assert len({ch.id for ch in chunks}) == 1
