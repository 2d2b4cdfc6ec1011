"""`edge serve`: the OpenAI-compatible server on uvicorn, its listening socket and its Ctrl+C."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from edge.cli.options import (add_model_args, add_spec_args, check_sizes, kernels_compiled, physical_cores,
                              positive_int, set_threads, spec_params)


def add_parser(sub) -> None:
    """The serve subcommand."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, embeddings) with continuous batching",
                           description="Serve the model over the OpenAI API (POST /v1/chat/completions, "
                                       "/v1/completions, /v1/embeddings; GET /v1/models, /health, /metrics) on "
                                       "loopback. "
                                       "POST bodies must be sent as Content-Type: application/json. Web pages "
                                       "of other sites cannot use it (Host and Origin are checked; see "
                                       "--allowed-hosts, --cors-origins). The server always computes "
                                       "batch-invariantly: a request's text does not depend on what else is "
                                       "being served.")
    add_model_args(serve, kernels_flag=False)
    serve.add_argument("--batch-invariant", action="store_true",
                       help="accepted for symmetry with edge run: the server always computes this way")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; several separated by commas, e.g. 127.0.0.1,::1 (default: "
                            "127.0.0.1)")
    serve.add_argument("-a", "--alias", default=None, metavar="NAME",
                       help="the -m model's name in responses and /v1/models (llama-server's --alias)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    serve.add_argument("--unix-socket", default=None, metavar="PATH",
                       help="listen on this Unix domain socket instead of TCP")
    serve.add_argument("-np", "--parallel", type=positive_int, default=4,
                       help="sequences generated at once (default: 4); each may use the whole -c")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests that may wait for a free sequence; more get HTTP 503 (default: 64)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "(default: $EDGE_API_KEY, else none; an empty key is an error)")
    serve.add_argument("--allowed-hosts", default=os.environ.get("EDGE_ALLOWED_HOSTS"), metavar="HOSTS",
                       help="comma-separated host names to answer besides localhost, *.localhost, IP "
                            "addresses, this machine's name and --host; * = any. Other Host headers get "
                            "403: that is how DNS rebinding reaches a local server (default: "
                            "$EDGE_ALLOWED_HOSTS, else none)")
    serve.add_argument("--cors-origins", "--cors-origin", dest="cors_origins",
                       default=os.environ.get("EDGE_CORS_ORIGINS"), metavar="ORIGINS",
                       help="comma-separated web page origins (scheme://host[:port]) that may use the server "
                            "from a browser, besides http(s)://localhost and loopback addresses on any port; "
                            "* = any. Requests from other origins get 403 (default: $EDGE_CORS_ORIGINS, "
                            "else none)")
    serve.add_argument("-to", "--timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a request must arrive whole within this time (else 408 and the connection "
                            "closes), and a client that reads nothing of its answer for this long is "
                            "dropped (default: 60)")
    serve.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                       help="reasoning models: close the <think> block after N tokens of reasoning by writing "
                            "</think>; 0 = no thinking (the template's enable_thinking is false, a block the "
                            "template opens is closed at once); -1 = no limit (default)")
    serve.add_argument("--models-max", type=positive_int, default=3, metavar="N",
                       help="without -m: most models held in memory at once; loading another unloads the least "
                            "recently used idle one (default: 3)")
    serve.add_argument("--models-memory", type=float, default=None, metavar="GB",
                       help="without -m: most GB of models (files and KV caches) held at once (default: three "
                            "quarters of physical memory)")
    serve.add_argument("--keep-alive", default="5m", metavar="DURATION",
                       help="without -m: how long an idle model stays loaded: seconds or a duration (30s, 5m, "
                            "1h); 0 = unload once idle; -1 = never (default: 5m; a request's keep_alive wins)")
    serve.add_argument("--load-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long a request waits for its model to load before a 503 (default: 300)")
    serve.add_argument("--no-log-requests", dest="log_requests", action="store_false",
                       help="do not log one line per request on stderr")
    serve.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                       help="accepted for llama-server's command lines: edge serves embeddings (/v1/embeddings, "
                            "/embedding, /api/embed) always, beside generation")
    serve.add_argument("--pooling", choices=("none", "mean", "cls", "last"), default=None,
                       help="embeddings' pooling (default: the model's pooling_type, else last: the last "
                            "token's hidden state); none gives per-token vectors on /embedding only")
    serve.add_argument("--slot-save-path", default=None, metavar="DIR",
                       help="folder of llama-server's POST /slots/ID?action=save|restore files (made if "
                            "missing; default: none, those actions answer 501)")
    add_spec_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from edge.server.app import ServerConfig
    from edge.server.asgi import create_app
    from edge.server.guard import check_api_key, parse_hosts, parse_origins
    from edge.server.transport import timed_protocol
    from edge.cli.models import resolve_with_bars

    api_key, key_source = args.api_key, "--api-key"
    if api_key is None and "EDGE_API_KEY" in os.environ:
        api_key, key_source = os.environ["EDGE_API_KEY"], "EDGE_API_KEY"
    check_api_key(api_key, key_source)
    allowed_hosts = parse_hosts(args.allowed_hosts)
    cors_origins = parse_origins(args.cors_origins)
    protocol = timed_protocol(args.timeout)
    check_sizes(args)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.reasoning_budget < -1:
        raise ValueError(f"--reasoning-budget must be -1 (no limit) or 0 or more, got {args.reasoning_budget}")
    if not 0 < args.port < 65536 and not args.unix_socket:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    spec = spec_params(args)
    from edge.server.pool import GB
    from edge.server.protocol import parse_keep_alive
    from edge.server.protocol import APIError
    try:
        keep_alive = parse_keep_alive(args.keep_alive, "--keep-alive")
    except APIError as e:
        raise ValueError(e.message) from None
    if args.models_memory is not None and not args.models_memory > 0:
        raise ValueError(f"--models-memory must be more than 0 GB, got {args.models_memory}")
    if not args.load_timeout > 0:
        raise ValueError(f"--load-timeout must be more than 0 seconds, got {args.load_timeout}")
    set_threads(args.threads)
    model = str(resolve_with_bars(args.model))      # pull before listening: errors show here
    model_draft = str(resolve_with_bars(args.model_draft)) if args.model_draft else None
    config = ServerConfig(model=model, n_ctx=args.ctx_size, n_parallel=args.parallel, max_queue=args.max_queue,
                          n_batch=args.batch_size, threads=args.threads or physical_cores(), api_key=api_key,
                          host=args.host, allowed_hosts=allowed_hosts, cors_origins=cors_origins,
                          cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                          spec=spec, model_draft=model_draft, reasoning_budget=args.reasoning_budget,
                          router=args.model is None, models_max=args.models_max,
                          models_memory=None if args.models_memory is None else int(args.models_memory * GB),
                          keep_alive=keep_alive, load_timeout=args.load_timeout, log_requests=args.log_requests,
                          alias=args.alias, pooling=args.pooling)
    if args.alias is not None and args.model is None:
        raise ValueError("--alias names the -m model: give -m too (without -m every pulled model is served by "
                         "its own name)")
    hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--host: give an address")
    if not all(map(_is_loopback, hosts)) and not args.unix_socket and not api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use "
              "the model", file=sys.stderr)
    socks = []
    try:                                                # errors before the banner
        for host in ([None] if args.unix_socket else hosts):
            socks.append(_listen_socket(host, args.port, args.unix_socket))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    where = f"unix:{args.unix_socket}" if args.unix_socket else ", ".join(
        f"http://{f'[{h}]' if ':' in h else h}:{args.port}" for h in hosts)
    which = (f"every pulled model (default {Path(model).stem}, --models-max {args.models_max})"
             if args.model is None else f"{args.alias} ({Path(model).name})" if args.alias else Path(model).name)
    print(f"edge serve: {which} on {where} (-np {args.parallel}, -c {args.ctx_size}"
          + (f", --spec-type {spec.spec_type}" + (f" -md {Path(model_draft).name}" if model_draft else "")
             if spec.enabled else "") + "); "
          "Ctrl+C stops after the running requests (twice: at once)", file=sys.stderr, flush=True)
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """A second Ctrl+C exits at once, with status 130 and one line: uvicorn would cancel
            the running requests and print their tracebacks. So does the first while the default
            model loads (its kernels may be compiling on the load thread, which cannot be
            interrupted; numba writes its cache files whole, so the cache stays usable)."""
            loading = state.pool.default is not None and not state.pool.default.ready.is_set()
            if (self.should_exit or loading) and sig == signal.SIGINT:
                print("\ninterrupted" + (" while the model loaded" if loading and not self.should_exit
                                         else ": running requests dropped"), file=sys.stderr, flush=True)
                if args.unix_socket:
                    with contextlib.suppress(OSError):
                        os.unlink(args.unix_socket)
                os._exit(128 + signal.SIGINT)
            if not self.should_exit:
                stopped.append(sig)
                running = 0
                for slot in state.pool.loaded():
                    with contextlib.suppress(Exception):
                        running += sum(slot.scheduler.counts())
                print("\nedge serve: stopping" + (f" after the {running} running request(s)" if running else "")
                      + (" (Ctrl+C again: at once)" if sig == signal.SIGINT else ""), file=sys.stderr, flush=True)
            super().handle_exit(sig, frame)

    failed: list[str] = []
    stopped: list[int] = []          # the signal that stopped the server

    def load_failed(message: str) -> None:
        """The model did not load: say so in one line and stop, as `edge run` and llama-server do."""
        failed.append(message)
        print(f"edge serve: error: {message}", file=sys.stderr, flush=True)
        server.should_exit = True

    def event(message: str) -> None:
        print(f"edge serve: {message}", file=sys.stderr, flush=True)

    config.on_load_error, config.on_event = load_failed, event
    config.slot_save_path = args.slot_save_path
    if not kernels_compiled():
        print("edge serve: first run: compiling edge's kernels for this CPU before /health says ok (about a "
              "minute on 2 cores, once; later starts load them from numba's cache)", file=sys.stderr, flush=True)
    with _CompileBursts(event):     # from the first load on: its first burst is compile_notes' note
        app = create_app(config)
        state = app.state.edge
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, http=protocol,
                                        timeout_graceful_shutdown=None))
        try:
            server.run(sockets=socks)
        except KeyboardInterrupt:   # uvicorn re-raises the Ctrl+C it handled: the drain is done
            pass
        finally:
            for sock in socks:
                sock.close()
            if args.unix_socket:
                with contextlib.suppress(OSError):
                    os.unlink(args.unix_socket)
    if failed:
        return 1
    if stopped and stopped[0] == signal.SIGINT:
        print("interrupted", file=sys.stderr, flush=True)     # as every edge command: one line, 130
        return 128 + signal.SIGINT
    if stopped:
        print("edge serve: stopped", file=sys.stderr, flush=True)
    return 0


class _CompileBursts:
    """Say "compiling kernels" each time numba starts compiling after a quiet spell, not only
    the first time (the note of edge.cli's compile_notes): a model loaded later by name (a new
    architecture or weight type) compiles its own kernels, a minute on a cold cache."""

    QUIET = 10.0          # seconds without a compile that end a burst

    def __init__(self, say):
        from edge.compile_watch import CompileWatch

        self.say, self.last, self.bursts = say, None, 0
        self.watch = CompileWatch(on_progress=self._compiled)
        self.watch.on_start = self._started

    def _started(self, ev) -> None:
        now = time.monotonic()
        if self.last is None or now - self.last > self.QUIET:
            self.bursts += 1
            if self.bursts > 1:           # the first: compile_notes said it
                self.say("compiling kernels this server has not used before (once; later starts load them from "
                         "numba's cache)")
        self.last = now

    def _compiled(self, count: int, name: str) -> None:
        self.last = time.monotonic()

    def __enter__(self):
        self.watch.__enter__()
        return self

    def __exit__(self, *exc):
        self.watch.__exit__(*exc)


def _is_loopback(host: str) -> bool:
    """Whether --host names a loopback address (127.0.0.0/8, ::1, localhost): no warning then."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen_socket(host: str, port: int, unix_path: str | None):
    """The server's listening socket, bound here so that errors are ours and clear: a Unix
    socket only the user can open (mode 0600; a path where another server listens is refused,
    a stale one replaced), or a TCP socket (address in use, unknown host)."""
    import socket

    if unix_path:
        path = Path(unix_path)
        if not path.parent.is_dir():
            raise ValueError(f"--unix-socket {unix_path}: the folder {path.parent} does not exist")
        if path.exists() or path.is_symlink():
            if not path.is_socket():
                raise ValueError(f"--unix-socket {unix_path}: a file that is not a socket is there")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise ValueError(f"--unix-socket {unix_path}: another server is listening there")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)          # left by a server that is gone
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return sock
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:       # :: beside 0.0.0.0 in one --host list: each its own family
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
