"""Model code on tiny random-weight GGUFs of every architecture, against the plain numpy
reference forward pass (tests/reference_forward.py); KV cache vs whole-sequence, chunked vs
whole prefill; load errors that name what is wrong."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from edge.gguf_file import GGUFError, GGUFFile
from edge.models import UnsupportedArchitecture, load_model
from tests.reference_forward import reference_logits
from tests.tiny_models import write_tiny_model

TOKENS = [1, 5, 17, 3, 88, 42, 42, 7, 60, 2, 33, 91, 0, 14]

# A mix of block formats, the way real Q4_K_M files mix them (rows of 256 for the K-quants).
QUANT_MIX = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_K, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0,
             "attn_output": Q.Q6_K, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q5_1, "ffn_down": Q.Q3_K,
             "output": Q.Q6_K}
QUANT_MIX_2 = {"token_embd": Q.Q4_1, "attn_q": Q.Q5_K, "attn_k": Q.Q2_K, "attn_v": Q.F16,
               "attn_output": Q.BF16, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_K,
               "output": Q.Q8_0}

CASES = {
    "llama-f32": dict(arch="llama"),
    "llama-f32-tied-rope-scaled": dict(arch="llama", tie_output=True, rope_scaling_factor=4.0),
    "llama-f32-rope-freqs": dict(arch="llama", rope_freqs=True),
    "llama-quant": dict(arch="llama", types=QUANT_MIX, n_embd=256, n_ff=512, n_head=8, n_head_kv=2),
    "llama-quant-2": dict(arch="llama", types=QUANT_MIX_2, n_embd=256, n_ff=512, n_head=4, n_head_kv=4),
    "qwen2-f32": dict(arch="qwen2", n_head=4, n_head_kv=1),
    "qwen2-quant": dict(arch="qwen2", types=QUANT_MIX, n_embd=256, n_ff=512, n_head=4, n_head_kv=2),
    "gemma3-f32-swa": dict(arch="gemma3", n_layer=7, head_dim=32, sliding_window=4, n_head=2, n_head_kv=1),
    "gemma3-quant-swa": dict(arch="gemma3", types=QUANT_MIX, n_layer=6, n_embd=256, n_ff=512, head_dim=64,
                             sliding_window=5, n_head=4, n_head_kv=1),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_tiny_model(path, **CASES[request.param])
    model = load_model(GGUFFile(path))
    return request.param, path, model


def _all_logits(model, tokens, chunks):
    cache = model.new_cache(64)
    out, i = [], 0
    for n in chunks:
        out.append(model.forward(tokens[i : i + n], cache, slice(None)))
        i += n
    assert i == len(tokens) and cache.n_past == len(tokens)
    return np.concatenate(out)


def test_matches_numpy_reference(tiny):
    name, path, model = tiny
    ref = reference_logits(path, TOKENS)
    got = _all_logits(model, TOKENS, [len(TOKENS)]).astype(np.float64)
    assert got.shape == ref.shape == (len(TOKENS), model.args.n_vocab)
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    if "quant" in name:
        # Both round activations to 8-bit blocks as llama.cpp does, but float summation order
        # can flip one of those roundings (a jump of 1/127 of a block's range) and random tiny
        # models amplify it; the kernels themselves are held exact in test_matmul.py.
        assert err.max() < 0.1 and cos.min() > 0.99, (err, cos)
        assert (got.argmax(1) == ref.argmax(1)).sum() >= len(TOKENS) - 2
    else:
        assert err.max() < 2e-3, err
        assert np.array_equal(got.argmax(1), ref.argmax(1))


def test_kv_cache_and_chunked_prefill_agree(tiny):
    name, _, model = tiny
    whole = _all_logits(model, TOKENS, [len(TOKENS)])
    # As in llama.cpp, chunks of other sizes take other kernels (other float summation orders:
    # one token vs a batch; K-quants below 8 rows vs from 8), and attention rounds q and the
    # probabilities to f16: a last-bit change can flip one of those roundings (2**-11 of a
    # value, or 1/127 of a block's range for 8-bit activations), which random tiny models
    # amplify. A KV cache bug (wrong position, stale row) moves logits by far more.
    tol = 3e-2 if "quant" in name else 2e-4
    for chunks in ([1] * len(TOKENS), [3, 5, 1, 4, 1], [7, 7]):
        got = _all_logits(model, TOKENS, chunks)
        np.testing.assert_allclose(got, whole, rtol=0, atol=tol * np.abs(whole).max())
        assert (got.argmax(1) == whole.argmax(1)).sum() >= len(TOKENS) - 1


def test_sliding_window_changes_local_layers(tmp_path):
    """The same weights with a window of 4 and of 64 (wider than the prompt): the first 4
    positions see the same keys either way, every later position must differ."""
    a = write_tiny_model(tmp_path / "w4.gguf", arch="gemma3", n_layer=6, head_dim=32, sliding_window=4,
                         n_head=2, n_head_kv=1)
    b = write_tiny_model(tmp_path / "w64.gguf", arch="gemma3", n_layer=6, head_dim=32, sliding_window=64,
                         n_head=2, n_head_kv=1)
    la = _all_logits(load_model(GGUFFile(a)), TOKENS, [len(TOKENS)])
    lb = _all_logits(load_model(GGUFFile(b)), TOKENS, [len(TOKENS)])
    # identical weights (same seed); the first 4 positions cannot differ, later ones must
    np.testing.assert_allclose(la[:4], lb[:4], atol=1e-5)
    assert (np.abs(la[4:] - lb[4:]).max(axis=1) > 1e-2).all()


def test_unsupported_architecture(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedArchitecture, match="architecture 'mamba' is not supported"):
        load_model(GGUFFile(p))


def test_missing_and_extra_tensors(tmp_path):
    p = write_tiny_model(tmp_path / "x.gguf", arch="llama", extra_tensors=["blk.0.mystery.weight"])
    with pytest.raises(GGUFError, match="not used by the llama architecture: blk.0.mystery.weight"):
        load_model(GGUFFile(p))
    p = write_tiny_model(tmp_path / "g.gguf", arch="qwen2")
    gf = GGUFFile(p)
    del gf.tensors["blk.1.attn_q.bias"]
    with pytest.raises(GGUFError, match="required tensor 'blk.1.attn_q.bias' is missing"):
        load_model(gf)


def test_token_count_must_match_embedding_rows(tmp_path):
    """G2: a token list whose length differs from the embedding rows."""
    p = write_tiny_model(tmp_path / "v.gguf", arch="llama", n_tokens=95)
    with pytest.raises(GGUFError, match=r"'token_embd.weight' has shape \[64, 96\], but the metadata gives "
                       r"\[llama.embedding_length = 64, the 95 tokens of tokenizer.ggml.tokens\]"):
        load_model(GGUFFile(p))


def test_forward_refuses_overflow_and_bad_ids(tmp_path):
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "o.gguf", arch="llama")))
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="exceed n_ctx = 8"):
        model.forward(list(range(9)), cache)
    with pytest.raises(ValueError, match="token id out of range"):
        model.forward([96], cache)
    assert cache.n_past == 0


def test_batched_sequences_match_each_alone(tiny):
    """Three sequences in one cache: prefilled in one mixed batch, then decoded together one
    row each. Each must give its own single-sequence logits (to the tolerance of other batch
    sizes' kernels, as above); a row reading another slot's K/V would be far off."""
    name, _, model = tiny
    prompts = [TOKENS[:5], TOKENS[5:12], TOKENS[2:4]]
    follow = [[9, 4, 11], [23, 8, 50], [70, 1, 2]]
    alone = [_all_logits(model, p + f, [len(p)] + [1] * len(f)) for p, f in zip(prompts, follow)]
    cache = model.new_cache(64, n_seq=3)
    seq_ids = np.repeat(np.arange(3), [len(p) for p in prompts])
    got = model.forward(sum(prompts, []), cache, seq_ids=seq_ids)     # last row of each sequence
    assert got.shape == (3, model.args.n_vocab)
    assert list(cache.pos) == [len(p) for p in prompts]
    steps = [got]
    for i in range(len(follow[0])):
        steps.append(model.forward([f[i] for f in follow], cache, seq_ids=np.arange(3)))
    tol = 3e-2 if "quant" in name else 2e-4
    for s in range(3):
        want = alone[s][len(prompts[s]) - 1 :]                          # last prompt row, then decode rows
        have = np.stack([step[s] for step in steps])
        np.testing.assert_allclose(have, want, rtol=0, atol=tol * np.abs(want).max())
    assert list(cache.pos) == [len(p) + 3 for p in prompts]


def test_batch_rejects_bad_sequence_rows(tmp_path):
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "b.gguf", arch="llama")))
    cache = model.new_cache(4, n_seq=2)
    with pytest.raises(ValueError, match=r"sequence id out of range \[0, 2\)"):
        model.forward([1, 2], cache, seq_ids=[0, 2])
    with pytest.raises(ValueError, match="rows of one sequence must be consecutive"):
        model.forward([1, 2, 3], cache, seq_ids=[0, 1, 0])
    with pytest.raises(ValueError, match="seq_ids must be 2 integers"):
        model.forward([1, 2], cache, seq_ids=[0])
    model.forward([1, 2, 3], cache, seq_ids=[1, 1, 1])
    with pytest.raises(ValueError, match="sequence 1 at 3 \\+ 2 tokens exceeds n_ctx = 4"):
        model.forward([1, 2, 3], cache, seq_ids=[0, 1, 1])
    assert list(cache.pos) == [0, 3]
