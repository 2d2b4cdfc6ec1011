"""edge: local LLM inference on CPUs, GGUF models through numba kernels."""

__version__ = "0.1.0"
