"""What several commands share: model, sampling and size options, threads, the engine loader,
output-file checks, usage errors, and the notes of numba compiling kernels (compile_notes)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from edge.kv.cache import KV_TYPES


class UsageError(ValueError):
    """A command line that cannot work, found after parsing: edge.cli.main prints the command's
    usage and this message, exit status 2, as argparse does for its own checks."""


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


def add_model_args(p: argparse.ArgumentParser, ctx_default: int | None = 4096, kernels_flag: bool = True) -> None:
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
    if kernels_flag:
        p.add_argument("--batch-invariant", action="store_true",
                       help="one arithmetic per row whatever the batch, as edge serve computes: a prompt's "
                            "logits do not depend on how it is chunked or batched; prefill of Q5_0 / Q8_0 "
                            "weights about 2x faster; last bits differ from llama.cpp's (default: llama.cpp's "
                            "kernel choice per batch size, its bits on this CPU)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
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


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding options, named as llama.cpp's."""
    g = p.add_argument_group("speculative decoding (lossless: at temperature 0 the text of --batch-invariant "
                             "decoding, which it computes in; the same distribution when sampling)")
    g.add_argument("--spec-type", default=None, metavar="TYPE",
                   help="none, ngram (prompt lookup: drafts what followed the last few tokens earlier in "
                        "the prompt or answer; fast when the answer repeats the prompt) or draft (a draft "
                        "model, -md); llama.cpp's ngram-simple and draft-simple are accepted; default: draft "
                        "with -md, else none")
    g.add_argument("-md", "--model-draft", default=None, metavar="MODEL",
                   help="draft model (a name or .gguf path) with the same vocabulary as -m")
    g.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=None,
                   help="most tokens drafted per step (default: 16)")
    g.add_argument("--draft-min", "--draft-n-min", dest="draft_min", type=int, default=None,
                   help="fewer drafted tokens than this are not verified (default: 0)")
    g.add_argument("--draft-p-min", type=float, default=None,
                   help="a draft model stops drafting below this probability of its best token "
                        "(default: 0.75)")


def spec_params(args):
    """SpecParams from add_spec_args's options (ValueError naming the option); a note on stderr
    when --draft-* options are given without speculative decoding."""
    from edge.speculative import SpecParams

    spec_type = args.spec_type or ("draft" if args.model_draft else "none")
    given = {k: v for k, v in (("draft_max", args.draft_max), ("draft_min", args.draft_min),
                               ("draft_p_min", args.draft_p_min)) if v is not None}
    params = SpecParams(spec_type, **given)
    if params.spec_type == "draft" and not args.model_draft:
        raise ValueError("--spec-type draft needs a draft model: -md/--model-draft MODEL")
    if args.model_draft and params.spec_type != "draft":
        raise ValueError(f"-md/--model-draft is for --spec-type draft, not {params.spec_type}")
    if given and not params.enabled:
        print(f"note: {', '.join('--' + k.replace('_', '-') for k in given)} ignored: speculative decoding is "
              "off (--spec-type ngram, or -md MODEL)", file=sys.stderr)
    if params.enabled and getattr(args, "batch_size", 2) < 2:
        raise ValueError("speculative decoding needs -b/--batch-size 2 or more: a verification is one batch of "
                         "the last token and its drafts")
    return params


def set_speculative(engine, args, params, n_seq: int = 1) -> None:
    """Speculative decoding on ``engine`` as the options ask (edge.engine.Engine.set_speculative;
    the draft model loaded with the target's n_ctx, n_batch and KV types). Raises ValueError
    for bad options or an incompatible draft model."""
    from edge.cli.models import resolve_with_bars
    from edge.engine import Engine

    if not params.enabled:
        return
    draft = None
    if params.spec_type == "draft":
        try:
            path = resolve_with_bars(args.model_draft)
        except Exception as e:
            raise ValueError(f"-md/--model-draft: {e}") from None
        draft = Engine(path, n_ctx=engine.n_ctx, n_batch=engine.n_batch,
                       n_seq=n_seq, cache_type_k=engine.cache_type_k, cache_type_v=engine.cache_type_v,
                       kv_storage=engine.kv_storage, batch_invariant=True)
    engine.set_speculative(params, draft)


def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_int_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(x) for x in text.split(","))


def set_threads(n: int | None) -> None:
    from edge.threads import use_threads

    asked = n is not None
    if n is None:
        n = physical_cores()
    if n < 1:
        raise ValueError(f"-t/--threads must be at least 1, got {n}")
    import numba

    if asked and n > numba.config.NUMBA_NUM_THREADS:   # llama.cpp runs what it is given; numba's pool is fixed
        print(f"note: -t {n}: numba's thread pool has {numba.config.NUMBA_NUM_THREADS} threads (NUMBA_NUM_THREADS, "
              f"default: this machine's CPUs); using {numba.config.NUMBA_NUM_THREADS}", file=sys.stderr)
    use_threads(n)


def kernels_compiled() -> bool:
    """True when numba's on-disk cache already holds edge's kernels (a kernel every forward
    pass runs has its cache index), so this run will not spend a minute compiling."""
    from kernels_cpu import ops

    try:
        return Path(ops._rms_norm_rows._cache._cache_file._index_path).is_file()
    except AttributeError:  # another numba version's cache layout: say nothing
        return True


LATER_COMPILE_NOTE = ("compiling kernels this command has not used before (once; later runs load them from "
                      "numba's cache)")


@contextlib.contextmanager
def compile_notes(live: bool | None = None, stream=None, model_kernels: bool = False):
    """Say on stderr when numba starts compiling edge's kernels (edge.compile_watch), so that no
    command waits a minute in silence on a cold cache: one note line when the first compile
    starts; with ``live`` (default: ``stream`` is a terminal), that line counts the kernels
    compiled and the seconds, and ends "done" when the block ends. Nothing is printed when
    nothing is compiled. ``model_kernels``: the block runs a model (the note says how long the
    first compile of those takes). Yields the edge.compile_watch.CompileWatch."""
    from edge.compile_watch import CompileWatch

    stream = stream or sys.stderr
    live = is_terminal(stream) if live is None else live
    first = not kernels_compiled()
    note = ("compiling kernels (first run only" + (": about a minute on 2 cores" if model_kernels else "")
            + "; later runs load them from numba's cache)") if first else LATER_COMPILE_NOTE
    short = "compiling kernels (first run only)" if first else "compiling new kernels"
    lock = threading.Lock()
    done = threading.Event()

    def line(final: bool = False) -> None:
        with lock:
            state = f"done: {watch.count} in {watch.seconds:.0f} s" if final else \
                f"{watch.count} compiled, {watch.seconds:.0f} s"
            stream.write(f"\r\x1b[K{short}... {state}" + ("\n" if final else ""))
            stream.flush()

    def tick() -> None:
        while not done.wait(1.0):
            line()

    def on_first() -> None:
        if live:
            line()
            threading.Thread(target=tick, name="compile-notes", daemon=True).start()
        else:
            with lock:
                print(f"note: {note}...", file=stream, flush=True)

    watch = CompileWatch(on_first, (lambda n, name: line()) if live else None)
    finished = False
    try:
        with watch:
            yield watch
        finished = True
    finally:
        done.set()
        if live and watch.started is not None:
            if finished:
                line(final=True)
            else:                   # Ctrl+C or an error: the count's line ends, not "done"
                with lock:
                    stream.write("\n")
                    stream.flush()


def is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal (False for None, a closed or a pseudo file)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def check_output_file(out: str | Path, flag: str, replaceable: Callable[[Path], bool], kind: str,
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


def load_engine(args):
    from edge.engine import Engine
    from edge.cli.models import resolve_with_bars

    set_threads(args.threads)
    check_sizes(args)
    path = resolve_with_bars(args.model)
    engine = Engine(path, n_ctx=args.ctx_size, n_batch=args.batch_size,
                    cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                    batch_invariant=args.batch_invariant)
    if args.ctx_size > engine.model.args.n_ctx_train:
        print(f"warning: -c {args.ctx_size} is more than the {engine.model.args.n_ctx_train} tokens "
              f"{engine.name} was trained on; quality drops past that", file=sys.stderr)
    return engine


SAMPLING_FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                   "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
                   "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                   "seed": "-s/--seed"}


def sampling_fields(args) -> dict:
    """SamplingParams fields from the options of add_sampling_args."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=None if args.seed < 0 else args.seed)


@contextlib.contextmanager
def naming_flags():
    """An InvalidParameter from SamplingParams becomes a ValueError naming the flag the user typed."""
    from edge.sampling import InvalidParameter

    try:
        yield
    except InvalidParameter as e:
        raise ValueError(f"{SAMPLING_FLAGS.get(e.param, e.param)} must be {e.rule}, got {e.value!r}") from None


def check_sizes(args) -> None:
    for flag, value in (("-c/--ctx-size", args.ctx_size), ("-b/--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
