"""`edge serve` on a tiny random qwen2 model (BUGS.md C1, C2): a chat template that raises or
reaches for a sandbox escape, on a Unix socket behind --api-key, with a small -b and -c so a
prompt longer than n_batch and one that fills the context are cheap; --max-queue 0.

Expected values are exact token counts, error shapes and HTTP codes; the generated text is
compared with the same server's answer for the same request."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from tests import tiny_models
from tests.server_process import Server, assert_error

openai = pytest.importorskip("openai", reason="the server tests talk through the official openai client "
                                               "(pip install -e .[test])")
try:                                   # the openai client's HTTP library (httpx2 in newer releases)
    import httpx2 as httpx
except ImportError:
    import httpx

HI = [{"role": "user", "content": "hi"}]
API_KEY = "sk-test-7d1e"
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
TINY_TEMPLATE = ("{% if messages[0].content == 'escape' %}{{ ''.__class__.__mro__[1].__subclasses__() }}{% endif %}"
                 "{% if messages[0].content == 'spin' %}{% for a in range(100000) %}{% for b in range(100000) %}"
                 "{% endfor %}{% endfor %}{% endif %}"
                 "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}<t1>{{ m.content }}{% endfor %}")
TINY_N_CTX, TINY_N_BATCH = 64, 16


class _WithTemplate(GGUFWriter):
    def write_header_to_file(self, *args, **kw):
        self.add_chat_template(TINY_TEMPLATE)
        return super().write_header_to_file(*args, **kw)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random qwen2 model whose chat template is TINY_TEMPLATE."""
    path = tmp_path_factory.mktemp("tiny_model") / "tiny.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "GGUFWriter", _WithTemplate)
        tiny_models.write_tiny_model(path, arch="qwen2")
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    srv = Server(["-m", str(tiny_model), "-np", "2", "-c", str(TINY_N_CTX), "-b", str(TINY_N_BATCH)],
                 folder / "serve.log", uds=str(folder / "edge.sock"), api_key=API_KEY)
    try:
        srv.wait_ready(60)
        yield srv
    finally:
        srv.stop()


def test_api_key(tiny_server):
    for path in ("/health", "/v1/health"):       # public, as llama-server's (health probes carry no key)
        assert tiny_server.get(path, headers={"Authorization": ""}) == (200, {"status": "ok"})
    for auth in ("", "Bearer wrong", f"Basic {API_KEY}", f"Bearer {API_KEY}x", API_KEY):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/tokenize")):
            status, _, raw = tiny_server.request(method, path, {"prompt": [1], "content": "x"},
                                                 headers={"Authorization": auth})
            assert_error(status, json.loads(raw), 401, param=None, code="invalid_api_key")
    assert tiny_server.get("/v1/models")[0] == 200
    for auth in (f"bearer {API_KEY}", f"BEARER  {API_KEY}"):      # the scheme is case-insensitive
        assert tiny_server.get("/v1/models", headers={"Authorization": auth})[0] == 200


def test_unix_socket_is_private_and_not_taken_over(tiny_server, tiny_model, tmp_path):
    """The socket is the user's alone (0600); a second server on the same path is refused
    with a clear error and the first keeps serving."""
    assert stat.S_IMODE(os.stat(tiny_server.uds).st_mode) == 0o600
    second = subprocess.run([sys.executable, "-m", "edge.cli", "serve", "-m", str(tiny_model), "--unix-socket",
                             tiny_server.uds], capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert second.stderr.strip() == f"edge serve: error: --unix-socket {tiny_server.uds}: another server is listening there"
    assert tiny_server.get("/v1/models")[0] == 200


def _tiny_client(tiny_server, key: str):
    http_client = openai.DefaultHttpxClient(transport=httpx.HTTPTransport(uds=tiny_server.uds))
    return openai.OpenAI(base_url="http://localhost/v1", api_key=key, http_client=http_client, max_retries=0)


def test_openai_client_over_unix_socket(tiny_server):
    client = _tiny_client(tiny_server, API_KEY)
    (model,) = client.models.list().data
    r = client.completions.create(model=model.id, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError) as exc:
        _tiny_client(tiny_server, "wrong").models.list()
    assert exc.value.status_code == 401


@pytest.mark.parametrize("messages,message", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], ALTERNATE),
    ([{"role": "assistant", "content": "a"}], ALTERNATE),
    ([{"role": "user", "content": "escape"}], "unsafe"),
    ([{"role": "user", "content": "spin"}], "chat template exceeded its step budget: more than 1,"),
], ids=["raise_exception-user-user", "raise_exception-assistant-first", "sandbox-escape", "render-budget"])
def test_template_errors_are_400(tiny_server, messages, message):
    """C2: raise_exception in the template is the client's 400 with its message; C1: a template
    reaching for __class__ fails to render; a template looping 10^10 times stops at its step
    budget. Nothing is generated; the server goes on."""
    before = tiny_server.wait_idle()
    status, body = tiny_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    err = assert_error(status, body, 400, param="messages", code="chat_template_error")
    assert message == err["message"] if message == ALTERNATE else message in err["message"]
    after = tiny_server.wait_idle()
    assert after["edge_prompt_tokens_total"] == before["edge_prompt_tokens_total"]
    assert after["edge_requests_finished_total"] == before["edge_requests_finished_total"]
    status, body = tiny_server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_prompt_longer_than_n_batch(tiny_server):
    """A prompt of several n_batch chunks is prefilled over several steps (the steps before its
    last chunk produce no logits), with the same text as when its prefix is cached."""
    prompt = list(range(3, 3 + 3 * TINY_N_BATCH + 1))
    req = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, body = tiny_server.post("/v1/completions", req)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 4
    status, again = tiny_server.post("/v1/completions", req)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == body["choices"][0]["text"]


def test_prompt_fills_the_context(tiny_server):
    """A prompt of n_ctx - k tokens gets k + 1 tokens (the last one needs no KV cell), then
    finish_reason "length"; n_ctx + 1 tokens are a 400."""
    prompt = [5 + i % 50 for i in range(TINY_N_CTX + 1)]
    for k in (1, 0):
        status, body = tiny_server.post("/v1/completions", {"prompt": prompt[: TINY_N_CTX - k], "max_tokens": 5,
                                                            "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == k + 1 and body["choices"][0]["finish_reason"] == "length"
    status, body = tiny_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 5})
    msg = assert_error(status, body, 400, param="prompt", code="context_length_exceeded")["message"]
    assert f"{TINY_N_CTX + 1} tokens" in msg and str(TINY_N_CTX) in msg


def test_max_queue_zero_serves_an_idle_server(tiny_model, tmp_path):
    """--max-queue 0: no request may wait, but one that finds a free sequence runs."""
    srv = Server(["-m", str(tiny_model), "-np", "1", "-c", str(TINY_N_CTX), "--max-queue", "0"],
                 tmp_path / "serve.log")
    try:
        srv.wait_ready(60)
        status, body = srv.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
        assert status == 200, body
    finally:
        srv.stop()
