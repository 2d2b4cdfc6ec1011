"""``edge quantize``: convert a GGUF file to a quantization mix, byte for byte as llama-quantize.

Mirrors ``llama_model_quantize_impl`` of llama.cpp 0c1e57098 (``src/llama-quant.cpp``), with an
optional importance matrix (llama-quantize --imatrix; edge.imatrix.load_imatrix). The output file:

- KV pairs: the source's, in source order, without ``general.quantization_version``,
  ``general.file_type`` and the ``split.*`` keys, then those two appended as uint32
  (quantization version 2, the llama_ftype of the mix): llama.cpp's gguf_set_val_* removes a key
  and pushes it back. With an imatrix, then ``quantize.imatrix.file`` (the path as given, cut
  to 127 bytes), ``quantize.imatrix.dataset`` (its first dataset, cut to 127 bytes, if any),
  ``quantize.imatrix.entries_count`` and ``quantize.imatrix.chunks_count`` (uint32, the latter
  when > 0): llama-quantize's KV overrides.
- Tensor infos in llama_model_loader order (quant.mix.llama_order) with ``ggml_n_dims``
  dimensions; offsets are the running sum of the tensor sizes padded to 32 bytes.
- Alignment 32 for the header and every tensor, always (llama-quant pads with
  GGUF_DEFAULT_ALIGNMENT). A source ``general.alignment`` key is dropped: llama.cpp copies it,
  which makes a file whose data does not sit where its own header says.
- Tensor data: copied when the type does not change, else converted to float32 (F16/BF16
  widened, quantized sources dequantized by kernels_cpu.dequant: ggml's to_float) and quantized
  by quant.quantize.quantize_rows (ggml_quantize_chunk), a slab of rows at a time, with the
  tensor's imatrix weights (in_sum2 / counts) when the imatrix has an entry for it.

The file is written to a temporary file beside the output, fsynced, then renamed over it
(edge.files.atomic_write; a killed run's temporary file is removed by the next run): an
error or Ctrl+C leaves neither a partial output nor the temporary file, and an existing output
is untouched until the new one is complete. The source is memory-mapped; memory use is bounded
by one slab (:data:`SLAB_BYTES` of float32 values) whatever the model size.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys

from edge.gguf_file import GGUFFile
from edge.imatrix import ImatrixError, ImatrixFile
from edge.files import atomic_write, remove_dead_temps
from edge.files import check_output_file, file_starts_with
from kernels_cpu.dequant import KERNELS as DEQUANT_KERNELS
from kernels_cpu.dequant import dequantize
from kernels_cpu.ggml_types import TYPES
from quant.quantize import SUPPORTED_TYPES, QuantizeError, quantize_rows
from quant.mix import FileType, ModelParams, QuantizeOptions, TensorChoice, check_writable, choose_types, n_dims

V = GGUFValueType
ALIGNMENT = 32                       # GGUF_DEFAULT_ALIGNMENT, llama-quant's `align`
SLAB_BYTES = 64 << 20                # float32 bytes of source rows converted at a time
_DROPPED_KEYS = (Keys.General.QUANTIZATION_VERSION, Keys.General.FILE_TYPE, Keys.General.ALIGNMENT,
                 Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
_SCALAR_BYTES = {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
                 V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}

ProgressCallback = Callable[[int, int, TensorChoice], None]


def _pad(n: int) -> int:
    return -n % ALIGNMENT


@dataclass
class QuantizePlan:
    """What :func:`quantize_file` writes, computed without converting anything.

    source: the open source file; tensors: the output tensors in file order with their types;
    imatrix: the importance matrix the tensors are quantized with (None: without);
    metadata: the output KV pairs as (key, value, value type, array element type), values in
    the form gguf.GGUFWriter packs (strings as UTF-8 bytes, arrays as lists);
    header_bytes: size of the header (KV pairs, tensor infos, padding); output_size: size of
    the whole output file in bytes.
    """

    source: GGUFFile
    ftype: FileType
    options: QuantizeOptions
    tensors: list[TensorChoice]
    metadata: list[tuple[str, object, GGUFValueType, GGUFValueType | None]]
    header_bytes: int
    imatrix: ImatrixFile | None = None

    @property
    def source_size(self) -> int:
        return self.source.file_size

    @property
    def output_size(self) -> int:
        return self.header_bytes + sum(t.new_bytes + _pad(t.new_bytes) for t in self.tensors)

    @property
    def n_values(self) -> int:
        return sum(t.n_values for t in self.tensors)


def _writer_value(key: str, field) -> tuple[object, int]:
    """A source KV value in the form GGUFWriter packs, and its size in bytes in the file."""
    v, vtype, atype = field.value, field.value_type, field.array_type
    if vtype == V.STRING:
        b = v.encode("utf-8", "surrogateescape")
        return b, 8 + len(b)
    if vtype != V.ARRAY:
        return v, _SCALAR_BYTES[vtype]
    if len(v) == 0 or atype == V.ARRAY:
        what = "an empty array" if len(v) == 0 else "an array of arrays"
        raise QuantizeError(f"metadata key {key!r} holds {what}, which edge cannot write")
    if atype == V.STRING:
        items = [s.encode("utf-8", "surrogateescape") for s in v]
        return items, 12 + sum(8 + len(s) for s in items)
    return np.asarray(v).tolist(), 12 + len(v) * _SCALAR_BYTES[atype]


def _imatrix_metadata(imatrix: ImatrixFile) -> list[tuple[str, object, GGUFValueType, None]]:
    """llama-quantize's KV overrides for an imatrix (tools/quantize/quantize.cpp)."""
    out = [("quantize.imatrix.file", imatrix.path.encode("utf-8", "surrogateescape")[:127], V.STRING, None)]
    if imatrix.datasets:
        out.append(("quantize.imatrix.dataset", imatrix.datasets[0].encode("utf-8", "surrogateescape")[:127],
                    V.STRING, None))
    out.append(("quantize.imatrix.entries_count", len(imatrix.weights), V.UINT32, None))
    if imatrix.chunk_count > 0:
        out.append(("quantize.imatrix.chunks_count", imatrix.chunk_count, V.UINT32, None))
    return out


def _check_imatrix(imatrix: ImatrixFile, tensors: list[TensorChoice]) -> None:
    """llama-quant: an entry whose size is not the tensor's row length (times its experts) is
    an error, except for the token embeddings (quantized without); checked before writing.
    Also an error (llama-quantize would quantize as without one, silently): an imatrix with no
    entries, or none for any tensor that is converted."""
    if not imatrix.weights:
        raise ImatrixError(f"{imatrix.path} has no entries (made from batches of fewer than 16 tokens?): "
                           "quantizing with it would be quantizing without one")
    if not any(t.converts and t.name in imatrix.weights for t in tensors):
        raise ImatrixError(f"{imatrix.path}: none of its {len(imatrix.weights)} entries names a tensor this "
                           "quantization converts (an imatrix of another model?)")
    for t in tensors:
        w = imatrix.weights.get(t.name)
        n = t.shape[0] * (t.shape[2] if len(t.shape) > 2 else 1)
        if t.converts and w is not None and w.size != n and t.name != "token_embd.weight":
            raise ImatrixError(f"{imatrix.path}: the entry for {t.name} has {w.size} values, the tensor "
                               f"needs {n} (an imatrix of another model?)")
        if t.converts and w is not None and w.size == n != t.shape[0]:
            raise ImatrixError(f"{imatrix.path}: {t.name} has {n // t.shape[0]} experts; edge cannot yet "
                               "quantize per-expert slices with an imatrix")


def plan_quantize(src: str | os.PathLike, ftype: FileType, options: QuantizeOptions,
                  imatrix: ImatrixFile | None = None) -> QuantizePlan:
    """Open ``src`` and decide every output tensor's type, the output KV pairs and the sizes.
    With ``imatrix`` (edge.imatrix.load_imatrix), the types llama.cpp chooses when it has one
    and its metadata keys.

    Raises GGUFError (malformed source or missing hyperparameters), OSError (cannot open),
    QuantizeError (an option that cannot apply, a quantized tensor without allow_requantize, a
    source type edge cannot dequantize, metadata edge cannot write), ImatrixError (an entry
    whose size does not match its tensor).
    """
    if imatrix is not None:
        options = replace(options, has_imatrix=True)
    gf = GGUFFile(src)
    model = ModelParams.from_gguf(gf)
    tensors = choose_types([(t.name, t.shape, t.ggml_type) for t in gf.tensors.values()], ftype, options, model)
    for t in tensors:
        if t.converts and t.src_type not in DEQUANT_KERNELS:
            raise QuantizeError(f"tensor {t.name}: cannot convert from {t.src_type.name} (edge has no "
                                f"dequantizer for it) to {t.new_type.name}")
    metadata, size = [], 24                       # magic, version, tensor count, KV count
    for key, field in gf.fields.items():
        if key in _DROPPED_KEYS:
            continue
        value, n = _writer_value(key, field)
        metadata.append((key, value, field.value_type, field.array_type))
        size += 8 + len(key.encode("utf-8", "surrogateescape")) + 4 + n
    for key, value in ((Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION),
                       (Keys.General.FILE_TYPE, ftype.file_type)):
        metadata.append((key, value, V.UINT32, None))
        size += 8 + len(key) + 4 + 4
    if imatrix is not None:
        _check_imatrix(imatrix, tensors)
        for key, value, vtype, _ in _imatrix_metadata(imatrix):
            metadata.append((key, value, vtype, None))
            size += 8 + len(key) + 4 + (8 + len(value) if vtype == V.STRING else 4)
    for t in tensors:
        size += 8 + len(t.name.encode("utf-8", "surrogateescape")) + 4 + 8 * n_dims(t.shape) + 4 + 8
    return QuantizePlan(gf, ftype, options, tensors, metadata, size + _pad(size), imatrix)


def check_output_path(src: str | os.PathLike, dst: str | os.PathLike, imatrix: str | os.PathLike | None = None) -> None:
    """QuantizeError when ``dst`` cannot be the output of quantizing ``src``: a directory, in a
    missing or unwritable folder, the source or the imatrix file itself (also through links),
    an existing device or FIFO, or an existing file that is not a GGUF (a model replaces only a
    model: a typo must not turn a text into one)."""
    check_output_file(dst, "", {"input": src, "--imatrix": imatrix}, QuantizeError)
    dst = Path(dst)
    if dst.exists() and dst.stat().st_size and not file_starts_with(dst, b"GGUF"):
        raise QuantizeError(f"{dst} exists and is not a GGUF file; edge quantize replaces only such a "
                            "file: remove it or give another path")


def _to_f32(rows: np.ndarray, t: GGMLQuantizationType) -> np.ndarray:
    """Source rows (uint8[R, row_bytes]) as float32[R, K]: F32 viewed, others dequantized."""
    if t == GGMLQuantizationType.F32:
        return rows.view(np.float32)
    return dequantize(np.ascontiguousarray(rows), t)


def _check_values(t: TensorChoice, x: np.ndarray, row0: int) -> None:
    """BUGS.md Q1: NaN or Inf in the source is an error naming the tensor and row."""
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        r = row0 + int(np.argmin(finite))
        raise QuantizeError(f"tensor {t.name} holds NaN or Inf (row {r}); cannot convert it to {t.new_type.name}")


def _check_scales(t: TensorChoice, q: np.ndarray, row0: int) -> None:
    """ggml_validate_row_data on converted rows: no NaN/Inf values (F16, BF16, F32) or fp16
    scales (block types). Finite inputs can still overflow: |x| > 65504 in F16, or a block
    whose scale exceeds the fp16 range."""
    name = t.new_type.name
    row = TYPES.get(t.new_type)
    if row is not None and row.quantized:  # the block's f16 scales (d, and m / dmin where it has one)
        offsets = row.f16_scales
        blocks = q.reshape(q.shape[0], -1, row.type_size)
        halves = np.stack([blocks[:, :, o] | (blocks[:, :, o + 1].astype(np.uint16) << 8) for o in offsets])
        bad = ((halves & 0x7C00) == 0x7C00).any(axis=(0, 2))
    elif name in ("F16", "BF16"):
        exp = 0x7C00 if name == "F16" else 0x7F80
        bad = ((q.view(np.uint16) & exp) == exp).any(axis=1)
    else:
        bad = ~np.isfinite(q.view(np.float32)).all(axis=1)
    if bad.any():
        r = row0 + int(np.argmax(bad))
        raise QuantizeError(f"tensor {t.name}: row {r} does not fit {name} (values beyond the range of its "
                            "fp16 scales or values); keep this tensor in a wider type")


def _write_tensor(plan: QuantizePlan, t: TensorChoice, fout) -> Iterator[int]:
    """Write one tensor's data (copied or converted) and its padding to ``fout``, a slab of rows
    at a time; yields the number of values of each slab written."""
    rows = plan.source.tensor_rows(t.name)
    k = t.shape[0]
    weights = None
    if plan.imatrix is not None and t.name in plan.imatrix.weights:
        weights = plan.imatrix.weights[t.name]
        weights = weights if weights.size == k else None      # token_embd of another size: without
    step = max(1, SLAB_BYTES // (4 * k))
    for r in range(0, t.n_rows, step):
        slab = rows[r : r + step]
        if not t.converts:
            fout.write(memoryview(slab).cast("B"))
        else:
            x = _to_f32(slab, t.src_type)
            _check_values(t, x, r)
            q = quantize_rows(t.new_type, x, weights)
            _check_scales(t, q, r)
            fout.write(memoryview(q).cast("B"))
        yield len(slab) * k
    fout.write(bytes(_pad(t.new_bytes)))


def quantize_file(src: str | os.PathLike, dst: str | os.PathLike, ftype: FileType,
                  options: QuantizeOptions = QuantizeOptions(),
                  progress: ProgressCallback | None = None, imatrix: ImatrixFile | None = None) -> QuantizePlan:
    """Quantize GGUF ``src`` into ``dst`` as llama-quantize does (same bytes); return the plan.
    ``imatrix``: quantize with these importance weights (llama-quantize --imatrix).

    ``progress(done, total, tensor)`` is called as the work advances: ``done`` and ``total``
    count tensor values (all tensors), ``tensor`` is the one being written. Threads: those of
    numba (numba.set_num_threads).

    Raises QuantizeError (see :func:`plan_quantize` and quant.mix.check_writable: a mix that
    needs an imatrix or a type edge cannot write yet; ``dst`` is a directory, in a missing
    folder, or the source itself; not enough disk space; NaN/Inf in a tensor being converted or
    values that overflow the new type), GGUFError, OSError. On any error or KeyboardInterrupt
    no output and no temporary file are left, and an existing ``dst`` is unchanged.
    """
    check_output_path(src, dst, imatrix.path if imatrix is not None else None)   # before Path() drops a trailing /
    src, dst = Path(src), Path(dst)
    plan = plan_quantize(src, ftype, options, imatrix)
    check_writable(plan.tensors, ftype, None if imatrix is None else imatrix.weights, SUPPORTED_TYPES)
    remove_dead_temps(dst.parent, dst.name)       # a killed run's file: its space counts below
    free = shutil.disk_usage(dst.parent).free
    if free < plan.output_size:
        raise QuantizeError(f"not enough disk space in {dst.parent}: the output needs {plan.output_size:,} bytes, "
                            f"{free:,} are free" + (" (a pseudo file system such as /sys or /proc?)" if free == 0 else ""))
    with atomic_write(dst) as tmp:
        writer = GGUFWriter(None, plan.source.architecture)
        try:
            writer.kv_data[0].clear()                 # the constructor's general.architecture: source order instead
            for key, value, vtype, atype in plan.metadata:
                writer.add_key_value(key, value, vtype, sub_type=atype)
            for t in plan.tensors:
                shape = tuple(reversed(t.shape[:n_dims(t.shape)]))     # numpy order, trailing 1s dropped
                writer.add_tensor_info(t.name, shape, np.dtype(np.float32), t.new_bytes, raw_dtype=t.new_type)
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            fout = writer.fout[0]
            fout.write(bytes(_pad(fout.tell())))
            done, total = 0, plan.n_values
            for t in plan.tensors:
                if progress is not None:
                    progress(done, total, t)
                for n in _write_tensor(plan, t, fout):
                    done += n
                    if progress is not None:
                        progress(done, total, t)
            fout.flush()
            if fout.tell() != plan.output_size:
                raise QuantizeError(f"internal error: wrote {fout.tell():,} bytes, planned {plan.output_size:,}")
        finally:
            writer.close()
    return plan
