"""The ``edge`` command line: run, chat, serve, perplexity, bench, imatrix, quantize, pull, list.

The roof of the house: the only package that imports the applications (quant/, tui/,
edge/server/) and that prints the library's work as rich tables and progress bars. One module
per group of commands, each adding its subcommands to the parser: :mod:`~edge.cli.generate`
(run, chat), :mod:`~edge.cli.serve`, :mod:`~edge.cli.evaluate` (perplexity, imatrix),
:mod:`~edge.cli.quantize`, :mod:`~edge.cli.bench`, :mod:`~edge.cli.models` (pull, list);
:mod:`~edge.cli.options` holds what they share.

Flag names follow llama.cpp's tools (llama-cli, llama-perplexity) where users know them.
Errors a user can cause (bad model path, malformed GGUF, prompt too long) print one line to
stderr and exit with status 1, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from edge import __version__
from edge.cli import bench, evaluate, generate, models, quantize, serve
from edge.cli.options import physical_cores
from edge.cli.quantize import QUANTIZE_TYPES

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
    parser = argparse.ArgumentParser(prog="edge", description="Local LLM inference on CPUs (GGUF models).")
    parser.add_argument("--version", action=_Version, help="show the version, kernel path and numba's target CPU")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate.add_parsers(sub)      # run, chat
    evaluate.add_parsers(sub)      # perplexity, imatrix
    bench.add_parser(sub)
    serve.add_parser(sub)
    quantize.add_parser(sub)
    models.add_parsers(sub)        # pull, list
    parser.commands = sub.choices  # command name -> its parser (for its own usage errors)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed; an option the command does not know is that command's usage
    error (``edge run: error: unrecognized arguments: ...``), not the top-level parser's.
    Exits with status 2 on a usage error, as argparse does."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


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

        args = parse_args(argv)
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
