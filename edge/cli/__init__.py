"""The ``edge`` command line: run, chat, pull, list, show, rm, ps, serve, quantize, bench,
perplexity, imatrix.

The roof of the house: the only package that imports the applications (quant/, tui/,
edge/server/) and that prints the library's work as rich tables and progress bars. One module
per group of commands, each adding its subcommands to the parser: :mod:`~edge.cli.generate`
(run, chat), :mod:`~edge.cli.serve`, :mod:`~edge.cli.evaluate` (perplexity, imatrix),
:mod:`~edge.cli.quantize`, :mod:`~edge.cli.bench`, :mod:`~edge.cli.models` (pull, list, show, rm),
:mod:`~edge.cli.ps`;
:mod:`~edge.cli.options` holds what they share.

Flag names follow llama.cpp's tools (llama-cli, llama-perplexity) where users know them.
Errors a user can cause (bad model path, malformed GGUF, prompt too long) print one line to
stderr and exit with status 1, never a traceback. Ctrl+C at any moment, a numba compile
included, ends a command with status 130 and one line, ``interrupted`` (:func:`main`).
"""
from __future__ import annotations

import os
import signal
import sys


def _quiet_exit(signum, frame):
    """Ctrl+C while the command line's modules load: nothing to clean up yet."""
    os.write(2, b"interrupted\n")
    os._exit(128 + signum)


def _set_sigint(handler):
    """signal.signal(SIGINT, handler) from the main thread (elsewhere nothing, None)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:          # imported on another thread
        return None


_starting_handler = _set_sigint(_quiet_exit)     # restored at the end of this module

import _thread  # noqa: E402
import argparse  # noqa: E402
import contextlib  # noqa: E402
import threading  # noqa: E402

from kernels_cpu import TargetError  # noqa: E402

try:  # numba's target is checked before anything compiles (LLVM aborts on a malformed feature list)
    from kernels_cpu import simd as _simd  # noqa: E402
except TargetError as _e:
    raise SystemExit(f"edge: {_e}") from None

from edge import __version__  # noqa: E402
from edge.cli import bench, evaluate, generate, models, ps, quantize, serve  # noqa: E402
from edge.cli.options import UsageError, compile_notes, physical_cores  # noqa: E402
from edge.cli.quantize import QUANTIZE_TYPES  # noqa: E402

__all__ = ["QUANTIZE_TYPES", "build_parser", "main", "physical_cores"]


def version() -> str:
    """"edge 0.1.0 (kernels: avx512-vnni, numba target znver4)": the kernel path edge takes and
    the CPU numba compiles for (kernels_cpu.simd.kernel_path, cpu_target)."""
    from kernels_cpu import simd

    return f"edge {__version__} (kernels: {simd.kernel_path()}, numba target {simd.cpu_target()})"


class _Version(argparse.Action):
    """--version: prints version() and exits 0 (computed when asked, not at every parse)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge", description="Local LLM inference on CPUs (GGUF models).",
                                     epilog='Start with: edge run "Why is the sky blue?" (pulls the default model on '
                                            'first use). edge COMMAND -h tells more.')
    parser.add_argument("--version", action=_Version, help="show the version, kernel path and numba's target CPU")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parsers(sub)      # run, chat
    models.add_parsers(sub)        # pull, list, show, rm
    ps.add_parser(sub)
    serve.add_parser(sub)
    quantize.add_parser(sub)
    bench.add_parser(sub)
    evaluate.add_parsers(sub)      # perplexity, imatrix
    parser.commands = sub.choices  # command name -> its parser (for its own usage errors)
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line parsed; an option the command does not know is that command's usage
    error (``edge run: error: unrecognized arguments: ...``), not the top-level parser's.
    Exits with status 2 on a usage error, as argparse does."""
    parser = parser or build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        (parser.commands[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:    # `edge` alone: the help, as `ollama` prints it
        args.func = lambda _args: (parser.print_help(), 0)[1]
    return args


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl+C so that every cleanup path runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    raise _Terminated(signum)


# numba's object-code hooks, called by LLVM through ctypes while a kernel compiles: an exception
# raised in one is printed ("Exception ignored on calling ctypes callback function") and lost,
# and numba then fails with "no compiled object yet" (or compiles on as if nothing happened)
_CALLBACKS = frozenset(("_raw_object_cache_notify", "_raw_object_cache_getbuffer", "_object_compiled_hook",
                        "_object_getbuffer_hook"))
_interrupt = threading.Event()    # Ctrl+C was pressed (a lost KeyboardInterrupt still counts)


def _in_callback(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name in _CALLBACKS:
            return True
        frame = frame.f_back
    return False


_timers: list[threading.Timer] = []


def _deliver_later() -> None:
    """The interrupt again in 50 ms, when the main thread is (likely) back in Python code."""
    timer = threading.Timer(0.05, _thread.interrupt_main)
    timer.daemon = True
    _timers.append(timer)
    timer.start()


def _on_sigint(signum, frame):
    """Ctrl+C: KeyboardInterrupt, except inside a ctypes callback of a numba compile, where it
    would be lost: there it is delivered again once the callback has returned."""
    _interrupt.set()
    if _in_callback(frame):
        _deliver_later()
        return
    raise KeyboardInterrupt


def _on_unraisable(unraisable) -> None:
    """A KeyboardInterrupt lost in a callback all the same: not printed, delivered again; after
    Ctrl+C, what objects it cut short say as they are collected is not printed either."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _interrupt.set()
        _deliver_later()
        return
    if not _interrupt.is_set():
        sys.__unraisablehook__(unraisable)


class _LineTracker:
    """sys.stderr, remembering whether its last write ended a line (so "interrupted" starts
    one only when needed)."""

    def __init__(self, stream):
        self._stream = stream
        self.mid_line = False

    def write(self, text: str) -> int:
        if text:
            self.mid_line = not text.endswith("\n")
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


# commands that may wait on numba compiling kernels: a note says so when it happens (run and
# chat show it their own way)
_COMPILING = {"bench", "quantize", "perplexity", "imatrix", "serve"}


def main(argv: list[str] | None = None) -> int:
    """Run one edge command; returns the exit status (0 ok, 1 error, 2 usage, 128+N signal N)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    old_sigint = signal.signal(signal.SIGINT, _on_sigint)
    old_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    old_stderr = sys.stderr
    sys.stderr = tracker = _LineTracker(old_stderr) if old_stderr is not None else None
    _interrupt.clear()
    command = "edge"

    def interrupted(signum: int = signal.SIGINT) -> int:
        print(("\n" if tracker is not None and tracker.mid_line else "") + "interrupted", file=sys.stderr, flush=True)
        if argv is None:
            # the program itself (not a caller's main(argv)): exit now. A compile cut short can
            # leave LLVM objects that crash the interpreter's finalization, and a worker thread
            # still compiling would hold the exit; numba's cache files are each written whole.
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(128 + signum)
        return 128 + signum

    lacking = _simd.host_lacks()
    if lacking:
        print(f"edge: warning: numba's target CPU has {', '.join(lacking)}, which this CPU lacks: kernels compiled "
              f"for it stop with an illegal instruction here (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)", file=sys.stderr)
    try:
        from edge.gguf_file import GGUFError

        parser = build_parser()
        args = parse_args(argv, parser)
        command = f"edge {args.command}"
        try:
            if args.command in _COMPILING:
                with compile_notes(live=False):
                    return args.func(args)
            return args.func(args)
        except UsageError as e:      # found after parsing (e.g. no prompt anywhere): usage, status 2
            parser.commands[args.command].error(str(e))
    except KeyboardInterrupt as e:
        return interrupted(e.signum if isinstance(e, _Terminated) else signal.SIGINT)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`); silence the flush at exit too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemoryError:
        print(f"{command}: error: out of memory (a smaller -c/--ctx-size needs less)", file=sys.stderr)
        return 1
    except OSError as e:
        if _interrupt.is_set():
            return interrupted()
        where = f"{e.filename}: " if e.filename else ""
        print(f"{command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except (GGUFError, ValueError, RuntimeError) as e:
        if _interrupt.is_set():      # e.g. numba's "no compiled object yet" after a lost Ctrl+C
            return interrupted()
        print(f"{command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        while _timers:
            _timers.pop().cancel()
        sys.stderr = old_stderr
        sys.unraisablehook = old_hook
        signal.signal(signal.SIGINT, old_sigint)


if _starting_handler is not None:
    _set_sigint(_starting_handler)

if __name__ == "__main__":
    sys.exit(main())
