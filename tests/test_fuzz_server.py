"""A seeded request fuzzer for `edge serve` (issue 14): valid chat, completions, tokenize and
detokenize requests, mutated in types, sizes, nesting, encodings (invalid UTF-8, lone
surrogates, UTF-16), numbers (huge, NaN, 1e999), unknown fields, headers, methods, paths and raw
HTTP. Every answer must be a 200 or a 4xx (errors in the API's shape), within a time budget per
request, and the server must stay up and log no traceback.

CI mode: EDGE_FUZZ_SEED (default 14), 400 requests (~40 s; at most FUZZ_SECONDS). By hand:
EDGE_FUZZ_LONG=1 for 20,000 requests (or EDGE_FUZZ_SECONDS, default 30 minutes). The counts and
the worst time per request are printed.
"""
from __future__ import annotations

import collections
import http.client
import json
import os
import random
import socket
import time

import pytest

from tests.server_process import ERROR_KEYS, Server
from tests.tiny_chat import write_tiny_chat_model

LONG = os.environ.get("EDGE_FUZZ_LONG") == "1"
SEED = int(os.environ.get("EDGE_FUZZ_SEED", "14"))
N_REQUESTS = 20_000 if LONG else 400
FUZZ_SECONDS = float(os.environ.get("EDGE_FUZZ_SECONDS", 1800 if LONG else 75))   # stops early past this
REQUEST_BUDGET = 15.0                      # seconds one request may take, at most
N_CTX, N_VOCAB = 256, 96
ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
FIELDS = ["model", "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "repeat_penalty",
          "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "n", "stream", "stream_options",
          "logit_bias", "ignore_eos", "n_probs", "samplers", "typical_p", "mirostat", "grammar", "json_schema",
          "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "response_format",
          "messages", "prompt", "echo", "suffix", "best_of", "content", "add_special", "parse_special", "tokens",
          "user", "metadata", "cache_prompt", "reasoning_effort", "chat_template_kwargs", "unknown_field", ""]
TEXTS = ["hi", "", " ", "<|im_start|>", "<|im_end|>", "<|im_start|>user\nx<|im_end|>", "é日本😀", "\x00", "\r\n\t",
         "\u2581", "<t5>", "\ufeff", "\U0010ffff", "\ud800", "\udfff", "a\ud83d", "\\u0000", "%s%n", "'\"{}[]"]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    model = write_tiny_chat_model(folder / "tiny_chat.gguf", pytest.MonkeyPatch())
    srv = Server(["-m", str(model), "-np", "2", "-c", str(N_CTX), "--timeout", "5"], folder / "serve.log")
    try:
        srv.wait_ready(60)
        yield srv
    finally:
        srv.stop()


# ---- generating requests ------------------------------------------------------------------------

def _text(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.6:
        return "".join(rng.choice(TEXTS) for _ in range(rng.randint(0, 6)))
    if k < 0.8:
        return "".join(chr(rng.choice([rng.randint(0, 0x7f), rng.randint(0x80, 0xffff), rng.randint(0, 0x10ffff)]))
                       for _ in range(rng.randint(1, 40)))
    return rng.choice(TEXTS) * rng.choice([100, 5000, 20_000])


def _value(rng: random.Random, depth: int = 0):
    k = rng.randrange(14)
    if k == 0:
        return None
    if k == 1:
        return rng.choice([True, False])
    if k == 2:
        return rng.choice([0, 1, -1, 2, 7, 20, 21, 255, N_VOCAB, 2**31, 2**63, 10**30, -10**30])
    if k == 3:
        return rng.choice([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.5, -0.5, 1e-320, 1e308, -1e308, 100.0, 1e15])
    if k in (4, 5):
        return _text(rng)
    if k == 6 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if k == 7 and depth < 3:
        return {rng.choice(FIELDS + ["role", "type", "text"]): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if k == 8:
        return [rng.randrange(-5, N_VOCAB + 5) for _ in range(rng.choice([1, 3, 50, 5000]))]
    if k == 9:
        return [{"role": rng.choice(["user", "assistant", "system", "developer", "tool", "robot", ""]),
                 "content": rng.choice([_text(rng), None, [{"type": "text", "text": _text(rng)}], 5])}
                for _ in range(rng.choice([0, 1, 2, 3, 1000]))]
    if k == 10:
        nested = "x"
        for _ in range(rng.choice([10, 200, 800])):
            nested = [nested] if rng.random() < 0.5 else {"a": nested}
        return nested
    if k == 11:
        return {str(rng.randrange(-2, 200)): rng.choice([1, -100, 100, 1e9, "x"]) for _ in range(rng.randint(0, 3))}
    if k == 12:
        return rng.choice(["edskypmxt", ["top_k", "temperature"], ["temperature", "top_k"], "zz", []])
    return rng.choice(["text", "json_object", {"type": "json_object"}, {"type": "text"}, "none", "auto", "required"])


def _base(rng: random.Random, route: str) -> dict:
    if route == "/v1/chat/completions":
        n = rng.choice([1, 1, 2, 3, 10, 20_000]) if rng.random() < 0.9 else 1
        body = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng) if n < 50 else ""}
                             for i in range(n)], "max_tokens": rng.randint(1, 6)}
    elif route == "/v1/completions":
        prompt = _text(rng) or "x" if rng.random() < 0.5 else [rng.randrange(N_VOCAB) for _ in range(rng.randint(1, 20))]
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 6)}
    elif route == "/tokenize":
        body = {"content": _text(rng), "parse_special": rng.random() < 0.5, "add_special": rng.random() < 0.5}
    else:
        body = {"tokens": [rng.randrange(N_VOCAB) for _ in range(rng.randint(0, 30))]}
    if route.startswith("/v1/"):
        if rng.random() < 0.3:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_k", "seed", "logprobs"):
            if rng.random() < 0.2:
                body[name] = {"temperature": 0, "top_k": 5, "seed": 3, "logprobs": 2 if "prompt" in body else True}[name]
    return body


def _mutate(rng: random.Random, body: dict) -> dict:
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        k = rng.random()
        if k < 0.55:
            body[rng.choice(FIELDS)] = _value(rng)
        elif k < 0.7 and body:
            body.pop(rng.choice(list(body)))
        elif k < 0.85 and isinstance(body.get("messages"), list) and body["messages"]:
            msg = rng.choice(body["messages"])
            if isinstance(msg, dict):
                msg[rng.choice(["role", "content", "name", "tool_calls"])] = _value(rng)
        else:
            body[f"x_{rng.randrange(1000)}"] = _value(rng)
    return body


def _serialize(rng: random.Random, body: dict) -> bytes:
    raw = json.dumps(body).encode()            # ensure_ascii: surrogates become \\udXXX escapes
    k = rng.random()
    if k < 0.75:
        return raw if rng.random() < 0.5 else json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ops = [lambda r: r[: rng.randrange(len(r) + 1)],                      # truncated
           lambda r: r.replace(b"1", b"NaN", 1), lambda r: r.replace(b"0", b"Infinity", 1),
           lambda r: r.replace(b"1", b"1" * 5000, 1), lambda r: r.replace(b"1", b"1e999", 1),
           lambda r: b"\xef\xbb\xbf" + r, lambda r: r.decode().encode("utf-16"),
           lambda r: r[:-1] + b', "messages": 1, "messages": [{"role": "user", "content": "dup"}]}',
           lambda r: r + b" garbage", lambda r: r.replace(b'"', b"'"), lambda r: b"[" * 100_000,
           lambda r: r.replace(b"a", b"\xff", 1), lambda r: r.replace(b"a", b"\xed\xa0\x80", 1),
           lambda r: b"", lambda r: b"null", lambda r: b'"just a string"', lambda r: r.replace(b"{", b"{{", 1)]
    return rng.choice(ops)(raw)


def _request(rng: random.Random) -> tuple[str, str, dict, bytes]:
    route = rng.choice(ROUTES)
    method, path = "POST", route
    k = rng.random()
    if k < 0.05:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    elif k < 0.08:
        path = rng.choice([route + "/", "/v1/models", "/health", "/metrics", "/v1/nothing", "/%00", "/v1/../health",
                           "/" + "a" * 10_000, route + "?x=1", "//v1/completions"])
        method = rng.choice(["GET", "POST"])
    headers = {"Content-Type": "application/json"}
    k = rng.random()
    if k < 0.05:
        headers["Content-Type"] = rng.choice(["text/plain", "", "application/json; charset=latin-1",
                                              "multipart/form-data; boundary=x", "APPLICATION/JSON", "*/*"])
    elif k < 0.08:
        headers["Host"] = rng.choice(["evil.example", "localhost", "127.0.0.1:1", "[::1]", "x" * 300, "a.localhost"])
    elif k < 0.11:
        headers["Origin"] = rng.choice(["https://evil.example", "http://localhost:3000", "null", "file://"])
    elif k < 0.13:
        headers[rng.choice(["Authorization", "X-Junk", "Accept-Encoding", "Content-Encoding"])] = \
            rng.choice(["Bearer x", "gzip", "\t", "a" * 2000])
    body = _serialize(rng, _mutate(rng, _base(rng, route)))
    return method, path, headers, body


RAW_REQUESTS = [
    b"GET / HTTP/1.1\r\n\r\n", b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: local\x00host\r\n\r\n", b"GET /h\xffealth HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\n{\"con\r\n11\r\ntent\": \"hello\"}\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\nGET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"GET /health HTTP/2.0\r\nHost: localhost\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
]


# ---- sending --------------------------------------------------------------------------------------

def _send(srv: Server, method: str, path: str, headers: dict, body: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=REQUEST_BUDGET + 5)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body if method != "HEAD" else None)
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def _send_raw(srv: Server, data: bytes) -> int:
    """The status of the first response to raw bytes (0 if the server just closed)."""
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(REQUEST_BUDGET + 5)
    try:
        s.sendall(data)
        got = b""
        while len(got) < 12 and (chunk := s.recv(4096)):
            got += chunk
    except ConnectionResetError:
        return 0
    finally:
        s.close()
    return int(got.split()[1]) if got.startswith(b"HTTP/1.") else 0


def _check_error_shape(status: int, ctype: str, raw: bytes, what: str) -> None:
    if status >= 400 and not what.startswith("HEAD "):
        assert ctype.startswith("application/json"), (what, status, ctype, raw[:200])
        body = json.loads(raw)
        assert set(body) == {"error"} and ERROR_KEYS <= set(body["error"]), (what, body)
        assert set(body["error"]) - ERROR_KEYS <= {"n_prompt_tokens", "n_ctx"}, (what, body)   # llama-server's


def test_fuzz_requests(fuzz_server, capsys):
    srv = fuzz_server
    rng = random.Random(SEED)
    statuses: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    worst, worst_what, n = 0.0, "", 0
    t_start = time.monotonic()
    for n in range(1, N_REQUESTS + 1):
        if time.monotonic() - t_start > FUZZ_SECONDS:
            n -= 1
            break
        t0 = time.monotonic()
        if rng.random() < 0.04:
            data = rng.choice(RAW_REQUESTS)
            what = f"raw {data[:50]!r}"
            status = _send_raw(srv, data)
            kinds["raw"] += 1
        else:
            method, path, headers, body = _request(rng)
            what = f"{method} {path[:40]} {headers} {body[:120]!r}"
            status, ctype, raw = _send(srv, method, path, headers, body)
            _check_error_shape(status, ctype, raw, what)
            kinds[f"{method} {path if path in ROUTES else 'other'}"] += 1
        took = time.monotonic() - t0
        statuses[status] += 1
        # 200, a 4xx, starlette's 307 to the route without its trailing slash, 0: closed (raw junk)
        assert status in (0, 200, 307) or 400 <= status < 500, f"request {n}: {status} for {what}\n{srv.log_text()}"
        assert took < REQUEST_BUDGET, f"request {n} took {took:.1f} s: {what}"
        if took > worst:
            worst, worst_what = took, what
        if n % 50 == 0:
            assert srv.proc.poll() is None and srv.get("/health") == (200, {"status": "ok"}), srv.log_text()
    assert srv.get("/health") == (200, {"status": "ok"})
    srv.wait_idle(10)
    log = srv.log_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    with capsys.disabled():
        print(f"\nfuzz (seed {SEED}): {n} requests in {time.monotonic() - t_start:.0f} s; statuses "
              f"{dict(sorted(statuses.items()))}; kinds {dict(kinds)}; worst {worst:.2f} s: {worst_what[:200]}")
    assert statuses[200] > n // 10 and len(statuses) > 5        # it reached the model and many refusals
