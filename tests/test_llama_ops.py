"""edge's attention and element-wise kernels reproduce llama.cpp bit for bit.

The fixtures (tests/data/llama_ops_<model>.npz, made by tools/make_llama_ops_fixtures.py with
the llama.cpp build that made the goldens) hold llama.cpp's own inputs and outputs of each op
for layer 0 of the real models, for a batch of prompt tokens (prefill: tinyBLAS lane order)
and for one decoded token (decode: ggml_vec_dot_f16 lane order). Each test feeds the inputs
to edge's kernel and requires identical float32 bits.
"""
import hashlib
from pathlib import Path

import numba
import numpy as np
import pytest

from kernels_cpu import ops
from kernels_cpu.attention import paged_attention, attention_scores, store_kv

DATA = Path(__file__).parent / "data"
MODELS = ["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]
PATHS = ["prefill", "decode"]


@pytest.fixture(scope="module", params=MODELS)
def fx(request):
    with np.load(DATA / f"llama_ops_{request.param}.npz") as z:
        return {k: z[k] for k in z.files}


def _bits_equal(got, want):
    """Exact equality of float bit patterns, with a readable failure."""
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.flatnonzero(got.view(np.uint32 if got.dtype == np.float32 else np.uint16).ravel()
                         != want.view(np.uint32 if want.dtype == np.float32 else np.uint16).ravel())
    assert bad.size == 0, f"{bad.size}/{got.size} differ, first at {bad[:5]}: {got.ravel()[bad[:5]]} vs {want.ravel()[bad[:5]]}"


@pytest.mark.parametrize("path", PATHS + ["global_prefill", "global_decode"])
def test_rope(fx, path):
    if f"{path}_pos" not in fx:
        pytest.skip("no global-layer RoPE for this model (one RoPE base)")
    base = fx["global_rope_base"] if path.startswith("global") else fx["rope_base"]
    for which in ("q", "k"):
        x = fx[f"{path}_rope_{which}_in"].copy()
        cos, sin = ops.rope_cos_sin(fx[f"{path}_pos"], x.shape[-1], float(base))
        ops.rope(x, cos, sin, True)
        _bits_equal(x, fx[f"{path}_rope_{which}_out"])


@pytest.mark.parametrize("path", PATHS)
def test_kv_store_rounds_to_f16(fx, path):
    for which in ("k", "v"):
        src = fx[f"{path}_{which}_new"]
        T = len(src)
        pool = np.zeros((1, T, 1, src.shape[1]), np.uint16)          # one block of T cells
        store_kv(src, pool, np.zeros((1, 1), np.int32), np.zeros(T, np.int32), np.arange(T, dtype=np.int32))
        dst = pool.reshape(T, -1)
        _bits_equal(dst.view(np.float16), fx[f"{path}_{which}_stored"])


@pytest.mark.parametrize("path", PATHS)
def test_kq_and_softmax(fx, path):
    q, pos = fx[f"{path}_q"], fx[f"{path}_pos"]
    if path == "decode":
        q, pos = q[:1], pos[:1]
    k = fx[f"{path}_k_cache"].view(np.uint16)
    n = k.shape[0]
    kq = np.empty((len(pos), q.shape[1], n), np.float32)
    probs = np.empty_like(kq)
    attention_scores(q, k, pos, 0, np.float32(fx["kq_scale"]), kq, probs)
    visible = np.arange(n)[None, None, :] <= pos[:, None, None]
    _bits_equal(kq[np.broadcast_to(visible, kq.shape)], fx[f"{path}_kq"][np.broadcast_to(visible, kq.shape)])
    _bits_equal(probs, fx[f"{path}_probs"])


@pytest.mark.parametrize("path", PATHS)
def test_attention_output(fx, path):
    q, pos = fx[f"{path}_q"], fx[f"{path}_pos"]
    k, v = fx[f"{path}_k_cache"].view(np.uint16), fx[f"{path}_v_cache"].view(np.uint16)
    out = np.empty((len(pos), q.shape[1], v.shape[2]), np.float32)
    paged_attention(q, k[None], v[None], np.zeros((1, 1), np.int32), np.zeros_like(pos), pos, 0,
                  np.float32(fx["kq_scale"]), out)
    _bits_equal(out, fx[f"{path}_kqv"])


def test_lane_order_matters(fx):
    """The fixture tells the two kernels apart: the decode query scored with the batch (T >= 2)
    lane order differs from llama.cpp's decode scores, so the tests above pin the order."""
    q, pos = fx["decode_q"], fx["decode_pos"]
    k = fx["decode_k_cache"].view(np.uint16)
    kq = np.empty((2, q.shape[1], k.shape[0]), np.float32)
    attention_scores(np.concatenate([q, q]), k, np.concatenate([pos, pos]), 0,
                     np.float32(fx["kq_scale"]), kq, np.empty_like(kq))
    assert np.array_equal(kq[0], kq[1])
    assert not np.array_equal(kq[:1], fx["decode_kq"])


@pytest.mark.parametrize("path", PATHS)
def test_gated_activation(fx, path):
    gate, up = fx[f"{path}_gate"], fx[f"{path}_up"]
    out = np.empty_like(gate)
    (ops.gelu_mul if str(fx["model"]).startswith("gemma") else ops.silu_mul)(gate, up, out)
    _bits_equal(out, fx[f"{path}_act"])


def test_gelu_table_is_ggmls(fx):
    assert hashlib.sha256(ops.GELU_TABLE.astype("<u2").tobytes()).hexdigest() == str(fx["gelu_table_sha256"])


# ggml's CPU results on synthetic inputs (tools/make_ggml_op_fixtures.py): cases the two real
# models do not reach.
@pytest.fixture(scope="module")
def ggml_fx():
    with np.load(DATA / "ggml_ops.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", ["rope_norm_factors", "rope_norm", "rope_neox_partial"])
def test_rope_modes_scaling_and_factors(ggml_fx, name):
    """NORM pairing with llama-3 frequency factors and linear scaling, partial rotary
    dimensions (n_rot < hd: the rest pass through), positions up to 30000."""
    mode, n_rot, base, freq_scale = ggml_fx[f"{name}_params"]
    x = ggml_fx[f"{name}_x"].copy()
    cos, sin = ops.rope_cos_sin(ggml_fx[f"{name}_pos"], int(n_rot), base, freq_scale, ggml_fx.get(f"{name}_ff"))
    ops.rope(x, cos, sin, mode == 2)  # GGML_ROPE_TYPE_NEOX
    _bits_equal(x, ggml_fx[f"{name}_out"])


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_glu_rows_with_scalar_tail(ggml_fx, act):
    """Rows of 1000 = 62 * 16 + 8: SwiGLU's last 8 elements take ggml's scalar expf path;
    GeGLU inputs include +-10 and their neighbours."""
    gate, up = ggml_fx["glu_gate"], ggml_fx["glu_up"]
    out = np.empty_like(gate)
    (ops.silu_mul if act == "swiglu" else ops.gelu_mul)(gate, up, out)
    _bits_equal(out, ggml_fx[f"{act}_out"])


@pytest.mark.parametrize("n", [2048, 4101, 8960, 8963])
def test_silu_row_split_among_threads_is_bit_equal(ggml_fx, n):
    """A row alone is split among the threads (a decode step; ops.SILU_MIN_COLS), rows of a
    batch are not: both give the same bits, the last n % 16 values through the scalar expf
    path, also with out aliasing gate (llama.cpp's values: test_glu_rows_with_scalar_tail)."""
    if numba.get_num_threads() < 2:
        pytest.skip("one thread: no row is split")
    base = ggml_fx["glu_gate"].reshape(-1)
    reps = -(-4 * n // base.size)
    gate = np.tile(base, reps)[: 4 * n].reshape(4, n) * np.float32(3)
    up = np.tile(ggml_fx["glu_up"].reshape(-1), reps)[: 4 * n].reshape(4, n)
    batch = np.empty_like(gate)
    ops.silu_mul(gate, up, batch)
    for t in range(4):
        row = gate[t : t + 1].copy()
        ops.silu_mul(row, up[t : t + 1], row)
        _bits_equal(row, batch[t : t + 1])
    ref = gate[:, -(n % 16 or 1):] / (1 + np.exp(-gate[:, -(n % 16 or 1):].astype(np.float64)))
    np.testing.assert_allclose(batch[:, -(n % 16 or 1):], ref * up[:, -(n % 16 or 1):], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_attention_through_block_table(fx, path, block_size):
    """The same K/V scattered over a pool of blocks in a shuffled order, read through a block
    table: bit for bit the output of the contiguous cache (and so llama.cpp's)."""
    q, pos = fx[f"{path}_q"], fx[f"{path}_pos"]
    k, v = fx[f"{path}_k_cache"].view(np.uint16), fx[f"{path}_v_cache"].view(np.uint16)
    n = k.shape[0]
    n_used = -(-n // block_size)
    order = np.random.default_rng(block_size).permutation(n_used + 3).astype(np.int32)[:n_used]
    pools = []
    for cache in (k, v):
        pool = np.full((n_used + 3, block_size) + cache.shape[1:], 0x7E00, np.uint16)  # NaN where unused
        for b in range(n_used):
            part = cache[b * block_size : (b + 1) * block_size]
            pool[order[b], : len(part)] = part
        pools.append(pool)
    out = np.empty((len(pos), q.shape[1], v.shape[2]), np.float32)
    paged_attention(q, pools[0], pools[1], order[None, :], np.zeros_like(pos), pos, 0,
                  np.float32(fx["kq_scale"]), out)
    _bits_equal(out, fx[f"{path}_kqv"])
