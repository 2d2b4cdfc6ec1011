"""`edge ps`: the models a running `edge serve` holds (its GET /v1/models), as `ollama ps`.

The CLI process has no model pool of its own: a model is in memory only inside a server, so
``edge ps`` asks the server on the default address (or --host/--port, --unix-socket) and
prints every field its answer has (the model's id, then e.g. status, n_ctx, architecture).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from datetime import datetime

_TIMEOUT_S = 5.0
_SKIP = ("object", "owned_by")     # the same for every model: OpenAI's shape, not news


def add_parser(sub) -> None:
    """The ps subcommand."""
    ps = sub.add_parser("ps", help="models loaded by a running edge serve",
                        description="List the models that the `edge serve` on HOST:PORT has loaded, with "
                                    "whatever its GET /v1/models tells of them. The edge command itself keeps no "
                                    "model in memory between commands.")
    ps.add_argument("--host", default="127.0.0.1", help="the server's address (default: 127.0.0.1)")
    ps.add_argument("--port", type=int, default=8080, help="the server's TCP port (default: 8080)")
    ps.add_argument("--unix-socket", default=None, metavar="PATH", help="ask the server on this Unix socket")
    ps.add_argument("--api-key", default=None,
                    help="the server's --api-key, if it has one (default: $EDGE_API_KEY)")
    ps.set_defaults(func=cmd_ps)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def cmd_ps(args) -> int:
    """``edge ps``: one line per model the server has, 0; 1 when no edge server answers there
    (a line saying so), it wants an API key, or something else answers."""
    where = f"unix:{args.unix_socket}" if args.unix_socket else f"{args.host}:{args.port}"
    key = args.api_key if args.api_key is not None else os.environ.get("EDGE_API_KEY")
    try:
        status, body = _get_models(args, key)
    except OSError:     # refused, no such socket, timed out, unknown host
        print(f"no edge server is running on {where}", file=sys.stderr)
        return 1
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if status == 401:
        print(f"edge ps: error: the server on {where} wants an API key: --api-key KEY or EDGE_API_KEY",
              file=sys.stderr)
        return 1
    if status == 503 and message:     # still loading, or its model failed to load
        print(f"the edge server on {where} has no model ready: {message}")
        return 0
    if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        print(f"edge ps: error: something answers on {where}, but not as an edge server does (HTTP {status})",
              file=sys.stderr)
        return 1
    print_models(answer["data"])
    return 0


def _get_models(args, key: str | None) -> tuple[int, bytes]:
    """GET /v1/models: (HTTP status, body). Raises OSError when nothing answers."""
    if args.unix_socket:
        conn = _UnixConnection(args.unix_socket, _TIMEOUT_S)
    else:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=_TIMEOUT_S)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        return response.status, response.read()
    except http.client.HTTPException as e:     # not HTTP at all: no edge server there either
        raise ConnectionError(str(e)) from None
    finally:
        conn.close()


def print_models(models: list) -> None:
    """A table of the loaded (or loading) models among /v1/models' entries: NAME (the id), then each other field in the order first
    seen (one level of nesting flattened: meta.n_ctx is N_CTX; ``created`` as a local time)."""
    # the models the server holds: a server without -m lists every pulled model, with a status
    rows = [_flatten(m) for m in models if isinstance(m, dict) and m.get("status", "loaded") in ("loaded", "loading")]
    if not rows:
        print("the edge server has no model loaded")
        return
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns and k != "id"]
    table = [["NAME"] + [c.upper() for c in columns]]
    table += [[str(r.get("id", "?"))] + [r.get(c, "") for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def _flatten(model: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in model.items():
        if key in _SKIP:
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                out.setdefault(k, _cell(k, v))
        else:
            out[key] = _cell(key, value)
    return out


def _cell(key: str, value) -> str:
    if key in ("created", "expires_at") and isinstance(value, (int, float)) and value > 0:
        return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M")
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)
