"""The mixture-of-experts layer (edge/models/moe.py, qwen3moe) on its own: the experts' sum
against a dense numpy computation, each expert run on only the rows routed to it, and the
expert counts held to each other (the comparison with llama.cpp is tests/test_arch_llama_cpp.py)."""
import numpy as np
import pytest

from edge.gguf_file import GGUFError, GGUFFile
from edge.models import load_model
from edge.models.layers import Batch
from tests.tiny_models import write_tiny_model

N_EXPERT, N_USED, T = 4, 2, 9


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("moe") / "m.gguf", arch="qwen3moe", n_expert=N_EXPERT,
                            n_expert_used=N_USED, n_ff_exp=96)
    return load_model(GGUFFile(path))


def _f32(w) -> np.ndarray:
    return w.rows.view(np.float32)                                        # [n_out, n_in] of an F32 matrix


def test_moe_equals_dense_reference(model):
    """ffn_moe of random rows = sum over each row's top-2 experts of its normalised softmax
    weight times the expert's SwiGLU, computed densely in float64."""
    blk = model.blocks[0]
    h = np.random.default_rng(0).standard_normal((T, model.args.n_embd)).astype(np.float32)
    b = Batch(model.new_cache(16), np.zeros(T, np.int32), np.arange(T, dtype=np.int32), model.scratch, False)
    got = blk.ffn(h.copy(), b).copy()
    hd = h.astype(np.float64)
    logits = hd @ _f32(blk.ffn_gate_inp).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = np.zeros_like(hd)
    for t in range(T):
        top = np.argsort(-p[t])[:N_USED]
        for e in top:
            g = hd[t] @ _f32(blk.ffn_gate_exps.experts[e]).T
            u = hd[t] @ _f32(blk.ffn_up_exps.experts[e]).T
            act = g / (1 + np.exp(-g)) * u
            want[t] += p[t, e] / p[t, top].sum() * (act @ _f32(blk.ffn_down_exps.experts[e]).T)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_each_expert_sees_only_its_rows(model):
    """Every expert matrix multiplies only the rows routed to it: over a layer the experts'
    up projections see T * expert_used_count rows in all, each expert at most T."""
    seen = []
    model.set_observer(lambda name, x: seen.append((name, x.shape[0])))
    try:
        model.forward(list(range(1, T + 1)), model.new_cache(16), slice(None))
    finally:
        model.set_observer(None)
    for il in range(model.args.n_layer):
        rows = [n for name, n in seen if name == f"blk.{il}.ffn_up_exps.weight"]
        assert sum(rows) == T * N_USED and len(rows) <= N_EXPERT and max(rows) <= T, rows
        assert sum(n for name, n in seen if name == f"blk.{il}.ffn_gate_inp.weight") == T


def test_expert_counts_checked(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", arch="qwen3moe", n_expert=2, n_expert_used=3)
    with pytest.raises(GGUFError, match=r"qwen3moe.expert_used_count = 3 is more than qwen3moe.expert_count = 2$"):
        load_model(GGUFFile(p))
    p = write_tiny_model(tmp_path / "z.gguf", arch="qwen3moe", n_expert=2, n_expert_used=0)
    with pytest.raises(GGUFError, match=r"qwen3moe.expert_used_count = 0 is out of range: it must be in 1\.\."):
        load_model(GGUFFile(p))


def test_batched_sequences_match_each_alone(model):
    """Three sequences in one batch (prefill, then one decode row each): the experts group
    rows of all three, and each sequence's logits are its own, computed alone."""
    prompts, follow = [[1, 5, 17, 3], [88, 42, 42, 7, 60], [2, 33]], [[9, 4], [23, 8], [70, 1]]
    alone = []
    for p, f in zip(prompts, follow):
        cache = model.new_cache(16)
        alone.append(np.concatenate([model.forward(p, cache)] + [model.forward([t], cache) for t in f]))
    cache = model.new_cache(16, n_seq=3)
    steps = [model.forward(sum(prompts, []), cache, seq_ids=np.repeat(np.arange(3), [len(p) for p in prompts]))]
    for i in range(2):
        steps.append(model.forward([f[i] for f in follow], cache, seq_ids=np.arange(3)))
    for s in range(3):
        have = np.stack([step[s] for step in steps])
        np.testing.assert_allclose(have, alone[s], rtol=0, atol=2e-4 * np.abs(alone[s]).max())
