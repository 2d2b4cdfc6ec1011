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
stderr and exit with status 1, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from edge import __version__
from edge.cli import bench, evaluate, generate, models, ps, quantize, serve
from edge.cli.options import physical_cores
from edge.cli.quantize import QUANTIZE_TYPES

__all__ = ["QUANTIZE_TYPES", "build_parser", "main", "physical_cores"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge", description="Local LLM inference on CPUs (GGUF models).",
                                     epilog='Start with: edge run "Why is the sky blue?" (pulls the default model on '
                                            'first use). edge COMMAND -h tells more.')
    parser.add_argument("--version", action="version", version=f"edge {__version__}")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed; an option the command does not know is that command's usage
    error (``edge run: error: unrecognized arguments: ...``), not the top-level parser's.
    Exits with status 2 on a usage error, as argparse does."""
    parser = build_parser()
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
