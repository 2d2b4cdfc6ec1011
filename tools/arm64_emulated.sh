#!/usr/bin/env bash
# edge on arm64 (aarch64) under qemu user-mode emulation, on an x86-64 Debian/Ubuntu machine.
#
# Builds (once) a Debian bookworm arm64 root with debootstrap, a venv in it with numpy, numba and
# llvmlite's aarch64 wheels and edge installed from this checkout (`pip install -e .[test]`), then
# runs a smoke check, the chosen kernel test files for each chosen numba target, and one greedy
# golden of a real model, printing the time of every step. Idempotent: a second run reuses the root,
# the venv and the numba caches (delete $EDGE_ARM64_DIR for a cold run).
#
#     tools/arm64_emulated.sh                     # build if needed, then smoke + tests + golden
#     tools/arm64_emulated.sh shell               # an interactive shell in the root (venv on PATH)
#     tools/arm64_emulated.sh run CMD ARGS...     # one command in the root, cwd /src/edge
#     tools/arm64_emulated.sh setup               # only build/refresh the root, venv and checkout copy
#     tools/arm64_emulated.sh umount              # undo the bind mounts this script made
#
# Environment:
#   EDGE_ARM64_DIR      where the root lives (default ~/.cache/edge-arm64; root in $EDGE_ARM64_DIR/root)
#   EDGE_ARM64_TESTS    test files to run, space-separated (default below; "none" skips the tests)
#   EDGE_ARM64_TARGETS  numba targets, space-separated NAME=NUMBA_CPU_NAME[:NUMBA_CPU_FEATURES]
#                       (default "m1=apple-m1 dotprod=generic:+neon,+dotprod"; "none" skips the tests)
#   EDGE_ARM64_GOLDEN   "gemma3-270m:8" (default): golden id and tokens of `edge run --temp 0`; "none" skips
#   EDGE_ARM64_PYTEST   extra pytest arguments (e.g. "-k q8_0")
#   EDGE_ARM64_MIRROR   Debian mirror (default http://deb.debian.org/debian)
#   NUMPY_VERSION NUMBA_VERSION LLVMLITE_VERSION   pins (default: those of ./.venv if it exists, else below)
#   EDGE_GOLDEN_DIR     llama.cpp's goldens (default ../shared/golden beside the checkout)
#   EDGE_MODELS_DIR     models to bind read-only into the root (default ~/.cache/edge/models)
#
# Needs root for debootstrap, mount and chroot: run as root, or as a user with sudo (then `sudo -n`
# is used for those commands). binfmt_misc must accept qemu-aarch64 (it does in a privileged
# container or VM; the script mounts binfmt_misc and enables Debian's qemu-aarch64 entry).
set -euo pipefail

ROOT_SRC=$(cd "$(dirname "$0")/.." && pwd)
DIR=${EDGE_ARM64_DIR:-$HOME/.cache/edge-arm64}
R=$DIR/root
LOGS=$DIR/logs
MIRROR=${EDGE_ARM64_MIRROR:-http://deb.debian.org/debian}
TESTS=${EDGE_ARM64_TESTS:-"tests/test_ggml_types.py tests/test_matmul_shared.py tests/test_quantize_act.py tests/test_dequant.py tests/test_llama_ops.py tests/test_arch_files.py tests/test_matmul.py"}
TARGETS=${EDGE_ARM64_TARGETS:-"m1=apple-m1 dotprod=generic:+neon,+dotprod"}
GOLDEN_RUN=${EDGE_ARM64_GOLDEN:-gemma3-270m:8}
GOLDEN_DIR=${EDGE_GOLDEN_DIR:-$ROOT_SRC/../shared/golden}
MODELS_DIR=${EDGE_MODELS_DIR:-$HOME/.cache/edge/models}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "arm64: not root and no sudo" >&2; exit 1; }
    SUDO="sudo -n"
fi

_pin() {  # _pin NAME DEFAULT: the version of NAME in ./.venv, else DEFAULT
    local v=""
    [ -x "$ROOT_SRC/.venv/bin/python" ] && v=$("$ROOT_SRC/.venv/bin/python" -c \
        "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true)
    echo "${v:-$2}"
}
NUMPY_VERSION=${NUMPY_VERSION:-$(_pin numpy 2.4.6)}
NUMBA_VERSION=${NUMBA_VERSION:-$(_pin numba 0.68.1)}
LLVMLITE_VERSION=${LLVMLITE_VERSION:-$(_pin llvmlite 0.50.0)}

declare -a SUMMARY=()
_now() { date +%s.%N; }
_secs() { awk -v a="$1" -v b="$(_now)" 'BEGIN { printf "%.0f", b - a }'; }
step() {  # step NAME CMD...: run and time CMD, log in $LOGS/NAME.log, fail loudly
    local name=$1; shift
    local t0; t0=$(_now)
    echo "== $name"
    local rc
    set +e
    ( set -e; "$@" ) >"$LOGS/$name.log" 2>&1   # not under `if`: there bash would ignore set -e
    rc=$?
    set -e
    if [ $rc = 0 ]; then
        SUMMARY+=("$(printf '%-34s %6ss  ok' "$name" "$(_secs "$t0")")")
        echo "   $(_secs "$t0") s"
    else
        SUMMARY+=("$(printf '%-34s %6ss  FAILED (exit %s)' "$name" "$(_secs "$t0")" "$rc")")
        echo "arm64: step $name failed (exit $rc); last lines of $LOGS/$name.log:" >&2
        tail -n 20 "$LOGS/$name.log" >&2
        print_summary
        exit 1
    fi
}
print_summary() {
    echo
    echo "== arm64 emulated summary ($R)"
    printf '%s\n' "${SUMMARY[@]}"
}

# inside the root: env -i (no host PIP_*, NUMBA_*, ...), the venv first on PATH, numba's cache in
# the root; NUMBA_CPU_NAME / NUMBA_CPU_FEATURES / NUMBA_CACHE_DIR pass through when set
in_root() {
    $SUDO chroot "$R" /usr/bin/env -i PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
        HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/var/cache/numba}" \
        ${NUMBA_CPU_NAME:+NUMBA_CPU_NAME=$NUMBA_CPU_NAME} ${NUMBA_CPU_FEATURES:+NUMBA_CPU_FEATURES=$NUMBA_CPU_FEATURES} \
        ${EDGE_TARGETS:+EDGE_TARGETS=$EDGE_TARGETS} \
        /bin/sh -c 'cd /src/edge 2>/dev/null || cd /; exec "$@"' sh "$@"
}

host_tools() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
    command -v update-binfmts >/dev/null 2>&1 || missing+=(binfmt-support)
    command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        $SUDO apt-get update -qq
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
}

binfmt() {
    [ -e /proc/sys/fs/binfmt_misc/status ] || $SUDO mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || $SUDO update-binfmts --enable qemu-aarch64 \
        || $SUDO update-binfmts --import qemu-aarch64
    grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64
    cat /proc/sys/fs/binfmt_misc/qemu-aarch64
}

debootstrap_stage1() {
    # a half-built root from an interrupted run: never rm -rf through bind mounts of /dev, /proc ...
    local m
    for m in $(findmnt -rn -o TARGET | grep "^$R/" | sort -r); do $SUDO umount -l "$m"; done
    $SUDO rm -rf --one-file-system "$R"
    $SUDO mkdir -p "$R"
    $SUDO debootstrap --arch=arm64 --foreign --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$R" "$MIRROR"
    # without binfmt's F flag (interpreter opened at registration) the chroot needs qemu inside
    $SUDO install -D -m 755 "$(command -v qemu-aarch64-static)" "$R/usr/bin/qemu-aarch64-static"
    $SUDO install -D -m 755 "$(command -v qemu-aarch64-static)" "$R/usr/libexec/qemu-binfmt/aarch64-binfmt-P"
}

debootstrap_stage2() {
    $SUDO chroot "$R" /debootstrap/debootstrap --second-stage
    $SUDO touch "$R/.edge-stage2-done"
}

MOUNTED=()
mounts() {
    local d
    for d in proc sys dev dev/pts; do
        if ! mountpoint -q "$R/$d"; then
            $SUDO mkdir -p "$R/$d"
            $SUDO mount --bind "/$d" "$R/$d"
            MOUNTED+=("$R/$d")
        fi
    done
    if [ -d "$MODELS_DIR" ] && ! mountpoint -q "$R/root/.cache/edge/models"; then
        $SUDO mkdir -p "$R/root/.cache/edge/models"
        $SUDO mount --bind "$MODELS_DIR" "$R/root/.cache/edge/models"
        $SUDO mount -o remount,bind,ro "$R/root/.cache/edge/models"
        MOUNTED+=("$R/root/.cache/edge/models")
    fi
}
umount_all() {
    local i
    for (( i=${#MOUNTED[@]}-1; i>=0; i-- )); do $SUDO umount -l "${MOUNTED[$i]}" || true; done
    MOUNTED=()
}

net_config() {
    $SUDO cp /etc/resolv.conf "$R/etc/resolv.conf"
    # extra CAs of this host (e.g. a TLS-inspecting egress proxy): without them pip fails TLS
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        local changed=0 f
        for f in /usr/local/share/ca-certificates/*.crt; do
            cmp -s "$f" "$R/usr/local/share/ca-certificates/$(basename "$f")" && continue
            $SUDO cp "$f" "$R/usr/local/share/ca-certificates/"; changed=1
        done
        [ $changed = 0 ] || in_root update-ca-certificates
    fi
}

venv() {
    [ -x "$R/opt/venv/bin/python" ] || in_root python3 -m venv /opt/venv
    in_root env PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 pip install --only-binary=:all: \
        "numpy==$NUMPY_VERSION" "numba==$NUMBA_VERSION" "llvmlite==$LLVMLITE_VERSION"
}

copy_checkout() {
    # the checkout as it is (uncommitted changes too), without venvs, caches and git
    $SUDO rm -rf "$R/src/edge.new"
    $SUDO mkdir -p "$R/src/edge.new"
    tar -C "$ROOT_SRC" -cf - --exclude=./.venv --exclude=./.git --exclude='__pycache__' \
        --exclude='*.egg-info' --exclude=.pytest_cache . | $SUDO tar -C "$R/src/edge.new" -xf -
    $SUDO rm -rf "$R/src/edge"
    $SUDO mv "$R/src/edge.new" "$R/src/edge"
    if [ -d "$GOLDEN_DIR" ]; then
        $SUDO mkdir -p "$R/src/shared"
        $SUDO rm -rf "$R/src/shared/golden"
        $SUDO cp -a "$GOLDEN_DIR" "$R/src/shared/golden"
    fi
}

install_edge() {
    # again only when pyproject.toml changed (the install is editable: sources are read from /src/edge)
    local sum; sum=$(sha256sum "$ROOT_SRC/pyproject.toml" | cut -d' ' -f1)
    if [ "$($SUDO cat "$R/opt/venv/.edge-pyproject" 2>/dev/null)" != "$sum" ]; then
        in_root env PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
            pip install --prefer-binary -e '.[test]'
        echo "$sum" | $SUDO tee "$R/opt/venv/.edge-pyproject" >/dev/null
    else
        # the editable install points at /src/edge, recopied above: only the metadata is new
        in_root python -c "import edge, kernels_cpu; print(edge.__file__)"
    fi
}

setup() {
    mkdir -p "$DIR" 2>/dev/null || $SUDO mkdir -p "$DIR"
    $SUDO mkdir -p "$LOGS"; $SUDO chmod a+rwx "$LOGS"
    step host-tools host_tools
    step binfmt binfmt
    if [ ! -e "$R/.edge-stage2-done" ]; then
        step debootstrap-stage1 debootstrap_stage1
        step debootstrap-stage2 debootstrap_stage2
    fi
    mounts
    step net-config net_config
    step venv-numba venv
    step copy-checkout copy_checkout
    step install-edge install_edge
    SUMMARY+=("$(printf '%-34s %s' "root size" "$($SUDO du -sh "$R" --exclude="$R/proc" --exclude="$R/sys" \
        --exclude="$R/dev" --exclude="$R/root/.cache/edge/models" 2>/dev/null | cut -f1)")")
}

smoke() {
    in_root python -c "import platform, kernels_cpu.simd as s; print(platform.machine(), s.kernel_path(), s.cpu_target())"
    in_root edge --version
}

run_tests() {
    local spec name cpu feats f t0 log counts
    local -a extra=()
    eval "extra=(${EDGE_ARM64_PYTEST:-})"   # shell words: -k 'a or b' stays one expression
    for spec in $TARGETS; do
        name=${spec%%=*}; cpu=${spec#*=}; feats=""
        case $cpu in *:*) feats=${cpu#*:}; cpu=${cpu%%:*} ;; esac
        for f in $TESTS; do
            log="$LOGS/test-$name-$(basename "$f" .py).log"
            t0=$(_now)
            echo "== $name ($cpu${feats:+ $feats}): $f"
            set +e
            NUMBA_CPU_NAME=$cpu NUMBA_CPU_FEATURES=$feats NUMBA_CACHE_DIR=/var/cache/numba-$name \
                EDGE_TARGETS=none in_root python -m pytest -q -p no:cacheprovider \
                "${extra[@]}" "$f" >"$log" 2>&1
            local rc=$?
            set -e
            counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|deselected)' "$log" | tail -n 1 | tr -d '=' | xargs)
            SUMMARY+=("$(printf '%-34s %6ss  %s' "$name $(basename "$f")" "$(_secs "$t0")" "${counts:-exit $rc}")")
            echo "   $(_secs "$t0") s: ${counts:-exit $rc}"
            [ $rc = 0 ] || FAILED=1
        done
    done
}

golden_run() {
    local id=${GOLDEN_RUN%%:*} n=${GOLDEN_RUN#*:} model
    case $id in
        gemma3-270m) model=gemma-3-270m ;;
        smollm2-135m) model=smollm2-135m-instruct ;;
        qwen2.5-coder-0.5b) model=qwen2.5-coder-0.5b-instruct ;;
        *) model=$id ;;
    esac
    # (through $SUDO: the root's /root is mode 700)
    if ! $SUDO test -f "$R/root/.cache/edge/models/$model.gguf" || [ ! -f "$R/src/shared/golden/$id/greedy.json" ]; then
        SUMMARY+=("$(printf '%-34s %s' "golden $id" "skipped: no $model.gguf in $MODELS_DIR or no golden")")
        return 0
    fi
    local t0; t0=$(_now)
    echo "== golden $id: edge run --temp 0 -n $n"
    set +e
    NUMBA_CACHE_DIR=/var/cache/numba-golden in_root python - "$model" "$id" "$n" >"$LOGS/golden-$id.log" 2>&1 <<'EOF'
import json, subprocess, sys
model, gid, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
case = json.load(open(f"/src/shared/golden/{gid}/greedy.json"))["cases"][0]
out = subprocess.run(["edge", "run", "-m", model, "--raw", "--temp", "0", "-n", str(n), "-t", "1",
                      case["prompt"]], capture_output=True, text=True, timeout=3600)
print("stderr:", out.stderr[-2000:])
got = out.stdout
print("prompt:", repr(case["prompt"]))
print("edge:  ", repr(got))
print("golden:", repr(case["greedy_text"]))
ok = out.returncode == 0 and case["greedy_text"].startswith(got.strip("\n")) and got.strip()
print("MATCH" if ok else "DIFFER")
sys.exit(0 if ok else 1)
EOF
    local rc=$?
    set -e
    SUMMARY+=("$(printf '%-34s %6ss  %s' "golden $id ($n tokens)" "$(_secs "$t0")" "$(tail -n 1 "$LOGS/golden-$id.log")")")
    [ $rc = 0 ] || FAILED=1
}

trap umount_all EXIT
FAILED=0
case "${1:-all}" in
    setup) setup; print_summary ;;
    shell) [ -e "$R/.edge-stage2-done" ] || setup; mounts; in_root /bin/bash -i ;;
    run) shift; [ -e "$R/.edge-stage2-done" ] || setup; mounts; in_root "$@" ;;
    umount) for d in root/.cache/edge/models dev/pts dev sys proc; do
                mountpoint -q "$R/$d" && $SUDO umount -l "$R/$d"; done; true ;;
    all)
        setup
        step smoke smoke
        cat "$LOGS/smoke.log"
        [ "$TESTS" = none ] || [ "$TARGETS" = none ] || run_tests
        [ "$GOLDEN_RUN" = none ] || golden_run
        print_summary
        exit $FAILED ;;
    *) echo "usage: $0 [all|setup|shell|run CMD...|umount]" >&2; exit 2 ;;
esac
