"""The shape of edge.models (issue 15): an architecture in one file whose block forward fits one
screen, tensors declared and held to the metadata in every block, the KV types known only to
edge.kv, and the caller owning the thread policy (layer_callback)."""
import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import edge.models
from edge.gguf_file import GGUFError, GGUFFile
from edge.kv.cache import KV_TYPES
from edge.kv.codec import CODECS
from edge.models import ARCHITECTURES, load_model
from edge.models.layers import Block
from tests.tiny_models import write_tiny_model

MODELS_DIR = Path(edge.models.__file__).parent
SCREEN = 50   # lines


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_is_one_file_whose_forward_fits_a_screen(arch, tmp_path):
    """Every registered architecture's module holds a Block subclass (its own or the one whose
    graph it shares) and that block's forward pass is at most one screen."""
    module = __import__(ARCHITECTURES[arch], fromlist=["load"])
    model = load_model(GGUFFile(write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, head_dim=32)))
    block = type(model.blocks[0])
    assert issubclass(block, Block) and block.__call__ is not Block.__call__
    lines, _ = inspect.getsourcelines(block.__call__)
    assert len(lines) <= SCREEN, f"{block.__name__}.__call__ is {len(lines)} lines"
    assert type(model).__module__ == module.__name__


def test_models_do_not_know_kv_types():
    """No module of edge.models names a KV type or a pool's dtype: edge.kv.codec decides
    how each type stores K/V (every type the cache offers has a codec)."""
    assert set(CODECS) == set(KV_TYPES)
    for path in sorted(MODELS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & set(KV_TYPES), (path.name, strings & set(KV_TYPES))
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attrs & {"uint8", "uint16"}, path.name            # the pools' dtypes


def test_every_block_held_to_the_metadata(tmp_path):
    """A tensor of a later block with another shape is refused naming the keys that size it,
    as block 0's are."""
    gf = GGUFFile(write_tiny_model(tmp_path / "m.gguf", arch="llama"))
    gf.tensors["blk.1.ffn_norm.weight"] = gf.tensors["blk.1.ffn_down.weight"]
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.ffn_norm.weight' has shape \[128, 64\], but the "
                                        r"metadata gives \[llama.embedding_length = 64\]$"):
        load_model(gf)


def test_layer_callback_before_each_layer(tmp_path, monkeypatch):
    """forward calls layer_callback(il) before layer il and nothing about threads: the model
    neither makes nor reads a thread policy (the caller owns it)."""
    import edge.threads

    def refuse(*a, **kw):
        raise AssertionError("the model made a thread policy")
    monkeypatch.setattr(edge.threads.AdaptiveThreads, "from_env", classmethod(refuse))
    monkeypatch.setattr(edge.threads.AdaptiveThreads, "__init__", refuse)
    model = load_model(GGUFFile(write_tiny_model(tmp_path / "m.gguf", arch="gemma3", head_dim=32, n_layer=3)))
    seen = []
    cache = model.new_cache(16)
    got = model.forward([1, 2, 3], cache, layer_callback=seen.append)
    assert seen == [0, 1, 2]
    np.testing.assert_array_equal(got, model.forward([1, 2, 3], model.new_cache(16)))
    seen.clear()
    model.forward([4], cache, logits_rows=[], layer_callback=seen.append)   # K/V only: still every layer
    assert seen == [0, 1, 2] and cache.n_past == 4

