"""Model architectures, one module per GGUF ``general.architecture``.

``load_model(gf)`` looks the architecture up in :data:`ARCHITECTURES` (through
:data:`ALIASES` for other names of the same thing) and builds the model; an architecture
edge does not implement is an :class:`UnsupportedArchitecture` error that names it.
"""
from importlib import import_module

from edge.gguf_file import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "edge.models.llama", "qwen2": "edge.models.qwen2", "gemma3": "edge.models.gemma3"}
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
