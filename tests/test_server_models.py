"""`edge serve` without -m: every pulled model by name, loaded on demand, unloaded when idle or
for room (edge.server.pool); /v1/models with statuses, /models/load and /models/unload, the
request log line and the per-model metrics. The store is a temporary EDGE_HOME holding links
to the real qwen2.5-coder-0.5b-instruct (the default) and smollm2-135m-instruct files."""
from __future__ import annotations

import json
import threading
import time

import pytest

from edge.server.app import ROOT_TEXT

from edge.server.protocol import parse_keep_alive
from edge.server.protocol import APIError
from tests.server_process import assert_error, running

QWEN, SMOL, GEMMA = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"


@pytest.mark.parametrize("value, seconds", [(0, 0.0), (30, 30.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0),
                                            ("45s", 45.0), ("300ms", 0.3), ("-1", None), (-1, None), ("-5m", None),
                                            ("10", 10.0)])
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, "1d", None])
def test_parse_keep_alive_refuses(value):
    with pytest.raises(APIError) as e:
        parse_keep_alive(value)
    assert e.value.status == 400 and e.value.param == "keep_alive"


@pytest.fixture(scope="module")
def home(tmp_path_factory, qwen_path, smollm2_path, gemma_path):
    home = tmp_path_factory.mktemp("edgehome")
    (home / "models").mkdir()
    for path in (qwen_path, smollm2_path, gemma_path):
        (home / "models" / path.name).symlink_to(path)
    return home


def _serve(home, tmp_path_factory, *extra):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    return running(["-np", "1", "-c", "512", *extra], log, timeout=240, env={"EDGE_HOME": str(home)})


def _chat(srv, model, content="Say hi.", **kw):
    return srv.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": content}],
                                             "max_tokens": 4, "temperature": 0, **kw})


def _statuses(srv) -> dict[str, str]:
    status, body = srv.get("/v1/models")
    assert status == 200
    return {m["id"]: m["status"] for m in body["data"]}


def _wait_status(srv, model, want, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _statuses(srv).get(model) == want:
            return
        time.sleep(0.25)
    pytest.fail(f"{model} did not become {want}: {_statuses(srv)}")


def _wait_log(srv, text, timeout=10):
    deadline = time.monotonic() + timeout            # a line is written once its response has ended
    while text not in srv.log_text():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in the log:\n{srv.log_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def router(home, tmp_path_factory):
    with _serve(home, tmp_path_factory, "--keep-alive", "-1") as srv:
        yield srv


def test_models_lists_every_pulled_model(router):
    status, body = router.get("/v1/models")
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {QWEN, SMOL, GEMMA}
    assert by_id[QWEN]["status"] == "loaded"              # the default loads at start
    assert by_id[SMOL]["status"] in ("unloaded", "loaded")
    assert by_id[SMOL]["context_length"] == 512 and by_id[SMOL]["meta"]["n_ctx"] == 512
    assert by_id[SMOL]["meta"]["architecture"] == "llama"


def test_a_request_loads_its_model_and_is_served_by_it(router):
    status, body = _chat(router, SMOL)
    assert status == 200, body
    assert body["model"] == SMOL and body["usage"]["completion_tokens"] >= 1
    assert _statuses(router) == {QWEN: "loaded", SMOL: "loaded", GEMMA: "unloaded"}
    status, other = _chat(router, QWEN)                  # both stay held (--models-max 3)
    assert status == 200 and other["model"] == QWEN
    status, tagged = _chat(router, f"{SMOL}:latest")     # Ollama's tag names the same model
    assert status == 200 and tagged["model"] == SMOL
    metrics = router.metrics()
    assert metrics[f'edge_model_loaded{{model="{SMOL}"}}'] == 1
    assert metrics[f'edge_requests_total{{model="{SMOL}",outcome="finished"}}'] >= 2
    assert metrics[f'edge_time_to_first_token_seconds_count{{model="{SMOL}"}}'] >= 2


def test_unknown_model_is_404(router):
    for name in ("gpt-4o", "../etc/passwd", "/etc/hostname", "qwen2.5-coder-7b-instruct"):
        status, body = _chat(router, name)
        assert_error(status, body, 404, code="model_not_found", param="model")


def test_chat_to_a_model_without_template_is_refused_before_its_load(router):
    """gemma-3-270m has no tokenizer.chat_template: its header says so, no load needed (the
    new-user pass waited 43 s for a load that ended in this 400)."""
    t0 = time.monotonic()
    assert_error(*_chat(router, GEMMA), 400, code="no_chat_template", param="messages")
    status, body = router.post("/v1/messages", {"model": GEMMA, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["type"] == "error", body
    status, body = router.post("/api/chat", {"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "/api/generate with raw: true" in body["error"], body
    assert time.monotonic() - t0 < 5
    assert _statuses(router)[GEMMA] == "unloaded"
    _wait_log(router, "edge serve: POST /v1/chat/completions 'gemma-3-270m' 400")
    _chat(router, "gpt-4o-mini")                         # a refused name is in the log line, no metrics label
    _wait_log(router, "edge serve: POST /v1/chat/completions 'gpt-4o-mini' 404")
    assert not any("gpt-4o-mini" in key for key in router.metrics())


def test_keep_alive_zero_unloads_after_the_request(router):
    status, body = _chat(router, SMOL, keep_alive=0)
    assert status == 200 and body["model"] == SMOL
    _wait_status(router, SMOL, "unloaded")
    assert router.metrics()["edge_models_unloaded_total"] >= 1
    status, body = _chat(router, SMOL)                   # loads again on the next request
    assert status == 200 and body["model"] == SMOL


def test_load_and_unload_routes(router):
    assert router.post("/models/load", {"model": SMOL})[0] == 200
    status, body = router.post("/models/unload", {"model": SMOL})
    assert status == 200 and body["success"] is True
    _wait_status(router, SMOL, "unloaded")
    status, body = router.post("/models/load", {"model": SMOL})
    assert status == 200 and body == {"success": True, "model": SMOL, "status": "loaded"}
    assert _statuses(router)[SMOL] == "loaded"
    assert_error(*router.post("/models/load", {"model": "nope"}), 404, code="model_not_found", param="model")
    assert_error(*router.post("/models/load", {"model": SMOL, "keep_alive": "soon"}), 400, param="keep_alive")


def test_root_and_request_log(router):
    status, _, raw = router.request("GET", "/")
    assert status == 200 and raw == ROOT_TEXT.encode()
    _chat(router, QWEN, content="Log me.")
    deadline, words = time.monotonic() + 10, None
    while words is None and time.monotonic() < deadline:   # written once the response has ended
        lines = [ln for ln in router.log_text().splitlines()
                 if ln.startswith(f"edge serve: POST /v1/chat/completions {QWEN} ")]
        words = lines[-1].split() if lines else time.sleep(0.1)
    assert words, router.log_text()
    assert words[4:6] == [QWEN, "200"] and words[6].startswith("prompt=") and words[8] == "gen=4"
    assert words[9].startswith("ttft=") and words[-1].endswith("s")


def test_models_max_unloads_the_least_recently_used(home, tmp_path_factory):
    with _serve(home, tmp_path_factory, "--models-max", "1") as srv:
        assert _statuses(srv) == {QWEN: "loaded", SMOL: "unloaded", GEMMA: "unloaded"}
        status, body = _chat(srv, SMOL)
        assert status == 200 and body["model"] == SMOL
        assert _statuses(srv) == {QWEN: "unloaded", SMOL: "loaded", GEMMA: "unloaded"}
        # while SMOL generates, a request for QWEN finds no room: 503 with Retry-After
        done = {}

        def long_request():
            done["reply"] = _chat(srv, SMOL, content="Count from 1 to 200.", max_tokens=300, ignore_eos=True)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 30
        while srv.metrics().get("edge_requests_running", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        conn = srv.connection()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, retry, body = resp.status, resp.getheader("Retry-After"), json.loads(resp.read())
        conn.close()
        assert_error(status, body, 503, code="models_busy")
        assert retry == "5"
        t.join(120)
        assert done["reply"][0] == 200
        status, body = _chat(srv, QWEN)                  # idle again: room is made
        assert status == 200 and body["model"] == QWEN
        # a request that names no model gets the default, loaded again after it was unloaded
        assert _chat(srv, SMOL)[0] == 200 and _statuses(srv) == {QWEN: "unloaded", SMOL: "loaded", GEMMA: "unloaded"}
        status, body = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2})
        assert status == 200 and body["model"] == QWEN
        assert _chat(srv, SMOL)[0] == 200
        status, body = srv.post("/tokenize", {"content": "hi"})     # not loaded: 503 while it loads again
        assert status == 503 and body["error"]["code"] == "loading", (status, body, _statuses(srv))
        _wait_status(srv, QWEN, "loaded", timeout=60)
        assert srv.post("/tokenize", {"content": "hi"}) == (200, {"tokens": [6023]})


def test_ctrl_c_while_the_model_loads(tmp_path, qwen_path):
    """Ctrl+C while the model loads (its kernels may be compiling): status 130 and one line."""
    import os
    import signal
    import subprocess
    import sys

    from tests.server_process import _free_port

    port = str(_free_port())
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", "-m", str(qwen_path), "--port", port],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "NUMBA_NUM_THREADS": "2"})
    try:
        banner = proc.stderr.readline()
        assert banner.startswith("edge serve: "), banner
        import http.client
        deadline, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < deadline:   # until /health answers: 503 while loading
            try:
                conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=5)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
            except OSError:
                time.sleep(0.02)
        assert status == 503
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        rest = proc.stderr.read()
    finally:
        proc.kill()
    assert rc == 130, rest
    lines = [ln for ln in rest.splitlines() if ln.strip()]
    assert lines[-1] == "interrupted while the model loaded", rest
    assert all(ln.startswith("edge serve: loading ") for ln in lines[:-1]), rest    # the load's own line


def test_clients_switch_models_and_unload(router):
    """The ollama, anthropic and openai (Responses) clients name either model; Ollama's
    keep_alive 0 unloads it after the answer; /api/ps lists what is loaded."""
    import anthropic
    import ollama
    import openai

    base = f"http://127.0.0.1:{router.port}"
    oc = ollama.Client(host=base)
    for model in (SMOL, f"{QWEN}:latest", SMOL):
        r = oc.chat(model=model, messages=[{"role": "user", "content": "Say hi."}], options={"num_predict": 3,
                                                                                             "temperature": 0})
        assert r.model == model and r.eval_count == 3 and r.done_reason == "length"
    assert {m.model for m in oc.ps().models} == {f"{QWEN}:latest", f"{SMOL}:latest"}
    assert {m.model for m in oc.list().models} == {f"{QWEN}:latest", f"{SMOL}:latest", f"{GEMMA}:latest"}  # all pulled
    parts = list(oc.generate(model=SMOL, prompt="Say hi.", stream=True, keep_alive=0,
                             options={"num_predict": 3, "temperature": 0}))
    assert parts[-1].done and parts[-1].eval_count == 3
    _wait_status(router, SMOL, "unloaded")
    assert {m.model for m in oc.ps().models} == {f"{QWEN}:latest"}
    ac = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    msg = ac.messages.create(model=SMOL, max_tokens=3, messages=[{"role": "user", "content": "Say hi."}])
    assert msg.model == SMOL and msg.usage.output_tokens == 3 and msg.stop_reason == "max_tokens"
    rc = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    resp = rc.responses.create(model=QWEN, input="Say hi.", max_output_tokens=3)
    assert resp.model == QWEN and resp.usage.output_tokens == 3 and resp.status == "incomplete"
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404


def test_several_hosts_and_an_alias(tmp_path, smollm2_path):
    """--host A,B listens on both addresses; --alias names the -m model in responses and
    /v1/models (the file's name still works)."""
    import http.client
    import os
    import subprocess
    import sys

    from tests.server_process import _free_port

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", "-m", str(smollm2_path), "--alias", "my-model",
                             "--host", "127.0.0.1,127.0.0.2", "--port", str(port), "-np", "1", "-c", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NUMBA_NUM_THREADS": "2"})
    try:
        def get(host, path, body=None):
            conn = http.client.HTTPConnection(host, port, timeout=60)
            if body is None:
                conn.request("GET", path)
            else:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            out = (r.status, json.loads(r.read()))
            conn.close()
            return out

        deadline = time.monotonic() + 120
        while True:
            try:
                if get("127.0.0.1", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        for host in ("127.0.0.1", "127.0.0.2"):
            status, body = get(host, "/v1/models")
            assert status == 200 and [m["id"] for m in body["data"]] == ["my-model"]
        for name in ("my-model", SMOL, "anything"):
            status, body = get("127.0.0.2", "/v1/chat/completions",
                               {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert status == 200 and body["model"] == "my-model", body
        # one model (-m): it stays loaded; /models/load and /models/unload are a router's
        for route in ("/models/unload", "/models/load"):
            status, body = get("127.0.0.1", route, {"model": "my-model"})
            assert status == 400 and body["error"]["code"] == "unsupported_value", body
        assert get("127.0.0.1", "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 1})[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
    banner = proc.stderr.read().splitlines()[0]       # the alias with the file it names
    assert banner.startswith(f"edge serve: my-model ({smollm2_path.name}) on http://127.0.0.1:"), banner
    assert proc.returncode == 0                       # SIGTERM: a stop, not an interruption


def test_serve_says_each_burst_of_compiles():
    """edge serve names every burst of numba compiles after a quiet spell, not only the first
    (compile_notes says that one): a model loaded later by name compiled in silence for a minute."""
    from edge.cli.serve import _CompileBursts

    said = []
    bursts = _CompileBursts(said.append)
    bursts.QUIET = 0.2
    bursts.watch.on_start(None)                       # the first burst: compile_notes' note
    bursts.watch.on_start(None)
    assert said == []
    time.sleep(0.3)
    bursts.watch.on_start(None)                       # a later load
    bursts.watch.on_start(None)
    assert said == ["compiling kernels this server has not used before (once; later starts load them from "
                    "numba's cache)"]
