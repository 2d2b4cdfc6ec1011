"""The mixture-of-experts feed-forward (llama.cpp's build_moe_ffn, src/llama-graph.cpp), as
qwen3moe uses it: softmax router, top-k experts, normalised weights, SwiGLU experts.

Each expert's matrices run only on the rows routed to it, the batch grouped by expert as
ggml_mul_mat_id groups it (rows in token order within an expert); an expert's matrix is a view
of its slice of the 3-D tensor (edge.models.weights.ExpertWeights), multiplied with the same
kernels as a dense matrix of that many rows.
"""
from __future__ import annotations

import numpy as np

from edge.models.layers import Batch, ffn_swiglu
from edge.models.weights import ExpertWeights, Weight
from kernels_cpu import ops

# ggml_clamp's lower bound of the weights' sum in build_moe_ffn: the smallest normal f16
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


def route(logits: np.ndarray, n_used: int, norm: bool, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The experts of each row and their weights from the router's logits f32[R, n_expert]:
    probs = ggml_soft_max(logits) (into ``probs``, f32[R, n_expert]); the n_used experts of
    highest probability, best first (ggml_argsort_top_k: argsort descending; ties to the lower
    index here, std::sort's order there is unspecified); their probabilities as weights, with
    ``norm`` divided by their sum (ggml_sum_rows in float64, clamped to >= MIN_WEIGHT_SUM,
    ggml_div). Returns (selected int64[R, n_used], weights f32[R, n_used])."""
    ops.soft_max_rows(logits, probs)
    selected = np.argsort(-probs, axis=1, kind="stable")[:, :n_used]
    weights = np.take_along_axis(probs, selected, axis=1)
    if norm:
        total = np.zeros((len(weights), 1), np.float64)   # ggml_vec_sum_f32: float64, in order
        for j in range(n_used):
            total += weights[:, j:j + 1]
        weights = weights / np.maximum(total.astype(np.float32), MIN_WEIGHT_SUM)
    return selected, weights


def ffn_moe(h: np.ndarray, gate_inp: Weight, gate_exps: ExpertWeights, up_exps: ExpertWeights,
            down_exps: ExpertWeights, n_used: int, norm: bool, b: Batch) -> np.ndarray:
    """sum over the k selected experts e of weight_e * down_e(silu(gate_e(h)) * up_e(h)) (build_moe_ffn
    with LLM_FFN_SILU and gating softmax): h f32[R, n_embd] -> f32[R, n_embd]. The experts'
    outputs are weighted (ggml_mul) and added in the order of selection (ggml_add of the
    views), as llama.cpp does."""
    R = h.shape[0]
    n_expert = len(gate_exps.experts)
    logits = gate_inp(h, b.buf("moe_logits", (R, n_expert)), workspace=b.ws)     # ffn_moe_logits
    selected, weights = route(logits, n_used, norm, b.buf("moe_probs", (R, n_expert)))
    flat = selected.reshape(-1)                       # row-major: token, then slot (mul_mat_id's order)
    order = np.argsort(flat, kind="stable")           # grouped by expert, tokens in order within one
    counts = np.bincount(flat, minlength=n_expert)
    experts = b.buf("moe_experts", (R, n_used, down_exps.n_out))
    start = 0
    for e in np.flatnonzero(counts):
        idx = order[start:start + counts[e]]
        start += counts[e]
        rows, slots = idx // n_used, idx % n_used
        d = ffn_swiglu(np.ascontiguousarray(h[rows]), gate_exps.experts[e], up_exps.experts[e],
                       down_exps.experts[e], b)      # ffn_moe_down of these rows
        experts[rows, slots] = d * weights[rows, slots][:, None]           # ffn_moe_weighted
    out = b.buf("moe_out", (R, down_exps.n_out))
    out[:] = experts[:, 0]
    for j in range(1, n_used):
        out += experts[:, j]
    return out
