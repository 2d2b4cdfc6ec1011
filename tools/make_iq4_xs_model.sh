#!/usr/bin/env bash
# Make the IQ4_XS benchmark file of issue 17: qwen2.5-coder-0.5b-instruct quantized to IQ4_XS by
# llama-quantize from its F16 source, with an importance matrix from llama-imatrix.
#
#   tools/make_iq4_xs_model.sh [MODELS_DIR] [OUT_DIR]
#
# MODELS_DIR (default ~/.cache/edge/models) holds qwen2.5-coder-0.5b-instruct.gguf (edge pull);
# OUT_DIR (default ~/.cache/edge/test-data) gets the F16 source, the imatrix and
# qwen2.5-coder-0.5b-instruct-iq4_xs.gguf. The F16 source is ../shared/tools/make_f16_source.py's
# (every tensor of the Q4_K_M file dequantized; matrices F16). Calibration text: the perplexity text
# of the goldens (../shared/golden/ppl_text.txt), 512-token chunks. The tools are llama.cpp's
# from tools/build_oracle.sh (EDGE_ORACLE_PYTHON's bin folder). One thread each, so that the
# result does not depend on the thread count; prints the file's sha256 on its last line.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODELS=${1:-$HOME/.cache/edge/models}
OUT=${2:-$HOME/.cache/edge/test-data}
ORACLE=${EDGE_ORACLE_PYTHON:-$HOME/.cache/edge-oracle/llama-cpp-python-0.3.36/venv/bin/python}
BIN=$(dirname "$ORACLE")
SHARED=${EDGE_SHARED:-$ROOT/../shared}
SRC=$MODELS/qwen2.5-coder-0.5b-instruct.gguf
F16=$OUT/qwen2.5-coder-0.5b-instruct-f16.gguf
IMATRIX=$OUT/qwen2.5-coder-0.5b-instruct.imatrix.gguf
DEST=$OUT/qwen2.5-coder-0.5b-instruct-iq4_xs.gguf
for f in "$SRC" "$SHARED/tools/make_f16_source.py" "$SHARED/golden/ppl_text.txt" "$BIN/llama-imatrix" "$BIN/llama-quantize"; do
    [ -e "$f" ] || { echo "make_iq4_xs_model: $f is missing" >&2; exit 1; }
done
mkdir -p "$OUT"
[ -s "$F16" ] || { "${PYTHON:-python3}" "$SHARED/tools/make_f16_source.py" "$SRC" "$F16.tmp" && mv "$F16.tmp" "$F16"; }
[ -s "$IMATRIX" ] || {
    "$BIN/llama-imatrix" -m "$F16" -f "$SHARED/golden/ppl_text.txt" -c 512 -t 1 -o "$IMATRIX.tmp.gguf" >"$OUT/imatrix.log" 2>&1
    mv "$IMATRIX.tmp.gguf" "$IMATRIX"
}
"$BIN/llama-quantize" --imatrix "$IMATRIX" "$F16" "$DEST.tmp" IQ4_XS 1 >"$OUT/quantize-iq4_xs.log" 2>&1
mv "$DEST.tmp" "$DEST"
sha256sum "$DEST"
