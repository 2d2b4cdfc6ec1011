"""`edge perplexity` (with --kl-divergence-base / --kl-divergence) and `edge imatrix`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from edge.cli.options import add_model_args, check_output_file, load_engine


def add_parsers(sub) -> None:
    """The perplexity and imatrix subcommands."""
    ppl = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama-perplexity's method)")
    add_model_args(ppl, ctx_default=512)
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
    add_model_args(imx, ctx_default=512)
    imx.add_argument("-f", "--file", required=True, help="calibration text file")
    imx.add_argument("-o", "--output", default="imatrix.gguf", help="file to write (default: imatrix.gguf)")
    imx.add_argument("--chunks", type=int, default=-1, help="process at most this many chunks, -1 = all (default: -1)")
    imx.add_argument("--process-output", action="store_true", help="collect output.weight too")
    imx.set_defaults(func=cmd_imatrix)


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
    engine = load_engine(args)
    if args.kl_divergence_base:
        check_output_file(args.kl_divergence_base, "--kl-divergence-base",
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
    engine = load_engine(args)
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
    engine = load_engine(args)
    check_output_file(out, "-o", _is_imatrix, "an imatrix file", model=str(engine.path), text=args.file)
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


def _is_imatrix(path: Path) -> bool:
    from edge.imatrix import ImatrixError, load_imatrix

    try:
        load_imatrix(path)
        return True
    except ImatrixError:
        return False
