"""Model architectures, one module per GGUF ``general.architecture``.

``load_model(gf)`` looks the architecture up in :data:`ARCHITECTURES` (through
:data:`ALIASES` for other names of the same thing) and builds the model; an architecture
edge does not implement is an :class:`UnsupportedArchitecture` error that names it.

An architecture's module holds its hyperparameters (read with gguf's ``Keys`` through the
checked readers of :mod:`edge.models.hparams`), the tensors it reads (a table of
:class:`edge.models.weights.Tensor`) and its block's forward pass, written with the shared
layers of :mod:`edge.models.layers` and :mod:`edge.models.rope` in the order of the llama.cpp
``llm_build_*`` graph it mirrors; :class:`edge.models.transformer.Transformer` runs the
blocks over a KV cache. Adding one is that module plus its entry below.
"""
from importlib import import_module

from edge.gguf_file import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "edge.models.llama", "qwen2": "edge.models.qwen2", "gemma3": "edge.models.gemma3",
                 "qwen3": "edge.models.qwen3", "qwen3moe": "edge.models.qwen3moe", "olmo2": "edge.models.olmo2",
                 "smollm3": "edge.models.smollm3", "phi3": "edge.models.phi3", "gemma2": "edge.models.gemma2",
                 "granite": "edge.models.granite"}
ALIASES: dict[str, str] = {}


class UnsupportedArchitecture(GGUFError):
    """The GGUF's general.architecture is not one edge implements."""


def load_model(gf: GGUFFile):
    """Build the model of a GGUF file. Returns an edge.models.transformer.Transformer.

    Raises UnsupportedArchitecture naming the architecture, or GGUFError for missing or
    malformed metadata and tensors.
    """
    arch = gf.get_str("general.architecture")
    module = ARCHITECTURES.get(ALIASES.get(arch, arch))
    if module is None:
        raise UnsupportedArchitecture(
            f"{gf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return import_module(module).load(gf)
