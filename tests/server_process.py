"""An `edge serve` subprocess for the server tests (TCP on 127.0.0.1 or a Unix socket, optional
API key) and the checks they share: the OpenAI error shape, SSE framing, a POST left unread."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ERROR_KEYS = {"message", "type", "param", "code"}

# ---- a server process -------------------------------------------------------------------------

class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An `edge serve` subprocess listening on a TCP port of 127.0.0.1 or a Unix socket."""

    def __init__(self, args: list[str], log: Path, uds: str | None = None, api_key: str | None = None,
                 prefix: list[str] = (), env: dict | None = None):
        """``prefix``: argv the command runs under (e.g. unshare); ``env``: variables to set."""
        self.uds, self.api_key, self.log = uds, api_key, log
        self.port = None if uds else _free_port()
        where = ["--unix-socket", uds] if uds else ["--host", "127.0.0.1", "--port", str(self.port)]
        key = ["--api-key", api_key] if api_key else []
        env = {**os.environ, "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", "2"), **(env or {})}
        env.pop("EDGE_API_KEY", None)
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "edge.cli", "serve", *args, *where, *key],
                                         stdout=f, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float) -> None:
        """Until GET /health is 200; fails with the server's output if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"edge serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"edge serve not ready after {timeout} s:\n{self.log_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        if self.uds:
            return _UnixHTTPConnection(self.uds, timeout)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 120) -> tuple[int, str, bytes]:
        """(status, content type, body bytes); a dict body is sent as JSON."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"}
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        hdrs.update(headers or {})
        conn = self.connection(timeout)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            return r.status, r.getheader("content-type", ""), r.read()
        finally:
            conn.close()

    def post(self, path: str, body: bytes | dict, **kw) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def get(self, path: str, **kw) -> tuple[int, dict]:
        status, _, raw = self.request("GET", path, **kw)
        return status, json.loads(raw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name with its labels, the sum over the labels (``model``,
        ``outcome``) of each labelled name by its bare name (a histogram's buckets by
        ``name{le="..."}``), and '# TYPE' kinds as 'TYPE name'."""
        status, _, raw = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in raw.decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                out[f"TYPE {name}"] = kind
            elif line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
                if "{" in name:
                    bare, labels = name[:-1].split("{", 1)
                    le = [x for x in labels.split(",") if x.startswith("le=")]
                    key = f"{bare}{{{le[0]}}}" if le else bare
                    if key != name:
                        out[key] = out.get(key, 0.0) + float(value)
        return out

    def wait_idle(self, timeout: float = 5) -> dict[str, float]:
        """Metrics once no request runs or waits and no KV block is held; fails after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["edge_requests_running"], m["edge_requests_waiting"], m["edge_kv_blocks_used"]) == (0, 0, 0)
            if idle:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"server not idle after {timeout} s: running {m['edge_requests_running']}, waiting "
                            f"{m['edge_requests_waiting']}, KV blocks used {m['edge_kv_blocks_used']}")
            time.sleep(0.05)


@contextlib.contextmanager
def running(args: list[str], log: Path, timeout: float = 120, **kw):
    """An `edge serve` subprocess (Server's arguments), ready (GET /health 200), stopped on exit."""
    srv = Server(args, log, **kw)
    try:
        srv.wait_ready(timeout)
        yield srv
    finally:
        srv.stop()


def start_post(srv: Server, route: str, body: dict) -> http.client.HTTPConnection:
    """Send a POST and return its connection without reading the response."""
    conn = srv.connection()
    conn.request("POST", route, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def sse_events(raw: bytes) -> list[str]:
    """The data of each server-sent event; asserts the `data: ...\\n\\n` framing."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: "):] for e in events]


def assert_error(status: int, body: dict, want_status: int, param=..., code=...) -> dict:
    assert status == want_status, body
    assert set(body) == {"error"} and ERROR_KEYS <= set(body["error"]), body
    assert set(body["error"]) - ERROR_KEYS <= {"n_prompt_tokens", "n_ctx"}, body   # llama-server's context figures
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if want_status < 500 else "server_error")
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


