"""The metadata of phi3, gemma2, granite and the llama family's variants: what each key does
that a random-weight comparison with llama.cpp (tests/test_arch_llama_cpp.py) cannot tell
apart, and the one-line errors for values edge refuses."""
import numpy as np
import pytest

from edge.gguf_file import GGUFError, GGUFFile
from edge.models import UnsupportedArchitecture, load_model
from edge.models.rope import LongRope
from tests.tiny_models import write_tiny_model

TOKENS = [1, 5, 17, 3, 88, 42, 42, 7, 60, 2]


def _logits(model, n_ctx=64):
    return model.forward(TOKENS, model.new_cache(n_ctx), slice(None))


def test_unknown_architecture_names_it_and_the_known_ones(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "m.gguf", arch="mamba"))
    with pytest.raises(UnsupportedArchitecture) as e:
        load_model(gf)
    msg = str(e.value)
    assert "architecture 'mamba' is not supported (supported: " in msg and "\n" not in msg
    for arch in ("llama", "phi3", "gemma2", "granite"):
        assert arch in msg.split("supported: ")[1]


@pytest.mark.parametrize("kind", ["yarn", "longrope", "llama3"])
def test_unsupported_rope_scaling_is_one_line(tmp_path, kind):
    """A RoPE scaling type edge does not implement (llama.cpp's yarn and longrope on a llama
    file; llama3 is no GGUF type: its factors come as rope_freqs) names the key and value."""
    p = write_tiny_model(tmp_path / "m.gguf", arch="llama", metadata={".rope.scaling.type": kind})
    with pytest.raises(GGUFError, match=rf"llama.rope.scaling.type = '{kind}' is not supported "
                                        r"\(supported: none, linear\)$"):
        load_model(GGUFFile(p))


def test_mixture_of_experts_llama_is_one_line(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", arch="llama", metadata={".expert_count": 8})
    with pytest.raises(GGUFError, match=r"llama.expert_count = 8: mixture-of-experts llama files are not "
                                        r"supported$"):
        load_model(GGUFFile(p))


def test_phi3_long_factors_past_the_original_context(tmp_path):
    """LongRoPE: a cache of at most rope.scaling.original_context_length positions (after
    llama.cpp's padding of n_ctx to a multiple of 256) takes the short factors, a longer one
    the long factors; without factor tensors the context size changes nothing."""
    p = write_tiny_model(tmp_path / "p.gguf", arch="phi3", rope_factors=True,
                         metadata={".rope.scaling.original_context_length": 256})
    model = load_model(GGUFFile(p))
    rope = model.blocks[0].rope
    assert isinstance(rope, LongRope)
    assert rope.pick(256) is rope.short and rope.pick(100) is rope.short and rope.pick(257) is rope.long
    np.testing.assert_array_equal(rope.short.freq_factors, model.rope_factors_short)
    np.testing.assert_array_equal(rope.long.freq_factors, model.rope_factors_long)
    short, short2, long = _logits(model, 256), _logits(model, 40), _logits(model, 300)
    np.testing.assert_array_equal(short, short2)
    assert np.abs(long - short).max() > 1e-2
    plain = load_model(GGUFFile(write_tiny_model(tmp_path / "q.gguf", arch="phi3")))
    np.testing.assert_array_equal(_logits(plain, 40), _logits(plain, 300))


def test_phi3_attn_factor_scales_rope(tmp_path):
    """rope.scaling.attn_factor multiplies cos and sin (so q.k by its square)."""
    a = load_model(GGUFFile(write_tiny_model(tmp_path / "a.gguf", arch="phi3")))
    b = load_model(GGUFFile(write_tiny_model(tmp_path / "b.gguf", arch="phi3",
                                             metadata={".rope.scaling.attn_factor": 1.5})))
    assert b.blocks[0].rope.attn_factor == 1.5
    assert np.abs(_logits(a) - _logits(b)).max() > 1e-2


def test_granite_multipliers_and_rope_switch(tmp_path):
    """Granite's four multipliers are read (a missing logit_scale is a one-line error, as in
    llama.cpp, which requires it); rope.scaling.finetuned = false turns RoPE off (the multipliers keep the
    attention's share small: 0.22 of 1/128-scaled scores)."""
    p = write_tiny_model(tmp_path / "g.gguf", arch="granite")
    model = load_model(GGUFFile(p))
    a = model.args
    assert (a.embedding_scale, a.residual_scale, a.attention_scale, a.logit_scale) == \
        (12.0, np.float32(0.22), 0.0078125, 8.0)
    assert model.blocks[0].kq_scale == np.float32(0.0078125) and model.blocks[0].rope is not None
    gf = GGUFFile(p)
    del gf.fields["granite.logit_scale"]
    with pytest.raises(GGUFError, match=r"required metadata key 'granite.logit_scale' is missing$"):
        load_model(gf)
    off = load_model(GGUFFile(write_tiny_model(tmp_path / "n.gguf", arch="granite",
                                               metadata={".rope.scaling.finetuned": False})))
    assert off.blocks[0].rope is None
    got, want = _logits(off), _logits(model)
    np.testing.assert_array_equal(got[0], want[0])          # position 0: RoPE turns nothing
    assert (np.abs(got[1:] - want[1:]).max(axis=1) > 1e-4).all()


def test_gemma2_defaults_and_soft_caps(tmp_path):
    """gemma2 without the keys: window 4096, every other layer local, soft caps 50 / 30 (the
    logits stay within 30); a soft cap of 0 is refused naming the key."""
    p = write_tiny_model(tmp_path / "g.gguf", arch="gemma2", n_layer=4, head_dim=32)
    model = load_model(GGUFFile(p))
    a = model.args
    assert (a.sliding_window, a.swa_layers, a.attn_softcap, a.final_logit_softcap) == \
        (4096, (True, False, True, False), 50.0, 30.0)
    assert [blk.softcap for blk in model.blocks] == [50.0] * 4
    capped = load_model(GGUFFile(write_tiny_model(tmp_path / "c.gguf", arch="gemma2", n_layer=4, head_dim=32,
                                                  metadata={".final_logit_softcapping": 2.0})))
    out = _logits(capped)
    assert np.abs(out).max() <= 2.0 and np.abs(out).max() > 1.0
    bad = write_tiny_model(tmp_path / "z.gguf", arch="gemma2", metadata={".attn_logit_softcapping": 0.0})
    with pytest.raises(GGUFError, match=r"gemma2.attn_logit_softcapping = 0.0 is out of range: it must be a "
                                        r"finite number > 0$"):
        load_model(GGUFFile(bad))


def test_llama_head_dim_from_key_length(tmp_path):
    """Mistral Nemo style: attention.key_length 32 with n_embd / n_head = 16; the q/k/v and
    output matrices are sized by it, and a wrong key_length names the keys."""
    p = write_tiny_model(tmp_path / "m.gguf", arch="llama", n_embd=64, n_head=4, head_dim=32)
    model = load_model(GGUFFile(p))
    assert model.args.head_dim == 32 and model.blocks[0].attn_q.n_out == 128
    assert _logits(model).shape == (len(TOKENS), 96)
    gf = GGUFFile(p)
    del gf.fields["llama.attention.key_length"]
    del gf.fields["llama.attention.value_length"]
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' has shape \[64, 128\], but the metadata "
                                        r"gives \[llama.embedding_length = 64, llama.attention.head_count \* "
                                        r"llama.attention.key_length = 4 \* 16 = 64\]$"):
        load_model(gf)
