"""Attention over paged KV pools of each KV type (f16, f32, q8_0), against a float64 numpy
reference computed from the values the pool holds (q8_0 read back by gguf's own
dequantizer, so the stored bytes are the GGML Q8_0 format)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels_cpu.attention import paged_attention, store_kv

H, H_KV, HD = 4, 2, 64
ROW = {"f16": HD, "f32": HD, "q8_0": HD // 32 * 34}
DTYPE = {"f16": np.uint16, "f32": np.float32, "q8_0": np.uint8}


def _stored_values(pool: np.ndarray, kind: str) -> np.ndarray:
    """The float values a pool [n_blocks, bs, H_kv, row] holds, as float64 [n_blocks, bs, H_kv, HD]."""
    if kind == "f16":
        return pool.view(np.float16).astype(np.float64)
    if kind == "f32":
        return pool.astype(np.float64)
    vals = dequantize(pool.reshape(-1, ROW["q8_0"]), GGMLQuantizationType.Q8_0)
    return vals.reshape(pool.shape[:3] + (HD,)).astype(np.float64)


def _reference(q, kv_k, kv_v, tables, seq_ids, positions, window, scale, bs):
    T = len(positions)
    out = np.zeros((T, H, HD))
    for t in range(T):
        p, tab = positions[t], tables[seq_ids[t]]
        cells = [j for j in range(p + 1) if window == 0 or p - j < window]
        k = np.stack([kv_k[tab[j // bs], j % bs] for j in cells])       # [n, H_kv, HD]
        v = np.stack([kv_v[tab[j // bs], j % bs] for j in cells])
        for h in range(H):
            s = k[:, h // (H // H_KV)] @ q[t, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[:, h // (H // H_KV)]
    return out


@pytest.mark.parametrize("kind", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_kv_types(kind, window):
    rng = np.random.default_rng(7)
    bs, n_blocks, seqs, lengths = 4, 12, 2, [9, 6]
    tables = np.full((seqs, 4), -1, np.int32)
    tables[0, :3] = [5, 0, 9]
    tables[1, :2] = [3, 11]
    pools = [np.zeros((n_blocks, bs, H_KV, ROW[kind]), DTYPE[kind]) for _ in range(2)]
    seq_ids = np.repeat(np.arange(seqs), lengths).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    k = rng.standard_normal((len(positions), H_KV * HD)).astype(np.float32)
    v = rng.standard_normal((len(positions), H_KV * HD)).astype(np.float32)
    store_kv(k, pools[0], tables, seq_ids, positions)
    store_kv(v, pools[1], tables, seq_ids, positions)
    kv_k, kv_v = _stored_values(pools[0], kind), _stored_values(pools[1], kind)
    # what was stored is the input up to the type's rounding
    got_k = np.stack([kv_k[tables[s, p // bs], p % bs].reshape(-1) for s, p in zip(seq_ids, positions)])
    tol = {"f16": 1e-3, "f32": 0.0, "q8_0": 0.02}[kind]
    np.testing.assert_allclose(got_k, k, rtol=0, atol=tol * np.abs(k).max())
    q = rng.standard_normal((len(positions), H, HD)).astype(np.float32)
    out = np.empty((len(positions), H, HD), np.float32)
    scale = np.float32(1 / 8)
    paged_attention(q, pools[0], pools[1], tables, seq_ids, positions, window, scale, out)
    ref = _reference(q, kv_k, kv_v, tables, seq_ids, positions, window, float(scale), bs)
    # f16 rounds the query and the probabilities to f16, q8_0 quantizes the query to 8 bits
    tol = {"f16": 2e-3, "f32": 1e-5, "q8_0": 2e-2}[kind]
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix float32[n, n] (n a power of two; Sylvester's
    construction scaled by 1/sqrt(n), as llama.cpp's ggml_gen_hadamard): the reference for
    rotate_chunks, which computes x @ H by butterflies."""
    m = np.ones((1, 1), np.float64)
    while m.shape[0] < n:
        m = np.block([[m, m], [m, -m]])
    return (m / np.sqrt(n)).astype(np.float32)


def test_hadamard_is_orthonormal_and_symmetric():
    from kernels_cpu.ops import rotate_chunks

    for n in (64, 128, 256):
        h = hadamard(n).astype(np.float64)
        assert np.allclose(h, h.T) and np.allclose(h @ h, np.eye(n), atol=1e-6)
        assert np.all(np.abs(h) == np.float32(1 / np.sqrt(n)))
    x = np.random.default_rng(0).standard_normal((3, 2, 128)).astype(np.float32)
    y = x.copy()
    rotate_chunks(y, 64)
    np.testing.assert_allclose(y.reshape(-1, 64), x.reshape(-1, 64) @ hadamard(64), rtol=1e-6, atol=1e-6)
    rotate_chunks(y, 64)                                   # twice = identity
    np.testing.assert_allclose(y, x, atol=1e-5)
