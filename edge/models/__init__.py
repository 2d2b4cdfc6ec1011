"""Model architectures, one module per GGUF general.architecture."""
