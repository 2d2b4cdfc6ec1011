#!/usr/bin/env bash
# llama-cpp-python 0.3.36 built for one x86 target (not the host's -march=native), to bench edge's
# kernel path for that target against llama.cpp's for the same target in one run:
#
#   tools/build_llama_cpp_target.sh avx2|avx-vnni [DIR]
#       DIR default: ${XDG_CACHE_HOME:-~/.cache}/edge-oracle/llama-cpp-python-0.3.36-TARGET
#   edge bench --vs-llama-cpp --llama-python DIR/venv/bin/python ...   (edge with NUMBA_CPU_NAME=haswell
#       or alderlake, see tools/check_targets.py for the feature lists)
#
# avx2:     GGML_NATIVE=OFF GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 (Haswell's set, no AVX-512)
# avx-vnni: the same plus GGML_AVX_VNNI (Alder Lake's 256-bit VEX vpdpbusd); it runs only on a CPU
#           with AVX-VNNI (an illegal instruction elsewhere, AMD Zen 4 included)
# Prints the interpreter's path on its last line; a finished build is reused. About 6 minutes on 2 cores.
set -euo pipefail
VERSION=0.3.36
TARGET=${1:?usage: build_llama_cpp_target.sh avx2|avx-vnni [DIR]}
case "$TARGET" in
    avx2) FLAGS="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
    avx-vnni) FLAGS="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON" ;;
    *) echo "build_llama_cpp_target: unknown target $TARGET (avx2, avx-vnni)" >&2; exit 2 ;;
esac
DIR=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/edge-oracle/llama-cpp-python-$VERSION-$TARGET}
PY=$DIR/venv/bin/python
if [ -x "$PY" ] && "$PY" -c "import llama_cpp" >/dev/null 2>&1; then
    echo "llama.cpp $TARGET: reusing $DIR" >&2; echo "$PY"; exit 0
fi
SDIST=${EDGE_LLAMA_SDIST:-$HOME/.cache/edge/test-data/llama_cpp_python-$VERSION.tar.gz}
mkdir -p "$DIR"
rm -rf "$DIR/venv"     # an unfinished earlier build (only what this script made: DIR may hold more)
python3 -m venv "$DIR/venv"
if [ ! -f "$SDIST" ]; then
    "$DIR/venv/bin/pip" download -q --no-deps --no-binary :all: -d "$DIR" "llama-cpp-python==$VERSION"
    SDIST=$DIR/llama_cpp_python-$VERSION.tar.gz
fi
echo "llama.cpp $TARGET: building llama-cpp-python $VERSION in $DIR ($FLAGS)" >&2
CMAKE_ARGS="-DGGML_NATIVE=OFF $FLAGS -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    "$DIR/venv/bin/pip" install -q --disable-pip-version-check "$SDIST" >"$DIR/build.log" 2>&1 \
    || { tail -30 "$DIR/build.log" >&2; exit 1; }
"$PY" -c "import llama_cpp" || exit 1
echo "$PY"
