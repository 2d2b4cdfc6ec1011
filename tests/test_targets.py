"""Every CPU (issue 23): edge's answers do not depend on the machine.

- kernel path names (kernels_cpu.simd.kernel_path) from feature sets; `edge --version` names the
  path and numba's target CPU, also for a target set by NUMBA_CPU_NAME / NUMBA_CPU_FEATURES;
- a CPU without F16C (generic x86-64): kernels_cpu imports (it built ops.GELU_TABLE through a
  missing runtime function and segfaulted) and its half conversions give F16C's bits;
- tools/check_targets.py on a small set (CI_CASES): for haswell, skylake-avx512 and generic
  x86-64 (numba compiling for that CPU in a subprocess with a numba cache of its own) the
  logits are this process's (the host's, AVX-512 VNNI) to the bit and hold to llama.cpp's
  outputs. About 2 minutes with cold caches on the 2-core machine (haswell 47 s, x86-64 39 s,
  skylake-avx512 22 s). EDGE_TARGETS picks the targets ("all" adds alderlake and znver4;
  "none" skips the comparison, for a quick local run only).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu import TargetError, simd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_targets as ct  # noqa: E402

# target -> (tiny cases, golden prompts): the smallest set that takes each path, since a cold
# compile costs a minute or more per target on 2 cores (the README's "Every CPU"): haswell's
# AVX2 int8 tiles, generic K-quant tiles and exp without AVX-512 on the real gemma-3-270m
# (Q5_0, Q8_0, Q4_K, Q6_K; GELU; 48 decode steps); skylake-avx512's AVX2 tiles with AVX-512's
# exp, and generic x86-64's plain vectors without F16C or FMA (the half conversions and fmas
# through edge's runtime functions and the C library), on the tiny Q8_0 llama3.
CI_CASES = {"haswell": ([], ["gemma3-270m:0"]), "skylake-avx512": (["llama3-q8_0"], []),
            "x86-64": (["llama3-q8_0"], [])}
# EDGE_TARGETS: the targets to compare (comma-separated, each on CI_CASES' set or, if it has
# none, llama3-q8_0; "all": every target of tools/check_targets.py; "none": skip, for a quick
# local run only; tools/check_targets.py runs every case on every target)
_asked = os.environ.get("EDGE_TARGETS", ",".join(CI_CASES))
TARGETS = [t for t in (ct.DEFAULT_TARGETS if _asked == "all" else _asked.split(",")) if t and t != "none"]
CASES = {t: CI_CASES.get(t, (["llama3-q8_0"], [])) for t in TARGETS}


@pytest.mark.parametrize("features, path", [
    ({"+avx2", "+fma", "+f16c", "+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni"}, "avx512-vnni"),
    ({"+avx2", "+avx512f", "+avx512bw", "+avx512vl"}, "avx512"),
    ({"+avx2", "+avx512f", "+avx512vnni"}, "avx512"),        # VNNI without VL / BW: not the VNNI tiles
    ({"+avx2", "+avx512bw", "+avx512vl", "+avx512vnni"}, "avx2"),  # AVX-512 F off: LLVM turns off the rest
    ({"+avx2", "+avxvnni", "+fma"}, "avx-vnni"),             # Alder Lake: vpdpbusd ymm (VEX) in the AVX2 int8 tiles
    ({"+avx2", "+avxvnni", "+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni"}, "avx512-vnni"),  # Sapphire Rapids, Zen 5
    ({"+avx2"}, "avx2"),
    ({"+sse2", "+sse4.2"}, "generic"),
    (set(), "generic"),
    ({"+neon", "+dotprod", "+i8mm"}, "neon-i8mm"),        # arm64: sdot tiles, smmla in the 8-row Q4_K tiles
    ({"+neon", "+dotprod"}, "neon-dotprod"),
    ({"+neon", "+i8mm"}, "neon"),                          # smmla without sdot: not a path
    ({"+neon", "+fp-armv8"}, "neon"),
])
def test_kernel_path_names(features, path):
    assert simd.kernel_path(frozenset(features)) == path


@pytest.mark.parametrize("cpu, listed, has, lacks", [
    ("generic", "", {"+neon"}, {"+dotprod"}),                      # qemu-user: LLVM lists nothing
    ("apple-m1", "", {"+neon", "+dotprod"}, {"+i8mm"}),
    ("apple-m2", "", {"+neon", "+dotprod", "+i8mm"}, set()),
    ("apple-m2", "-i8mm", {"+neon", "+dotprod"}, {"+i8mm"}),        # a "-" feature is kept off
    ("cortex-a53", "+crc", {"+neon", "+crc"}, {"+dotprod"}),
])
def test_arm64_features_from_cpu_name(monkeypatch, cpu, listed, has, lacks):
    """On an arm64 process triple, target_features adds NEON (every Armv8-A CPU) and the features
    the CPU's LLVM name implies, which LLVM's host query misses under qemu-user and on macOS."""
    from llvmlite import binding
    from numba.core import config

    monkeypatch.setattr(binding, "get_process_triple", lambda: "aarch64-unknown-linux-gnu")
    monkeypatch.setattr(config, "CPU_NAME", cpu)
    monkeypatch.setattr(config, "CPU_FEATURES", listed)
    features = simd.target_features()
    assert has <= features and not lacks & features
    assert simd.kernel_path(features) == ("neon-i8mm" if "+i8mm" in has else "neon-dotprod" if "+dotprod" in has
                                          else "neon")


class _Features:
    def __init__(self, text):
        self.text = text

    def flatten(self):
        return self.text


_ZEN4 = "+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni,-avxvnni,-amx-int8"


@pytest.mark.parametrize("cpu, listed, path", [
    (None, None, "avx512-vnni"),                  # the host's features
    (None, "-avx512vnni", "avx512"),              # only "-" features: the host's others stay on
    (None, "-avx512f", "avx2"),
    ("x86-64-v3", "", "avx2"),                    # a psABI level implies its features
    ("x86-64-v4", "", "avx512"),
    ("x86-64-v3", "-avx2", "generic"),
    ("x86-64", "", "generic"),
    ("haswell", "+avx2,+fma,+f16c", "avx2"),      # a name with a list: the list, as numba passes it
])
def test_x86_features_from_name_and_list(monkeypatch, cpu, listed, path):
    from llvmlite import binding
    from numba.core import config

    monkeypatch.setattr(binding, "get_process_triple", lambda: "x86_64-unknown-linux-gnu")
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: _Features(_ZEN4))
    monkeypatch.setattr(binding, "get_host_cpu_name", lambda: "znver4")
    monkeypatch.setattr(config, "CPU_NAME", cpu)
    monkeypatch.setattr(config, "CPU_FEATURES", listed)
    assert simd.kernel_path() == path


def test_host_lacks_names_target_features_the_cpu_does_not_have(monkeypatch):
    from llvmlite import binding
    from numba.core import config

    monkeypatch.setattr(binding, "get_process_triple", lambda: "x86_64-unknown-linux-gnu")
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: _Features(_ZEN4))
    monkeypatch.setattr(config, "CPU_NAME", "alderlake")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avxvnni,+fma,+f16c,+64bit")   # 64bit: not in the query
    assert simd.host_lacks() == ["avxvnni"]
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma")
    assert simd.host_lacks() == []


X86_HOST_CHECK = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                    reason="names LLVM's x86 target and this machine as x86_64")


@pytest.mark.parametrize("listed", ["garbage", "+avx2,fma", "+", "+avx2,+fma;"])
def test_malformed_feature_list_is_refused(monkeypatch, listed):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", listed)
    with pytest.raises(TargetError, match="is not a feature"):
        simd._check_feature_list()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f,+sse4.1,+avx512vnni,")
    simd._check_feature_list()
    for spaced in ("+avx2, +fma", " +avx2", "+avx2 "):   # LLVM took ' +fma' as a name and aborted
        monkeypatch.setattr(config, "CPU_FEATURES", spaced)
        with pytest.raises(TargetError, match="has a space"):
            simd._check_feature_list()


@X86_HOST_CHECK
@pytest.mark.parametrize("name, features, message", [
    ("apple-m2", None, "NUMBA_CPU_NAME='apple-m2' is not a CPU LLVM knows for this machine (x86_64)"),
    ("notacpu", None, "NUMBA_CPU_NAME='notacpu' is not a CPU LLVM knows for this machine (x86_64)"),
    ("haswell", "+neon,+dotprod", "NUMBA_CPU_FEATURES='+neon,+dotprod': +neon, +dotprod are not features LLVM knows"),
    (None, "+avx2,+avx512vnn", "NUMBA_CPU_FEATURES='+avx2,+avx512vnn': +avx512vnn is not a feature LLVM knows"),
])
def test_a_target_llvm_does_not_know_here_is_refused(monkeypatch, name, features, message):
    """LLVM only warned and ignored it: an arm64 name or feature on x86 then gave kernel path
    neon-i8mm and an LLVM ERROR at the first compile, a misspelt name generic code."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    with pytest.raises(TargetError) as e:
        simd._check_target()
    assert str(e.value).startswith(message)
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    monkeypatch.setattr(config, "CPU_FEATURES", ct.TARGETS["haswell"][1])
    simd._check_target()


@pytest.mark.parametrize("listed, path", [("-avx2", "generic"), ("-fma", "avx2"), ("-f16c", "avx2"),
                                          ("-avx512f", "avx2"), ("-avx512vnni", "avx512"), ("-avx", "generic"),
                                          ("+avx2,+fma,+f16c", "avx512-vnni"), ("+avx512vnni", "avx512-vnni")])
def test_turning_off_a_feature_turns_off_what_needs_it(monkeypatch, listed, path):
    """As LLVM does: -avx2 (or -fma, -f16c, -avx) on an AVX-512 VNNI CPU leaves no AVX-512, whose
    tiles LLVM then could not compile (an LLVM ERROR after kernel_path said avx512-vnni); and a
    list without NUMBA_CPU_NAME adds to the host CPU's features (+avx512vnni said generic while
    LLVM compiled for the whole host CPU)."""
    from llvmlite import binding
    from numba.core import config

    monkeypatch.setattr(binding, "get_process_triple", lambda: "x86_64-unknown-linux-gnu")
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: _Features(_ZEN4))
    monkeypatch.setattr(binding, "get_host_cpu_name", lambda: "znver4")
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", listed)
    assert simd.kernel_path(simd.target_features()) == path


def test_cli_refuses_a_malformed_feature_list_in_one_line():
    """LLVM aborted the process (an assertion, exit 134) on NUMBA_CPU_FEATURES=garbage."""
    out = _edge(["--version"], env={**os.environ, "NUMBA_CPU_FEATURES": "garbage"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["edge: NUMBA_CPU_FEATURES='garbage': 'garbage' is not a feature: give a "
                                               "comma-separated list of +name / -name, e.g. +avx2,+fma,+f16c"]


def _edge(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=env)


# x86 targets compile on an x86-64 host only (on arm64, LLVM segfaults on an x86 CPU name)
X86_HOST = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="x86 targets need an x86-64 host (tools/arm64_emulated.sh checks arm64)")


@X86_HOST
def test_version_names_kernel_path_and_target(tmp_path):
    proc = _edge(["--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"edge 0.1.0 (kernels: {simd.kernel_path()}, numba target {simd.cpu_target()})\n"
    for target, path in (("haswell", "avx2"), ("skylake-avx512", "avx512"), ("x86-64", "generic")):
        env, _ = ct.target_env(target, tmp_path)
        proc = _edge(["--version"], env)
        assert proc.stdout == f"edge 0.1.0 (kernels: {path}, numba target {target})\n", proc.stderr


_NO_F16C = """
import json, numpy as np
from numba import njit
from kernels_cpu import simd
from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.ops import GELU_TABLE

@njit
def up(h, out):
    for i in range(h.size):
        out[i] = f16_to_f32(h[i])

@njit
def down(x, out):
    for i in range(x.size):
        out[i] = f32_to_f16(x[i])

h = np.arange(1 << 16, dtype=np.uint16)
f = np.empty(h.size, np.float32)
up(h, f)
x = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
x = np.concatenate([x, np.arange(0x38000000, 0x38800000, 97, dtype=np.uint32), np.array([0x477FEFFF, 0x477FF000, 0x7F800001, 0xFFC00001], np.uint32)])
d = np.empty(x.size, np.uint16)
down(x.view(np.float32), d)
np.savez(OUT, gelu=GELU_TABLE, up=f, down=d)
print(json.dumps({"path": simd.kernel_path(), "f16c": "+f16c" in simd.target_features()}))
"""


@X86_HOST
def test_no_f16c_imports_and_converts_as_f16c(tmp_path):
    """Generic x86-64 (no F16C, no FMA): importing kernels_cpu.ops works, the GELU table and
    every f16 -> f32, and 1M f32 -> f16 conversions are this CPU's (F16C) bits, NaNs included."""
    outs = {}
    for target in ("host", "x86-64"):
        env, _ = ct.target_env(target, tmp_path / "numba")
        out = tmp_path / f"{target}.npz"
        proc = subprocess.run([sys.executable, "-c", _NO_F16C.replace("OUT", repr(str(out)))], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{target}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        outs[target] = dict(np.load(out))
    assert json.loads(proc.stdout) == {"path": "generic", "f16c": False}
    for k in ("gelu", "up", "down"):
        np.testing.assert_array_equal(outs["x86-64"][k].view(np.uint8), outs["host"][k].view(np.uint8), err_msg=k)
    up = outs["host"]["up"]
    finite = ~np.isnan(up)
    np.testing.assert_array_equal(up[finite], np.arange(1 << 16, dtype=np.uint16).view(np.float16)[finite])


@pytest.fixture(scope="module")
def host_run(tmp_path_factory) -> dict:
    """The logits of every target's cases in this process (the host's kernels)."""
    tmp = tmp_path_factory.mktemp("tiny")
    arrays = {}
    for name in sorted({c for tiny, _ in CASES.values() for c in tiny}):
        arrays.update(ct.run_tiny(name, tmp))
    for case in sorted({c for _, goldens in CASES.values() for c in goldens}):
        arrays.update(ct.run_golden(case))
    return arrays


@X86_HOST
@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_target_gives_the_hosts_logits(target, host_run, tmp_path):
    """The target's logits equal the host's to the bit (and hold to llama.cpp's outputs)."""
    if ct.expected_path(target, ct.host_features()) != ct.expected_path(target):
        pytest.skip(f"this machine lacks {target}'s {ct.expected_path(target)} instructions")
    tiny, goldens = CASES[target]
    cache = Path(os.environ.get("EDGE_TARGETS_CACHE") or tmp_path / "numba")
    r = ct.run_target(target, tiny, goldens, cache, tmp_path, timeout=1200)
    assert r["arrays"] is not None, f"{target}: exit {r['returncode']}\n{r['stderr']}"
    ref = {k: v for k, v in host_run.items() if k.split("/")[0] in tiny or k.split("/")[1] in goldens}
    same, n, worst, differ = ct.compare(ref, r["arrays"])
    print(f"{target}: kernels {r['meta']['kernel_path']}, {same}/{n} bit-equal, {r['seconds']:.0f} s"
          + (f", off: {', '.join(r['dropped'])}" if r["dropped"] else ""))
    assert n == 6 * len(tiny) + 2 * len(goldens)     # 3 prompts x (prompt, decode); (tokens, logits)
    assert r["meta"]["kernel_path"] == ct.expected_path(target)
    assert r["meta"]["cpu"] == ct.TARGETS[target][0]
    assert not differ, f"{target}: {differ} differ from the host's (max |diff| {worst:.3g})"
    assert not ct.check_llama_cpp(r["arrays"], tiny, goldens)
