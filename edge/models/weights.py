"""The tensors of a model: what an architecture declares it reads, and how they are loaded.

An architecture lists its tensors (:class:`Tensor`: GGUF name, shape written in ModelArgs
fields, required or not), as llama.cpp's load_tensors does with create_tensor. The loader
(:func:`load_tensors`) holds the file to that list: a missing required tensor, a tensor whose
shape is not the one the metadata gives, or a tensor no part of the architecture reads is a
GGUFError naming it (llama.cpp refuses all three). Matrices stay in their GGML block formats
inside the memory-mapped file (:class:`Weight`); 1-D tensors (norms, biases) are read as
float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs
from kernels_cpu.dequant import dequantize, dequantize_rows
from kernels_cpu.matmul import matmul


class Weight:
    """A 2-D weight matrix kept in its GGML block format (zero-copy view of the file).

    ``rows`` is uint8[n_out, row_bytes]; calling it computes ``x @ W.T``: x f32[T, n_in]
    -> f32[T, n_out], through kernels_cpu.matmul (activations quantized as llama.cpp does).
    ``observer`` (default None) is called as observer(name, x) before each product: the
    activations an importance matrix is made of (edge.imatrix; ggml's eval callback).
    """

    __slots__ = ("name", "ggml_type", "rows", "n_in", "n_out", "batch_invariant", "observer")

    def __init__(self, gf: GGUFFile, name: str, n_in: int, n_out: int, rows: np.ndarray | None = None):
        self.name = name
        self.ggml_type = gf.tensors[name].ggml_type
        self.rows = gf.tensor_rows(name) if rows is None else rows
        self.n_in, self.n_out = n_in, n_out
        self.batch_invariant = False   # see Transformer.set_batch_invariant
        self.observer = None           # see Transformer.set_observer

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None, xq=None, workspace=None) -> np.ndarray:
        """x f32[T, n_in] -> out f32[T, n_out] (kernels_cpu.matmul.matmul: ``xq`` x already
        quantized for a weight of the same activation format, ``workspace`` its buffers)."""
        if self.observer is not None:
            self.observer(self.name, x)
        return matmul(self.rows, self.ggml_type, x, out, workspace, xq, self.batch_invariant)

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows ``ids`` (embedding lookup, ggml_get_rows): f32[len(ids), n_in]."""
        out = np.empty((len(ids), self.n_in), dtype=np.float32)
        return dequantize_rows(self.rows, self.ggml_type, np.asarray(ids, dtype=np.int64), out)


class ExpertWeights:
    """A 3-D tensor of expert matrices (``ffn_up_exps``: ggml [n_in, n_out, n_expert]) in its GGML
    block format: ``experts[e]`` is expert e's matrix as a :class:`Weight`, a zero-copy view of
    its n_out rows (ggml_mul_mat_id reads the same slice, src0->data + e * nb02)."""

    __slots__ = ("name", "ggml_type", "n_in", "n_out", "experts")

    def __init__(self, gf: GGUFFile, name: str, n_in: int, n_out: int, n_expert: int):
        rows = gf.tensor_rows(name)                                        # [n_expert * n_out, row_bytes]
        self.name, self.ggml_type, self.n_in, self.n_out = name, gf.tensors[name].ggml_type, n_in, n_out
        self.experts = [Weight(gf, name, n_in, n_out, rows[e * n_out:(e + 1) * n_out]) for e in range(n_expert)]


@dataclass(frozen=True)
class Tensor:
    """A tensor an architecture reads.

    ``name``: its GGUF name, without the ``blk.N.`` prefix for a layer's tensors; the model
    or block attribute it becomes is the name without ``.weight``, dots as underscores
    (``attn_q.weight``: attn_q, ``attn_q.bias``: attn_q_bias). ``shape``: ggml order
    ([n_in, n_out] for a matrix), each dimension a ModelArgs expression (ModelArgs.dim).
    ``required``: False when a file may lack it (the attribute is then None).
    """

    name: str
    shape: tuple[str, ...]
    required: bool = True

    @property
    def attr(self) -> str:
        return self.name.removesuffix(".weight").replace(".", "_")


def tensor(name: str, *shape: str, required: bool = True) -> Tensor:
    """Tensor(name, shape, required), written as a declaration reads."""
    return Tensor(name, shape, required)


def optional(name: str, *shape: str) -> Tensor:
    """A tensor a file may lack."""
    return Tensor(name, shape, required=False)


def load_tensors(gf: GGUFFile, args: ModelArgs, model: list[Tensor], layer: list[Tensor]) -> tuple[dict, list[dict]]:
    """The tensors ``model`` and ``layer`` (for every blk.N, N < args.n_layer) declare, as
    ({attribute: value} of the model, one such dict per layer): a :class:`Weight` per matrix,
    an :class:`ExpertWeights` per 3-D tensor, float32[n] per 1-D tensor, None for an absent
    optional one.

    Matrices are checked before 1-D tensors, each kind in declaration order, the model's before
    the layers'. Raises GGUFError naming a missing required tensor, one whose shape is not the
    declared one (with the metadata keys that give it), or the tensors no declaration reads.
    """
    used: set[str] = set()
    dims = {t: [args.dim(d) for d in t.shape] for t in [*model, *layer]}

    def take(t: Tensor, name: str):
        info = gf.tensors.get(name)
        if info is None:
            if t.required:
                raise GGUFError(f"{gf.path}: required tensor {name!r} is missing")
            return None
        want = tuple(n for _, n in dims[t])
        shape = tuple(info.shape)
        if shape[:len(want)] != want or any(n != 1 for n in shape[len(want):]):
            raise GGUFError(f"{gf.path}: tensor {name!r} has shape {list(shape)}, but the metadata "
                            f"gives [{', '.join(text for text, _ in dims[t])}]")
        used.add(name)
        if len(want) == 3:
            return ExpertWeights(gf, name, *want)
        if len(want) == 2:
            return Weight(gf, name, *want)
        if info.ggml_type == GGMLQuantizationType.F32:
            return gf.tensor_f32(name).reshape(want)
        return dequantize(gf.tensor_bytes(name), info.ggml_type).reshape(want)

    # matrices first: their shapes name most keys, so a wrong key is named where it shows most
    entries = [(t, t.name, None) for t in model] + \
        [(t, f"blk.{il}.{t.name}", il) for il in range(args.n_layer) for t in layer]
    top: dict = {}
    layers: list[dict] = [{} for _ in range(args.n_layer)]
    for t, name, il in sorted(entries, key=lambda e: len(e[0].shape) == 1):   # stable: 2-D and 3-D first
        (top if il is None else layers[il])[t.attr] = take(t, name)
    extra = [n for n in gf.tensors if n not in used]
    if extra:
        shown = ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
        raise GGUFError(f"{gf.path}: {len(extra)} tensors are not used by the "
                        f"{args.arch} architecture: {shown}")
    return top, layers
