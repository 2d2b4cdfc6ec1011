"""The ``edge`` command line: run, chat, serve, perplexity, bench, imatrix, quantize, pull, list.

Flag names follow llama.cpp's tools (llama-cli, llama-perplexity) where users know them.
Errors a user can cause (bad model path, malformed GGUF, prompt too long) print one line to
stderr and exit with status 1, never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from edge import __version__
from edge.kv.cache import KV_TYPES


def physical_cores() -> int:
    """Number of physical cores this process may use (SMT siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def _add_model_args(p: argparse.ArgumentParser, ctx_default: int | None = 4096) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="model name (see `edge list`) or path to a .gguf file; default: "
                        "qwen2.5-coder-0.5b-instruct, pulled on first use")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="number of threads, >= 1 (default: number of physical cores); fewer while "
                        "other processes keep cores busy (EDGE_ADAPTIVE_THREADS=0: always this many)")
    if ctx_default is not None:
        p.add_argument("-c", "--ctx-size", type=int, default=ctx_default,
                       help=f"context size in tokens (default: {ctx_default})")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prompt tokens processed per forward pass (default: 512)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=KV_TYPES,
                   help="KV cache type for K (default: f16)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=KV_TYPES,
                   help="KV cache type for V (default: f16)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 = off (default: 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1.0 = off (default: 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling, 0.0 = off (default: 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalty for repeated tokens, 1.0 = off (default: 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="last n tokens considered for penalties, 0 = off, -1 = context (default: 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty (default: 0.0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty (default: 0.0)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random (default: -1)")


# the TYPEs of `edge quantize` (quant.mix.FILE_TYPES, not imported here: it loads numba)
QUANTIZE_TYPES = ("F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, "
                  "Q5_K_S, Q5_K_M, Q6_K")


def build_parser() -> argparse.ArgumentParser:
    from edge.store import add_list_parser, add_pull_parser

    parser = argparse.ArgumentParser(prog="edge", description="Local LLM inference on CPUs (GGUF models).")
    parser.add_argument("--version", action="version", version=f"edge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="generate text from a prompt, streamed to stdout",
                         description="Generate a completion. Instruct models get the prompt through "
                                     "their chat template; --raw sends it as is.")
    run.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (read from stdin when absent)")
    run.add_argument("-p", "--prompt", default=None, help="the prompt, as llama.cpp's -p (instead of PROMPT)")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1,
                     help="tokens to generate, -1 = until end of generation or context (default: -1)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("-sys", "--system", default=None, help="system message (chat models)")
    run.add_argument("--session", "--prompt-cache", dest="session", default=None, metavar="FILE",
                     help="session file: restore the prompt's KV cache from it when it starts the "
                          "same way, and save the prompt's state to it (llama.cpp's --prompt-cache)")
    run.set_defaults(func=cmd_run)

    ppl = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama-perplexity's method)")
    _add_model_args(ppl, ctx_default=512)
    ppl.add_argument("-f", "--file", default=None, help="text file to evaluate (not needed with --kl-divergence)")
    ppl.add_argument("--chunks", type=int, default=-1,
                     help="evaluate at most this many chunks, -1 = all (default: -1)")
    ppl.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                     help="save the model's log-probs of the scored tokens to FILE (llama-perplexity's "
                          "format); with --kl-divergence, the base file to compare with")
    ppl.add_argument("--kl-divergence", action="store_true",
                     help="compare the model with the base run saved in --kl-divergence-base FILE on its "
                          "tokens (KL divergence, same top token, probability change); -c comes from FILE")
    ppl.set_defaults(func=cmd_perplexity)

    imx = sub.add_parser("imatrix", help="importance matrix of a model on a text file (llama-imatrix's GGUF file)",
                         description="Run the model over chunks of -c tokens of the text and write the sums "
                                     "of squared activations per input column of every blk.* matrix (the "
                                     "file llama-quantize --imatrix and edge quantize --imatrix read).")
    _add_model_args(imx, ctx_default=512)
    imx.add_argument("-f", "--file", required=True, help="calibration text file")
    imx.add_argument("-o", "--output", default="imatrix.gguf", help="file to write (default: imatrix.gguf)")
    imx.add_argument("--chunks", type=int, default=-1, help="process at most this many chunks, -1 = all (default: -1)")
    imx.add_argument("--process-output", action="store_true", help="collect output.weight too")
    imx.set_defaults(func=cmd_imatrix)

    bench = sub.add_parser("bench", help="prefill, decode and batched decode tokens/s (llama-bench style)",
                           description="Throughput of one model, each number the median of -r runs; "
                                       "--vs-llama-cpp runs the same tests through llama-cpp-python.")
    _add_model_args(bench)
    bench.add_argument("-p", "--n-prompt", type=_positive_int, default=512, help="prompt tokens of ppN (default: 512)")
    bench.add_argument("-n", "--n-gen", type=_positive_int, default=128, help="tokens generated by tgN (default: 128)")
    bench.add_argument("-B", "--batched", type=_positive_int_list, default=(1, 4, 8),
                       help="sequences decoding together, comma-separated (default: 1,4,8)")
    bench.add_argument("-r", "--repetitions", type=_positive_int, default=3, help="runs per test (default: 3)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bench.add_argument("--vs-llama-cpp", action="store_true", help="run the same tests through llama-cpp-python")
    bench.add_argument("--llama-python", default=sys.executable,
                       help="interpreter that has llama-cpp-python (default: this one)")
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions) with continuous batching",
                           description="Serve the model over the OpenAI API (POST /v1/chat/completions, "
                                       "/v1/completions; GET /v1/models, /health, /metrics) on loopback. "
                                       "POST bodies must be sent as Content-Type: application/json. Web pages "
                                       "of other sites cannot use it (Host and Origin are checked; see "
                                       "--allowed-hosts, --cors-origins).")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    serve.add_argument("--unix-socket", default=None, metavar="PATH",
                       help="listen on this Unix domain socket instead of TCP")
    serve.add_argument("-np", "--parallel", type=_positive_int, default=4,
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
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="chat with a model in the terminal (a textual app)",
                          description="A terminal chat: answers stream in as Markdown; Esc stops one; "
                                      "/help lists the commands. Conversations are saved under "
                                      "$EDGE_HOME/chats/ as they happen.")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1,
                      help="most tokens per answer, -1 = until the end of the answer (default: -1)")
    chat.add_argument("-sys", "--system", default=None, help="system message")
    chat.add_argument("--resume", action="store_true",
                      help="reopen the last conversation (its KV cache too, when the model is the same)")
    chat.set_defaults(func=cmd_chat, batch_size=64)

    quant = sub.add_parser("quantize", help="quantize a GGUF file (llama-quantize's types, the same bytes)",
                           description="Convert IN.gguf (F32/F16/BF16 weights) to the quantization mix TYPE "
                                       "as llama-quantize does (with --imatrix, weighted by it): the same tensor types and "
                                       "the same file bytes. OUT is written to a temporary file and renamed "
                                       "when complete. TYPE: " + QUANTIZE_TYPES + ".")
    quant.add_argument("input", metavar="IN.gguf", help="source model")
    quant.add_argument("output", metavar="OUT.gguf", help="quantized model to write (replaced if it exists)")
    quant.add_argument("type", metavar="TYPE", help="quantization mix, e.g. Q4_K_M, Q8_0 (name or llama_ftype number)")
    quant.add_argument("-t", "--threads", type=int, default=None,
                       help="number of threads, >= 1 (default: number of physical cores)")
    quant.add_argument("--pure", action="store_true",
                       help="no k-quant mixture: every tensor gets TYPE's base type (row-length fallbacks apply)")
    quant.add_argument("--output-tensor-type", metavar="GGML_TYPE", default=None,
                       help="type of output.weight (of the tied token embeddings when there is none)")
    quant.add_argument("--token-embedding-type", metavar="GGML_TYPE", default=None,
                       help="type of token_embd.weight")
    quant.add_argument("--leave-output-tensor", action="store_true", help="copy output.weight unquantized")
    quant.add_argument("--allow-requantize", action="store_true",
                       help="allow converting tensors that are already quantized (loses quality)")
    quant.add_argument("--imatrix", metavar="FILE", default=None,
                       help="importance matrix (GGUF, from edge imatrix or llama-imatrix) to weight the quantization")
    quant.add_argument("--dry-run", action="store_true",
                       help="print each tensor's new type and the output size; write nothing")
    quant.set_defaults(func=cmd_quantize)

    add_pull_parser(sub)
    add_list_parser(sub)
    return parser


def cmd_quantize(args) -> int:
    from quant.mix import QuantizeOptions, parse_file_type, parse_tensor_type
    from quant.pipeline import check_output_path, plan_quantize, quantize_file

    def tensor_type(value, flag):
        return None if value is None else parse_tensor_type(value, flag)

    from edge.imatrix import load_imatrix

    ftype = parse_file_type(args.type)
    imatrix = load_imatrix(args.imatrix) if args.imatrix is not None else None
    options = QuantizeOptions(
        pure=args.pure, leave_output_tensor=args.leave_output_tensor, allow_requantize=args.allow_requantize,
        output_tensor_type=tensor_type(args.output_tensor_type, "--output-tensor-type"),
        token_embedding_type=tensor_type(args.token_embedding_type, "--token-embedding-type"))
    if args.dry_run:
        check_output_path(args.input, args.output, args.imatrix)      # what the real run refuses (quantize_file)
        _print_quantize_plan(plan_quantize(args.input, ftype, options, imatrix))
        return 0
    _set_threads(args.threads)
    t0 = time.perf_counter()
    with _quantize_progress() as on_progress:
        plan = quantize_file(args.input, args.output, ftype, options, progress=on_progress, imatrix=imatrix)
    seconds = time.perf_counter() - t0
    mib = 1 << 20
    print(f"{args.input}: {plan.source_size / mib:.2f} MiB -> {args.output}: {plan.output_size / mib:.2f} MiB "
          f"({ftype.name}, {plan.output_size / plan.source_size:.1%} of the source) in {seconds:.1f} s")
    if imatrix is not None:     # as llama-quantize reports it: how much of the model the imatrix covered
        weighted = [t for t in plan.tensors if t.converts and t.name in imatrix.weights]
        converted = [t for t in plan.tensors if t.converts]
        print(f"imatrix {args.imatrix}: {len(imatrix.weights)} entries, {len(weighted)} of the {len(converted)} "
              "converted tensors weighted by it", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _quantize_progress():
    """A rich progress bar on stderr for quantize_file: values done, the tensor being written."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, disable=not console.is_terminal) as bars:
        task = bars.add_task("quantize", total=None)

        def on_progress(done: int, total: int, tensor) -> None:
            what = (f"{tensor.src_type.name} -> {tensor.new_type.name}" if tensor.converts
                    else f"{tensor.src_type.name}, copied")
            bars.update(task, completed=done, total=total, description=f"{tensor.name} ({what})")

        yield on_progress


def _print_quantize_plan(plan) -> None:
    """--dry-run: one line per tensor (name, shape, type change, bytes), then the sizes."""
    n = len(plan.tensors)
    for i, t in enumerate(plan.tensors, 1):
        change = f"{t.src_type.name:>5} -> {t.new_type.name:<5}" if t.converts else f"{t.src_type.name:>5} (copied)"
        note = f"  ({t.fallback_from.name} does not fit rows of {t.shape[0]})" if t.fallback_from else ""
        print(f"[{i:4}/{n}] {t.name:<36} {str(list(t.shape)):<20} {change:<16} "
              f"{t.src_bytes:>13,} -> {t.new_bytes:>13,} bytes{note}")
    mib = 1 << 20
    n_conv = sum(t.converts for t in plan.tensors)
    print(f"{plan.ftype.name}: {n} tensors, {n_conv} converted; output {plan.output_size:,} bytes "
          f"({plan.output_size / mib:.2f} MiB), {plan.output_size / plan.source_size:.1%} of the source's "
          f"{plan.source_size:,} bytes")


def cmd_chat(args) -> int:
    from edge.chat import ChatSettings

    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be -1 (no limit) or more, got {args.max_tokens}")
    _check_sizes(args)
    with _naming_flags():
        settings = ChatSettings(max_tokens=args.max_tokens, **_sampling_fields(args))
    if args.model is not None:   # a wrong name fails here, before the screen changes
        from edge.store import resolve_model
        resolve_model(args.model)
    _set_threads(args.threads)
    if not _kernels_compiled():
        print("note: first run: compiling edge's kernels for this CPU (about half a minute, once)",
              file=sys.stderr, flush=True)
    # the terminal app lives outside edge/ (edge never imports textual); loaded for this command only
    from tui.app import ChatOptions, run_chat

    return run_chat(ChatOptions(model=args.model, system=args.system, settings=settings, n_ctx=args.ctx_size,
                                n_batch=args.batch_size, cache_type_k=args.cache_type_k,
                                cache_type_v=args.cache_type_v, resume=args.resume,
                                threads=args.threads or physical_cores()))


def cmd_serve(args) -> int:
    import uvicorn

    from edge.server.app import ServerConfig, create_app
    from edge.server.guard import check_api_key, parse_hosts, parse_origins
    from edge.server.transport import timed_protocol
    from edge.store import resolve_model

    api_key, key_source = args.api_key, "--api-key"
    if api_key is None and "EDGE_API_KEY" in os.environ:
        api_key, key_source = os.environ["EDGE_API_KEY"], "EDGE_API_KEY"
    check_api_key(api_key, key_source)
    allowed_hosts = parse_hosts(args.allowed_hosts)
    cors_origins = parse_origins(args.cors_origins)
    protocol = timed_protocol(args.timeout)
    _check_sizes(args)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if not 0 < args.port < 65536 and not args.unix_socket:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    _set_threads(args.threads)
    model = str(resolve_model(args.model))      # pull before listening: errors show here
    config = ServerConfig(model=model, n_ctx=args.ctx_size, n_parallel=args.parallel, max_queue=args.max_queue,
                          n_batch=args.batch_size, threads=args.threads or physical_cores(), api_key=api_key,
                          host=args.host, allowed_hosts=allowed_hosts, cors_origins=cors_origins,
                          cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.unix_socket and not api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use "
              "the model", file=sys.stderr)
    sock = _listen_socket(args.host, args.port, args.unix_socket)   # errors before the banner
    where = f"unix:{args.unix_socket}" if args.unix_socket else f"http://{args.host}:{args.port}"
    print(f"edge serve: {Path(model).name} on {where} (-np {args.parallel}, -c {args.ctx_size}); "
          "Ctrl+C stops after the running requests (twice: at once)", file=sys.stderr, flush=True)
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """A second Ctrl+C exits at once, with status 130 and one line: uvicorn would cancel
            the running requests and print their tracebacks."""
            if self.should_exit and sig == signal.SIGINT:
                print("\ninterrupted: running requests dropped", file=sys.stderr, flush=True)
                if args.unix_socket:
                    with contextlib.suppress(OSError):
                        os.unlink(args.unix_socket)
                os._exit(128 + signal.SIGINT)
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(create_app(config), log_level="warning", access_log=False, http=protocol,
                                    timeout_graceful_shutdown=None))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises the Ctrl+C it handled: the drain is done
        pass
    finally:
        sock.close()
        if args.unix_socket:
            with contextlib.suppress(OSError):
                os.unlink(args.unix_socket)
    return 0


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
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _positive_int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(x) for x in text.split(","))


def _set_threads(n: int | None) -> None:
    from edge.threads import use_threads

    if n is None:
        n = physical_cores()
    if n < 1:
        raise ValueError(f"-t/--threads must be at least 1, got {n}")
    use_threads(n)


def _kernels_compiled() -> bool:
    """True when numba's on-disk cache already holds edge's kernels (a kernel every forward
    pass runs has its cache index), so this run will not spend half a minute compiling."""
    from kernels_cpu import ops

    try:
        return Path(ops._rms_norm_rows._cache._cache_file._index_path).is_file()
    except AttributeError:  # another numba version's cache layout: say nothing
        return True


def _check_output_file(out: str | Path, flag: str, replaceable: Callable[[Path], bool], kind: str,
                       **inputs: str | None) -> None:
    """Checks, before any work, the file an option writes (``flag``, e.g. ``-o``): a file path in
    an existing folder this process can write to, not one of the named input files (the same
    file, also through links: writing it would destroy the input), and, if a file is there
    already, one that ``replaceable(path)`` accepts as an earlier output of the same ``kind``.
    Raises ValueError with one line naming the path."""
    from edge.files import check_output_file

    check_output_file(out, f"{flag} ", inputs)
    out = Path(out)
    if out.exists() and out.stat().st_size and not replaceable(out):
        raise ValueError(f"{flag} {out} exists and is not {kind}; edge replaces only such a file: remove it "
                         "or give another path")


def _is_imatrix(path: Path) -> bool:
    from edge.imatrix import ImatrixError, load_imatrix

    try:
        load_imatrix(path)
        return True
    except ImatrixError:
        return False


def _load_engine(args):
    from edge.engine import Engine
    from edge.store import resolve_model

    _set_threads(args.threads)
    _check_sizes(args)
    path = resolve_model(args.model)
    engine = Engine(path, n_ctx=args.ctx_size, n_batch=args.batch_size,
                    cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    if args.ctx_size > engine.model.args.n_ctx_train:
        print(f"warning: -c {args.ctx_size} is more than the {engine.model.args.n_ctx_train} tokens "
              f"{engine.name} was trained on; quality drops past that", file=sys.stderr)
    if not _kernels_compiled():
        print("note: first run: compiling edge's kernels for this CPU (about half a minute, once; "
              "later runs load them from numba's cache)", file=sys.stderr, flush=True)
    return engine


_SAMPLING_FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                   "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
                   "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                   "seed": "-s/--seed"}


def _sampling_fields(args) -> dict:
    """SamplingParams fields from the options of _add_sampling_args."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=None if args.seed < 0 else args.seed)


@contextlib.contextmanager
def _naming_flags():
    """An InvalidParameter from SamplingParams becomes a ValueError naming the flag the user typed."""
    from edge.sampling import InvalidParameter

    try:
        yield
    except InvalidParameter as e:
        raise ValueError(f"{_SAMPLING_FLAGS.get(e.param, e.param)} must be {e.rule}, got {e.value!r}") from None


def _check_sizes(args) -> None:
    for flag, value in (("-c/--ctx-size", args.ctx_size), ("-b/--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")


def cmd_run(args) -> int:
    from edge.engine import GenerationStats
    from edge.sampling import SamplingParams
    from edge.tokenizer import StreamDecoder

    if args.prompt is not None and args.prompt_arg is not None:
        raise ValueError("give the prompt either as PROMPT or with -p, not both")
    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be -1 (no limit) or more, got {args.max_tokens}")
    prompt = args.prompt if args.prompt is not None else args.prompt_arg
    if prompt is None:
        prompt = sys.stdin.read()
        if prompt.endswith("\n"):   # one trailing newline, as llama.cpp's -f and `echo` add
            prompt = prompt[:-1]
    with _naming_flags():
        params = SamplingParams(**_sampling_fields(args))
    t_start = time.perf_counter()
    engine = _load_engine(args)
    if args.raw or engine.template is None:
        if not args.raw:
            print(f"note: {engine.name} has no chat template; the prompt is sent as is", file=sys.stderr)
        if args.system:
            print("note: --system is ignored: without a chat template there is no system turn",
                  file=sys.stderr)
        ids = engine.raw_prompt(prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = engine.chat_prompt(messages)
    stats = GenerationStats()
    decoder = StreamDecoder()
    out = sys.stdout
    max_tokens = None if args.max_tokens < 0 else args.max_tokens     # -n -1: no limit
    try:
        for tok in engine.generate(ids, params, max_tokens, stats, session=args.session):
            text = decoder.feed(engine.tokenizer.token_to_piece(tok, special=False))
            if text:
                out.write(text)
                out.flush()
    except Exception:
        if stats.n_generated:      # e.g. the disk filled while decoding: the error gets a line of its own
            print(file=sys.stderr, flush=True)
        raise
    out.write(decoder.flush())
    if out.isatty():
        out.write("\n")  # end the line for the shell prompt; piped output stays the model's text
    out.flush()
    total = time.perf_counter() - t_start
    print(f"\nprompt: {stats.n_prompt} tokens, TTFT {stats.ttft * 1000:.0f} ms, "
          f"{stats.prompt_tps:.1f} tokens/s | generated: {stats.n_generated} tokens, "
          f"{stats.gen_tps:.1f} tokens/s | finish: {stats.finish_reason}"
          f"{f' (context full: -c {args.ctx_size})' if stats.context_full else ''} | total {total:.1f} s"
          + (f" | {stats.n_restored} prompt tokens restored from {args.session}" if stats.n_restored else "")
          + (f" | {args.session} held another prompt; it now holds this one" if stats.session_replaced else ""),
          file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    from edge.perplexity import perplexity
    from edge.files import file_starts_with

    if args.chunks == 0 or args.chunks < -1:
        raise ValueError(f"--chunks must be -1 (all) or at least 1, got {args.chunks}")
    if args.kl_divergence:
        return _kl_divergence(args)
    if args.file is None:
        raise ValueError("perplexity needs a text file: -f FILE")
    if args.ctx_size < 4 or args.ctx_size % 2:
        raise ValueError(f"-c/--ctx-size must be an even number >= 4 for perplexity, got {args.ctx_size}")
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    args.batch_size = min(args.batch_size, args.ctx_size)
    engine = _load_engine(args)
    if args.kl_divergence_base:
        _check_output_file(args.kl_divergence_base, "--kl-divergence-base",
                           lambda p: file_starts_with(p, b"_logits_"),
                           "a --kl-divergence-base file (to compare a model with one, add --kl-divergence)",
                           model=str(engine.path), text=args.file)
    t0 = time.perf_counter()

    def on_chunk(i, running):
        print(f"[{i}]{running:.4f},", end="", file=sys.stderr, flush=True)

    res = perplexity(engine, text, args.ctx_size, args.chunks, on_chunk, save_base=args.kl_divergence_base)
    print(file=sys.stderr)
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.stderr:.5f}")
    print(f"{res.n_chunks} chunks of {res.n_ctx} tokens, {res.n_scored} tokens scored, "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.kl_divergence_base:
        print(f"base log-probs saved to {args.kl_divergence_base}", file=sys.stderr)
    return 0


def _kl_divergence(args) -> int:
    """edge perplexity --kl-divergence: the model against a saved base run (its n_ctx and tokens)."""
    from edge.kl_divergence import kl_divergence
    from edge.logits_file import BaseLogits

    if not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs the base run's file: --kl-divergence-base FILE")
    base = BaseLogits(args.kl_divergence_base)
    if args.file is not None:
        print(f"note: -f {args.file} is not used: the tokens come from {base.path}", file=sys.stderr)
    if args.ctx_size not in (512, base.n_ctx):        # 512: the default, i.e. not given
        print(f"note: -c {args.ctx_size} is not used: the base run's n_ctx is {base.n_ctx}", file=sys.stderr)
    args.ctx_size = base.n_ctx
    args.batch_size = min(args.batch_size, base.n_ctx)
    engine = _load_engine(args)
    t0 = time.perf_counter()

    def on_chunk(r):
        if r.n_chunks == 1:     # the header once the model fits the file
            print("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                  "Δp RMS            Same top p", file=sys.stderr)
        print(r.chunk_line(), file=sys.stderr, flush=True)

    res = kl_divergence(engine, base, args.chunks, on_chunk)
    lines = res.report_lines()
    if not lines:
        print(f"only {res.count} positions scored: statistics need at least 100", file=sys.stderr)
    print("\n".join(lines))
    print(f"{res.n_chunks} chunks of {base.n_ctx} tokens, {res.count} tokens compared, "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_imatrix(args) -> int:
    from edge.imatrix import MIN_ROWS, compute_imatrix, write_imatrix

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = Path(args.output)
    args.batch_size = min(args.batch_size, args.ctx_size)
    if args.batch_size < MIN_ROWS:
        raise ValueError(f"-c/-b {args.batch_size}: llama-imatrix's rule collects only batches of at least "
                         f"{MIN_ROWS} tokens; use -c and -b of {MIN_ROWS} or more")
    if 0 < args.ctx_size % args.batch_size < MIN_ROWS:
        print(f"note: the last {args.ctx_size % args.batch_size} tokens of each chunk make a batch of fewer than "
              f"{MIN_ROWS} and are not collected (use a -b that divides -c)", file=sys.stderr)
    engine = _load_engine(args)
    _check_output_file(out, "-o", _is_imatrix, "an imatrix file", model=str(engine.path), text=args.file)
    if args.process_output and "output.weight" not in engine.gguf.tensors:
        print(f"note: {engine.name} has no output.weight (the output reuses token_embd.weight): "
              "--process-output adds nothing", file=sys.stderr)
    t0 = time.perf_counter()

    def on_chunk(i, n):
        print(f"[{i}/{n}]", end=" ", file=sys.stderr, flush=True)

    imatrix = compute_imatrix(engine, text, args.ctx_size, args.batch_size, args.chunks, args.process_output,
                              dataset=args.file, on_chunk=on_chunk)
    print(file=sys.stderr)
    if not imatrix.sums:
        raise ValueError("no matrix product had 16 or more activation rows: nothing collected, nothing written")
    write_imatrix(out, imatrix)
    print(f"{out}: {len(imatrix.sums)} entries, {imatrix.chunk_count} chunks of {imatrix.chunk_size} tokens, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def cmd_bench(args) -> int:
    import json

    import numba

    from edge.bench import BenchConfig, print_result, run_bench
    from edge.store import resolve_model

    _set_threads(args.threads)
    cfg = BenchConfig(model=resolve_model(args.model), n_prompt=args.n_prompt, n_gen=args.n_gen,
                      n_batch=args.batch_size, n_ctx=args.ctx_size, batch_sizes=args.batched,
                      reps=args.repetitions, threads=numba.get_num_threads(),
                      cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                      llama_python=args.llama_python if args.vs_llama_cpp else None)
    result = run_bench(cfg)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result)
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl+C so that every cleanup path runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """Run one edge command; returns the exit status (0 ok, 1 error, 2 usage, 128+N signal N)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    command = "edge"
    try:
        from edge.gguf_file import GGUFError

        args = build_parser().parse_args(argv)
        command = f"edge {args.command}"
        return args.func(args)
    except KeyboardInterrupt as e:
        print("\ninterrupted", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, _Terminated) else signal.SIGINT)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`); silence the flush at exit too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemoryError:
        print(f"{command}: error: out of memory (a smaller -c/--ctx-size needs less)", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"{command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except (GGUFError, ValueError, RuntimeError) as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
