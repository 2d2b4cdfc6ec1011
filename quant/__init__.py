"""GGML block formats: quantize and dequantize references, the `edge quantize` pipeline."""
