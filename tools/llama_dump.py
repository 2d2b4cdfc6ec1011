"""Dump llama.cpp's intermediate tensors while it evaluates a prompt and then decodes tokens.

A development tool: it needs llama-cpp-python (built from source, so that it computes exactly
what the llama.cpp that made the goldens computes) and is never imported by edge or its tests.
It installs a ggml scheduler eval callback (ggml_backend_sched_eval_callback) and copies every
requested F32/F16 tensor as the graph computes it.

    from llama_dump import dump
    steps = dump(model_path, prompt_ids, decode_ids=[t1, t2], names={"kq-0", "kqv-0"})

``steps`` is a list with one dict per llama_decode call (the prompt in one batch of
n_batch = len(prompt) or more, then one call per decode token): {graph tensor name: [arrays]},
one array per time the name was computed in that call, in numpy order (reversed ggml ne,
leading 1s squeezed). Tensor names are llama.cpp's graph callback names (``kq-0``,
``kq_soft_max-0``, ``Qcur-0``, ``cache_k_l0 (view)`` ...); names=None records nothing but
fills ``seen`` with every name and its ggml ne.

Command line (lists the names of one evaluation):
    python tools/llama_dump.py MODEL.gguf 1,2,3
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np


class _Tensor(ctypes.Structure):
    """The head of struct ggml_tensor (ggml.h) up to ``name``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


_DTYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16


def _read(t: _Tensor) -> np.ndarray:
    dt = np.dtype(_DTYPES[t.type])
    ne, nb = list(t.ne), list(t.nb)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + dt.itemsize
    buf = (ctypes.c_char * span).from_address(t.data)
    arr = np.ndarray(tuple(reversed(ne)), dtype=dt, buffer=buf, strides=tuple(reversed(nb))).copy()
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    return arr


def dump(model_path, prompt_ids, decode_ids=(), names=None, n_ctx=512, n_threads=2,
         n_batch=512, logits_all=True, seen=None):
    """Evaluate ``prompt_ids`` (n_batch tokens per llama_decode call), then each of ``decode_ids``
    alone; return (steps, logits). logits: float32[len(prompt)+len(decode), n_vocab] when
    logits_all, else the last row of every call."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaBatch, LlamaContext

    want = None if names is None else set(names)
    steps: list[dict] = []

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(tp, ask, user):
        t = _Tensor.from_address(tp)
        name = t.name.decode(errors="replace")
        if ask:
            if want is None:
                if seen is not None:
                    seen.setdefault(name, tuple(t.ne))
                return False
            return name in want
        if t.type in _DTYPES and t.data:
            steps[-1].setdefault(name, []).append(_read(t))
        return True

    llm = Llama(str(model_path), n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, n_ubatch=n_batch,
                logits_all=logits_all, verbose=False, flash_attn=False)
    llm.context_params.cb_eval = callback
    llm._ctx = LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    llm._batch = LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=llm.context_params.n_ctx, verbose=False)
    llm.reset()
    logits = []
    for chunk in [list(prompt_ids)] + [[int(t)] for t in decode_ids]:
        steps.append({})
        llm.eval(chunk)
        if logits_all:
            logits.append(np.array(llm.scores[llm.n_tokens - len(chunk): llm.n_tokens], dtype=np.float32))
        else:
            logits.append(np.array(llm.scores[llm.n_tokens - 1: llm.n_tokens], dtype=np.float32))
    return steps, np.concatenate(logits)


if __name__ == "__main__":
    seen: dict = {}
    dump(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], seen=seen)
    for k, v in seen.items():
        print(k, v)
