"""`edge quantize`: llama-quantize's mixes through quant.pipeline, with a progress bar; the
input is a path or a pulled model's name."""
from __future__ import annotations

import contextlib
import sys
import time

from edge.cli.options import set_threads

from quant.mix import FILE_TYPES  # loads no numba

QUANTIZE_TYPES = ", ".join(FILE_TYPES)  # the TYPEs of `edge quantize`


def add_parser(sub) -> None:
    """The quantize subcommand."""
    quant = sub.add_parser("quantize", help="quantize a GGUF file (llama-quantize's types, the same bytes)",
                           description="Convert IN.gguf (a path or a pulled model's name; F32/F16/BF16 weights) "
                                       "to the quantization mix TYPE "
                                       "as llama-quantize does (with --imatrix, weighted by it): the same tensor types and "
                                       "the same file bytes. OUT is written to a temporary file and renamed "
                                       "when complete. TYPE: " + QUANTIZE_TYPES + ".")
    quant.add_argument("input", metavar="IN.gguf",
                       help="source model: a .gguf path or a pulled model's name (edge list)")
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


def cmd_quantize(args) -> int:
    from quant.mix import QuantizeOptions, check_writable, parse_file_type, parse_tensor_type
    from quant.pipeline import check_output_path, plan_quantize, quantize_file
    from quant.quantize import SUPPORTED_TYPES, QuantizeError

    def tensor_type(value, flag):
        return None if value is None else parse_tensor_type(value, flag)

    from edge.imatrix import load_imatrix

    from edge.store import resolve_model

    ftype = parse_file_type(args.type)
    args.input = str(resolve_model(args.input, pull_missing=False))    # a store name too; never downloads
    imatrix = load_imatrix(args.imatrix) if args.imatrix is not None else None
    options = QuantizeOptions(
        pure=args.pure, leave_output_tensor=args.leave_output_tensor, allow_requantize=args.allow_requantize,
        output_tensor_type=tensor_type(args.output_tensor_type, "--output-tensor-type"),
        token_embedding_type=tensor_type(args.token_embedding_type, "--token-embedding-type"))
    if args.dry_run:
        check_output_path(args.input, args.output, args.imatrix)      # what the real run refuses (quantize_file)
        plan = plan_quantize(args.input, ftype, options, imatrix)
        _print_quantize_plan(plan)
        try:                                                            # say so if the real run would stop
            check_writable(plan.tensors, ftype, None if imatrix is None else imatrix.weights, SUPPORTED_TYPES)
        except QuantizeError as e:
            print(f"note: the real run would stop before writing: {e}", file=sys.stderr)
        return 0
    set_threads(args.threads)
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
