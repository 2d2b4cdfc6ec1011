"""Importance matrix (llama.cpp tools/imatrix, llama-imatrix) and its GGUF file.

compute_imatrix runs the model over a text as llama-imatrix does: the text is tokenized with
BOS (add_special), cut into n_chunks = n_tokens // n_ctx chunks of n_ctx tokens, each chunk
evaluated alone from an empty KV cache with its first token replaced by BOS (when the model adds
one), in batches of n_batch tokens, with every row through every layer (llama-imatrix computes
all logits, so its last layer sees every row; edge computes the last layer for all rows but the
logits only when output.weight is collected, with process_output). For every matrix product
whose weight is named ``blk.*`` (or is ``output.weight`` with process_output) and whose
activation batch has at least 16 rows, the squares of the activations are summed per input column in float32, row after row
(``values[j] += x[j]*x[j]``), and the rows counted (IMatrixCollector::collect_imatrix).

The file (IMatrixCollector::save_imatrix, GGUF): tensors sorted by name, per weight W
``W.in_sum2`` F32 [n_in] (the sums) and ``W.counts`` F32 [1] (the rows: ggml [n_in, 1] and [1, 1]
stored with ggml_n_dims dimensions); KV
``general.type`` = "imatrix", ``imatrix.datasets`` (array of str: the text file),
``imatrix.chunk_count`` (u32), ``imatrix.chunk_size`` (u32, n_ctx). Written to a temporary
file and renamed. load_imatrix reads such a file back as the quantizer weights in_sum2 / counts
(common/imatrix-loader.cpp, llama-quantize's load_imatrix).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from edge.files import atomic_write
from edge.generate import forward

MIN_ROWS = 16  # llama-imatrix ignores products of fewer activation rows


class ImatrixError(ValueError):
    """An imatrix file that cannot be read or used; the message names the file and the fault."""


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _add_squares(x, acc):
    """acc[j] += x[r, j] * x[r, j] for r = 0, 1, ... in float32 (one column per thread, rows in
    order, as llama-imatrix's loop). x f32[R, K] (rows may be strided), acc f32[K]."""
    for j in prange(x.shape[1]):
        s = acc[j]
        for r in range(x.shape[0]):
            s += x[r, j] * x[r, j]
        acc[j] = s


@dataclass
class Imatrix:
    """Collected statistics: per weight name, ``sums`` f32[n_in] (sum of x*x per input column)
    and ``counts`` (activation rows seen); ``chunk_count``, ``chunk_size`` (n_ctx) and the
    ``datasets`` (text files) as the file stores them."""

    chunk_size: int
    datasets: list[str] = field(default_factory=list)
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    process_output: bool = False

    @property
    def chunk_count(self) -> int:
        """llama-imatrix's m_last_chunk: the largest count // chunk_size."""
        return max((c // self.chunk_size for c in self.counts.values()), default=0)

    def observe(self, name: str, x: np.ndarray) -> None:
        """Transformer observer: add the activations x f32[T, n_in] of weight ``name``."""
        if x.shape[0] < MIN_ROWS or not (name.startswith("blk.") or
                                         (self.process_output and name == "output.weight")):
            return
        acc = self.sums.get(name)
        if acc is None:
            acc = self.sums[name] = np.zeros(x.shape[1], np.float32)
            self.counts[name] = 0
        _add_squares(x, acc)
        if not np.isfinite(acc).all():
            raise ImatrixError(f"non-finite activation sums in {name}")
        self.counts[name] += x.shape[0]


def compute_imatrix(engine, text: str, n_ctx: int, n_batch: int | None = None, max_chunks: int = -1,
                    process_output: bool = False, dataset: str = "",
                    on_chunk: Callable[[int, int], None] | None = None) -> Imatrix:
    """The importance matrix of ``engine``'s model over ``text`` (llama-imatrix's compute_imatrix).

    n_ctx: tokens per chunk; n_batch: tokens per forward call (default n_ctx, at most n_ctx);
    max_chunks: at most this many chunks (-1: all); process_output: collect output.weight too;
    dataset: the text's file name recorded in the file; on_chunk(i, n_chunks) after each chunk.
    Raises ValueError when the text has fewer than 2 * n_ctx tokens (as llama-imatrix) or for
    n_ctx < 1, n_batch < 1, max_chunks 0 or below -1.
    """
    if n_ctx < 1:
        raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
    n_batch = n_ctx if n_batch is None else min(n_batch, n_ctx)
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    if max_chunks == 0 or max_chunks < -1:
        raise ValueError(f"the number of chunks must be -1 (all) or at least 1, got {max_chunks}")
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True, parse_special=False)
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; an imatrix with n_ctx = {n_ctx} "
                         f"needs at least {2 * n_ctx}")
    n_chunks = len(tokens) // n_ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    result = Imatrix(chunk_size=n_ctx, datasets=[dataset] if dataset else [], process_output=process_output)
    model = engine.model
    model.set_observer(result.observe)
    try:
        for c in range(n_chunks):
            chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
            if tok.add_bos:
                chunk[0] = tok.bos_id
            cache = model.new_cache(n_ctx)
            for b in range(0, n_ctx, n_batch):
                forward(model, chunk[b:b + n_batch], cache, engine.threads,
                        logits_rows=slice(None) if process_output else slice(0, 0), prune_last_layer=False)
            if on_chunk is not None:
                on_chunk(c + 1, n_chunks)
    finally:
        model.set_observer(None)
    return result


def write_imatrix(path: str | os.PathLike, imatrix: Imatrix) -> None:
    """Write ``imatrix`` as llama-imatrix's GGUF file at ``path``, atomically (a temporary file
    in the same folder, fsynced and renamed: edge.files.atomic_write; on any error nothing is
    left)."""
    from gguf import GGUFWriter

    with atomic_write(path) as tmp:
        writer = GGUFWriter(tmp, arch="")
        try:
            writer.kv_data[0].clear()      # no general.architecture: llama-imatrix writes none
            writer.add_string("general.type", "imatrix")
            writer.add_array("imatrix.datasets", list(imatrix.datasets))
            writer.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
            writer.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
            for name in sorted(imatrix.sums):
                # ggml [n_in, 1] and [1, 1]: the file stores their ggml_n_dims, 1 dimension each
                writer.add_tensor(f"{name}.in_sum2", imatrix.sums[name].reshape(-1))
                writer.add_tensor(f"{name}.counts", np.array([imatrix.counts[name]], np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


@dataclass
class ImatrixFile:
    """An imatrix read for quantization: ``weights`` per tensor name f32[n_in * n_mat]
    (in_sum2 / counts, 1.0 where a count is 0), the first dataset and the chunk count."""

    path: str
    weights: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int


def load_imatrix(path: str | os.PathLike) -> ImatrixFile:
    """Read a GGUF imatrix file (common/imatrix-loader.cpp): pairs W.in_sum2 F32 [n, n_mat] and
    W.counts F32 [1, n_mat], general.type "imatrix", imatrix.datasets / chunk_count /
    chunk_size. Weights = in_sum2[e*n + i] / round(counts[e]) (all 1.0 for a zero count).
    Raises ImatrixError naming the file for a missing or unreadable file, a GGUF file without
    the imatrix keys, an in_sum2 without its counts (or the reverse), wrong shapes or types,
    and non-finite values (llama-quantize refuses them too). The legacy .dat format is not read.
    """
    from gguf import GGMLQuantizationType, GGUFValueType

    from edge.gguf_file import GGUFError, GGUFFile
    from edge.files import file_starts_with

    try:
        gf = GGUFFile(path)
    except FileNotFoundError:
        raise ImatrixError(f"{path}: no such imatrix file") from None
    except (GGUFError, OSError) as e:
        legacy = "" if file_starts_with(path, b"GGUF") else "; the legacy .dat format is not supported"
        raise ImatrixError(f"{path}: cannot be read as a GGUF imatrix file ({e}){legacy}") from None
    try:
        if gf.get("general.type", None) != "imatrix" or any(
                gf.get(k, None) is None for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")):
            raise ImatrixError(f"{path}: a GGUF file but not an imatrix (general.type 'imatrix' and "
                               "imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size are required)")
        datasets = gf.get_array("imatrix.datasets", (GGUFValueType.STRING,))
        chunk_count = gf.get_int("imatrix.chunk_count")
        weights = {}
        names = set(gf.tensors)
        for tname in sorted(names):
            if not tname.endswith((".in_sum2", ".counts")):
                raise ImatrixError(f"{path}: unexpected tensor {tname!r} (only W.in_sum2 and W.counts)")
            base = tname.rsplit(".", 1)[0]
            if tname.endswith(".counts"):
                if base + ".in_sum2" not in names:
                    raise ImatrixError(f"{path}: {tname} has no {base}.in_sum2")
                continue
            if base + ".counts" not in names:
                raise ImatrixError(f"{path}: {tname} has no {base}.counts")
            sums_info, counts_info = gf.tensors[tname], gf.tensors[base + ".counts"]
            if GGMLQuantizationType.F32 not in (sums_info.ggml_type,) or counts_info.ggml_type != GGMLQuantizationType.F32:
                raise ImatrixError(f"{path}: {tname} and {base}.counts must be F32")
            n_mat = counts_info.n_elements          # ggml [1, n_mat]; a file stores [1] for one matrix
            if n_mat < 1 or sums_info.n_elements % n_mat or len(sums_info.shape) > 2 or len(counts_info.shape) > 2:
                raise ImatrixError(f"{path}: {tname} shape {list(sums_info.shape)} does not match "
                                   f"{base}.counts shape {list(counts_info.shape)}")
            sums = gf.tensor_f32(tname).reshape(n_mat, -1).astype(np.float32)
            counts = gf.tensor_f32(base + ".counts").reshape(n_mat)
            if not (np.isfinite(sums).all() and np.isfinite(counts).all()):
                raise ImatrixError(f"{path}: non-finite values in {base}")
            w = np.ones_like(sums)
            for e in range(n_mat):
                c = math.floor(float(counts[e]) + 0.5)  # lround
                if c > 0:
                    w[e] = sums[e] / np.float32(c)
            weights[base] = w.reshape(-1)
    finally:
        gf.close()
    return ImatrixFile(path=str(path), weights=weights, datasets=list(datasets), chunk_count=int(chunk_count))
