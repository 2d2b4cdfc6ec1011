#!/usr/bin/env bash
# Build llama.cpp as the tests' oracle, once: llama-cpp-python 0.3.36 (the build the goldens in
# ../shared/golden came from) in a virtual environment, and llama.cpp's own tools from the same
# source (llama-quantize, llama-imatrix, llama-perplexity) in that environment's bin folder.
#
#   tools/build_oracle.sh [DIR]     DIR default: ${XDG_CACHE_HOME:-~/.cache}/edge-oracle/llama-cpp-python-0.3.36
#
# Prints the oracle interpreter's path (DIR/venv/bin/python) on its last line; the tests find
# it through EDGE_ORACLE_PYTHON (or at the default DIR). A finished build is reused: nothing is
# rebuilt while DIR/venv/bin/python imports llama_cpp 0.3.36 and the tools are there.
# One compile of llama.cpp serves both: the Python package is installed without building
# (LLAMA_BUILD=OFF) and gets the shared libraries of the tools' build in llama_cpp/lib, where its
# loader looks. Needs cmake, a C++ compiler and PyPI (for the sdist); about 6 minutes on 2 cores.
set -euo pipefail
VERSION=0.3.36
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/edge-oracle/llama-cpp-python-$VERSION}
PY=$DIR/venv/bin/python
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
TOOLS="llama-quantize llama-imatrix llama-perplexity"

ready() {
    [ -x "$PY" ] || return 1
    for t in $TOOLS; do [ -x "$DIR/venv/bin/$t" ] || return 1; done
    "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" >/dev/null 2>&1
}

if ready; then
    echo "llama.cpp oracle: reusing $DIR" >&2
    echo "$PY"
    exit 0
fi
for cmd in cmake c++ python3; do
    command -v "$cmd" >/dev/null || { echo "build_oracle: $cmd is needed to build llama.cpp" >&2; exit 1; }
done
echo "llama.cpp oracle: building llama-cpp-python $VERSION and llama.cpp's tools in $DIR (once, a few minutes)" >&2
# an unfinished earlier build (ready() said no): only what this script makes, DIR may hold more
rm -rf "$DIR/venv" "$DIR/src" "$DIR/build"
mkdir -p "$DIR/src"
cd "$DIR"
python3 -m venv venv
venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d src "llama-cpp-python==$VERSION"
tar -xzf "src/llama_cpp_python-$VERSION.tar.gz" -C src
SRC=$PWD/src/llama_cpp_python-$VERSION
# llama.cpp as llama-cpp-python's CMakeLists.txt builds it (shared libraries, no curl), plus the tools
cmake -S "$SRC/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
cmake --build build -j "$JOBS" --target llama ggml $TOOLS >>build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
# the Python package alone, then the libraries where llama_cpp loads them from
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" venv/bin/pip install -q --disable-pip-version-check "$SRC" \
    >>build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
LIB=$(venv/bin/python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')")
mkdir -p "$LIB"
cp -P build/bin/*.so* "$LIB"/
for t in $TOOLS; do cp build/bin/$t venv/bin/; done
# the tools find the libraries beside them ($ORIGIN)
cp -P build/bin/*.so* venv/bin/
rm -rf build src
ready || { echo "build_oracle: the build in $DIR does not import llama_cpp $VERSION" >&2; exit 1; }
echo "$PY"
