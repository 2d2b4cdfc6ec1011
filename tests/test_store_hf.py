"""`edge pull hf.co/USER/REPO[:QUANT]` and Hub file URLs (edge/store_hf.py), against a local
server that answers huggingface_hub's endpoints (tests/hub_server.py) in place of the Hub.

In-process tests point huggingface_hub's import-time constants (endpoint, token file, its
agent-registry cache) into tmp_path, and make http_get write in 64 KiB pieces (10 MiB by
default, so that a connection dropped after a few hundred KB leaves bytes to resume from);
the CLI tests run `edge` in a subprocess with HF_ENDPOINT and HF_HOME set.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge import store, store_hf
from edge.store import StoreError
from tests.hub_server import FakeHub
from tests.tiny_models import write_tiny_model

REPO = "alice/Tiny-GGUF"
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def payloads(tmp_path_factory) -> dict[str, bytes]:
    """A runnable tiny llama GGUF (the Q8_0 file) and 1 MB of random bytes (the Q4_K_M file)."""
    path = write_tiny_model(tmp_path_factory.mktemp("hf") / "tiny.gguf", arch="llama")
    return {"tiny": path.read_bytes(), "big": os.urandom(1_000_000)}


@pytest.fixture
def hub(monkeypatch, tmp_path, payloads):
    import huggingface_hub.constants as C

    h = FakeHub()
    h.add_repo(REPO, {"README.md": b"# tiny\n", "tiny-Q4_K_M.gguf": payloads["big"],
                      "tiny-Q8_0.gguf": payloads["tiny"], "mmproj-tiny-F16.gguf": b"m" * 2000})
    h.add_repo("alice/one-file", {"SmolThing.Q4_1.gguf": payloads["tiny"]})
    h.add_repo("alice/no-label", {"only-model.gguf": payloads["tiny"]})
    h.add_repo("alice/gated", {"g-Q4_K_M.gguf": payloads["tiny"]}, gated=True)
    for name, value in (("HF_ENDPOINT", h.url), ("EDGE_HOME", str(tmp_path / "edge")), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(C, "ENDPOINT", h.url)
    monkeypatch.setattr(C, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(C, "AGENT_HARNESSES_PATH", str(tmp_path / "hf" / "agents.json"))
    monkeypatch.setattr(C, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    yield h
    h.close()


def _models(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "edge" / "models").iterdir())


def _edge(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge.cli", *args], capture_output=True, text=True, check=False,
                          timeout=timeout, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------------- names
@pytest.mark.parametrize("name, want", [
    ("hf.co/alice/Tiny-GGUF", ("alice", "Tiny-GGUF", None, None)),
    ("hf.co/alice/Tiny-GGUF:q4_k_m", ("alice", "Tiny-GGUF", "Q4_K_M", None)),
    ("huggingface.co/alice/Tiny-GGUF:Q8_0", ("alice", "Tiny-GGUF", "Q8_0", None)),
    ("hf.co/alice/Tiny-GGUF:latest", ("alice", "Tiny-GGUF", None, None)),
    ("hf.co--alice--Tiny-GGUF--Q8_0", ("alice", "Tiny-GGUF", "Q8_0", None)),
    ("https://huggingface.co/alice/Tiny-GGUF/resolve/main/sub/tiny-IQ4_XS.gguf?download=true",
     ("alice", "Tiny-GGUF", "IQ4_XS", "sub/tiny-IQ4_XS.gguf")),
    ("https://huggingface.co/alice/Tiny-GGUF/blob/main/model.gguf", ("alice", "Tiny-GGUF", "model", "model.gguf")),
])
def test_parse(name, want):
    ref = store_hf.parse(name)
    assert (ref.user, ref.repo, ref.tag, ref.filename) == want
    assert store_hf.is_hub_name(name)


@pytest.mark.parametrize("name", ["hf.co/alice", "hf.co/../etc:Q4_0", "hf.co/a--b/c", "hf.co/alice/x:a/b",
                                  "https://huggingface.co/alice/x/resolve/main/model.bin",
                                  "https://huggingface.co/alice/x/resolve/main/../../y.gguf"])
def test_parse_refuses(name):
    with pytest.raises(ValueError, match="Hub|bad|not"):
        store_hf.parse(name)


def test_tag_of_and_choice():
    files = [store_hf.HubFile(n, 1, None, None) for n in
             ("m-Q4_K.gguf", "m-Q4_K_M.gguf", "m-IQ4_0.gguf", "m-Q4_0.gguf", "mmproj-Q4_0.gguf", "README.md")]
    pick = lambda tag: store_hf.choose(files, store_hf.HubRef("a", "b", tag=tag))
    assert pick(None)[0].path == "m-Q4_K_M.gguf" and pick(None)[1] == "Q4_K_M"
    assert pick("Q4_K")[0].path == "m-Q4_K.gguf"        # not Q4_K_M
    assert pick("Q4_0")[0].path == "m-Q4_0.gguf"        # not IQ4_0, not the mmproj file
    with pytest.raises(ValueError, match="no .gguf files for Q8_0; its .gguf files: m-IQ4_0.gguf, m-Q4_0.gguf"):
        pick("Q8_0")
    assert store_hf.tag_of("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert store_hf.tag_of("plain model.gguf") == "plain-model"


# ---------------------------------------------------------------------- pull
def test_pull_default_quant_list_and_offline_resolve(hub, payloads, tmp_path):
    path = store.pull(f"hf.co/{REPO}", progress=False)
    assert path.name == "hf.co--alice--Tiny-GGUF--Q4_K_M.gguf" and path.read_bytes() == payloads["big"]
    assert path.stat().st_mode & 0o777 == 0o644
    assert [e["path"] for e in hub.log if e["method"] == "GET" and "/cdn/" in e["path"]] == \
        [f"/cdn/{hashlib.sha256(payloads['big']).hexdigest()}"]  # the Q4_K_M file only, once
    assert _models(tmp_path) == [".hf.co--alice--Tiny-GGUF--Q4_K_M.gguf.lock", ".hf.co--alice--Tiny-GGUF--Q4_K_M.hf.json",
                                 path.name]
    store.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    names = {m["name"]: m for m in store.list_models()}
    assert set(names) == {f"hf.co/{REPO}:Q4_K_M", f"hf.co/{REPO}:Q8_0"}
    assert names[f"hf.co/{REPO}:Q8_0"]["architecture"] == "llama"
    assert names[f"hf.co/{REPO}:Q4_K_M"]["error"] is not None   # random bytes: not a GGUF

    hub.close()                                                 # no Hub from here on
    n = len(hub.log)
    assert store.resolve_model(f"hf.co/{REPO}:Q4_K_M", pull_missing=False) == path
    assert store.resolve_model(f"hf.co/{REPO}") == path         # no tag: the Q4_K_M one
    assert store.resolve_model("hf.co--alice--Tiny-GGUF--Q8_0").name == "hf.co--alice--Tiny-GGUF--Q8_0.gguf"
    assert store.pull(f"hf.co/{REPO}:q4_k_m", progress=False, verify=True) == path
    with pytest.raises(StoreError, match=f"not pulled; run: edge pull hf.co/{REPO}:F16"):
        store.resolve_model(f"hf.co/{REPO}:F16", pull_missing=False)
    assert len(hub.log) == n


def test_without_a_tag_run_takes_the_one_stored_but_pull_asks_the_hub(hub, payloads):
    q8 = store.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert store.resolve_model(f"hf.co/{REPO}", pull_missing=False) == q8
    assert store.pull(f"hf.co/{REPO}", progress=False).name == "hf.co--alice--Tiny-GGUF--Q4_K_M.gguf"


def test_only_gguf_of_a_repo_and_url(hub, payloads):
    path = store.pull("hf.co/alice/one-file", progress=False)
    assert path.name == "hf.co--alice--one-file--Q4_1.gguf" and path.read_bytes() == payloads["tiny"]
    url = f"{hub.url}/{REPO}/resolve/main/tiny-Q8_0.gguf"
    path = store.pull(url, progress=False)
    assert path.name == "hf.co--alice--Tiny-GGUF--Q8_0.gguf" and path.read_bytes() == payloads["tiny"]
    assert store.resolve_model(url, pull_missing=False) == path


def test_a_file_without_a_quant_label_is_found_by_its_listed_name(hub, payloads):
    """A repo's only .gguf with no quant label in its name is stored under its stem, listed as
    hf.co/USER/REPO:stem, and that name (any case) finds it without the Hub."""
    path = store.pull("hf.co/alice/no-label", progress=False)
    assert path.name == "hf.co--alice--no-label--only-model.gguf"
    assert [m["name"] for m in store.list_models()] == ["hf.co/alice/no-label:only-model"]
    hub.close()
    for name in ("hf.co/alice/no-label:only-model", "hf.co/alice/no-label:ONLY-MODEL", path.stem):
        assert store.resolve_model(name, pull_missing=False) == path, name


def test_a_dropped_connection_resumes_with_a_range_request(hub, payloads):
    """The server closes the first GET after 300,000 bytes; huggingface_hub's http_get asks for
    the rest (Range: bytes=N-, N the bytes it had written: whole 64 KiB pieces) and no byte
    before N is sent twice."""
    hub.drop_after["tiny-Q4_K_M.gguf"] = 300_000
    path = store.pull(f"hf.co/{REPO}:Q4_K_M", progress=False)
    assert path.read_bytes() == payloads["big"]
    first, second = hub.gets("/cdn/")
    kept = 300_000 // CHUNK * CHUNK
    assert (first["range"], first["sent"]) == (None, 300_000)
    assert (second["range"], second["status"], second["sent"]) == (f"bytes={kept}-", 206, len(payloads["big"]) - kept)


def test_an_interrupted_pull_is_resumed_by_the_next(hub, payloads, tmp_path):
    """Ctrl+C during `edge pull` (the server stalls after 500,000 bytes) keeps the .incomplete
    file; the next pull sends Range: bytes=<its size>- and gets only the rest."""
    hub.stall_after["tiny-Q4_K_M.gguf"] = 500_000
    # a child that writes in 64 KiB pieces too (its huggingface_hub is imported fresh)
    code = ("import huggingface_hub.constants as C, sys; C.DOWNLOAD_CHUNK_SIZE = 65536; "
            "from edge.cli import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code, "pull", f"hf.co/{REPO}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stalled.wait(60), "the pull never reached the server"
        partial = tmp_path / "edge" / "models" / f".hf.co--alice--Tiny-GGUF--Q4_K_M.gguf.{hashlib.sha256(payloads['big']).hexdigest()[:16]}.incomplete"
        kept = 500_000 // CHUNK * CHUNK
        for _ in range(200):
            if partial.is_file() and partial.stat().st_size == kept:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        hub.release.set()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "edge pull: interrupted; the partial download is kept: pulling it again resumes it"
    assert partial.stat().st_size == kept
    path = store.pull(f"hf.co/{REPO}", progress=False)
    assert path.read_bytes() == payloads["big"] and not partial.exists()
    first, second = hub.gets("/cdn/")
    assert first["range"] is None
    assert (second["range"], second["sent"]) == (f"bytes={kept}-", len(payloads["big"]) - kept)


def test_sha256_mismatch_deletes_the_download(hub, payloads, tmp_path):
    hub.add_repo("alice/bad", {"b-Q4_K_M.gguf": payloads["tiny"]}, lfs_sha256={"b-Q4_K_M.gguf": "0" * 64})
    with pytest.raises(StoreError) as e:
        store.pull("hf.co/alice/bad", progress=False)
    assert str(e.value) == (f"hf.co/alice/bad: b-Q4_K_M.gguf: sha256 mismatch: expected {'0' * 64}, "
                            f"got {hashlib.sha256(payloads['tiny']).hexdigest()}")
    assert [n for n in _models(tmp_path) if not n.endswith(".lock")] == []


def test_gated_repo_needs_hf_token_and_the_token_goes_to_the_hub_only(hub, payloads, monkeypatch):
    with pytest.raises(StoreError, match=r"^hf.co/alice/gated is gated: accept its terms on .* and set HF_TOKEN"):
        store.pull("hf.co/alice/gated", progress=False)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert store.pull("hf.co/alice/gated", progress=False).read_bytes() == payloads["tiny"]
    assert {e["auth"] for e in hub.log if "gated" in e["path"]} == {None, f"Bearer {hub.token}"}
    # a URL on another host than HF_ENDPOINT gets no token
    other = FakeHub()
    try:
        other.add_repo("bob/x", {"x-Q8_0.gguf": payloads["tiny"]})
        store.pull(f"{other.url}/bob/x/resolve/main/x-Q8_0.gguf", progress=False)
        assert other.log and all(e["auth"] is None for e in other.log)
    finally:
        other.close()


def test_a_second_pull_of_the_same_file_is_refused_while_one_runs(hub):
    dest = store.models_dir() / "hf.co--alice--Tiny-GGUF--Q8_0.gguf"
    dest.parent.mkdir(parents=True)
    with store_hf.lock(dest), pytest.raises(StoreError, match="another edge pull is downloading hf.co/alice/Tiny-GGUF:Q8_0"):
        store.pull(f"hf.co/{REPO}:Q8_0", progress=False)


# ---------------------------------------------------------------------- the CLI
def test_cli_errors_are_one_line(hub):
    cases = [
        (["pull", "hf.co/alice/nope"], {}, ("edge pull: error: hf.co/alice/nope: no such model repository on "
                                            f"{hub.url} (HTTP 404; if it is private, set HF_TOKEN)")),
        (["pull", f"hf.co/{REPO}:Q5_K_M"], {}, (f"edge pull: error: hf.co/{REPO}:Q5_K_M: hf.co/{REPO} has no .gguf "
                                                 "files for Q5_K_M; its .gguf files: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf")),
        (["pull", f"hf.co/{REPO}"], {"HF_HUB_OFFLINE": "1"},
         f"edge pull: error: cannot fetch hf.co/{REPO}: offline mode is on (HF_HUB_OFFLINE); unset it to download"),
        (["pull", f"hf.co/{REPO}"], {"HF_ENDPOINT": "http://127.0.0.1:9"}, None),
    ]
    for argv, env, want in cases:
        proc = _edge(*argv, env=env)
        assert proc.returncode == 1 and proc.stdout == "", (argv, proc.stderr)
        assert proc.stderr.count("\n") == 1, (argv, proc.stderr)
        if want is None:
            assert proc.stderr.startswith(f"edge pull: error: cannot reach http://127.0.0.1:9 for hf.co/{REPO} ("), proc.stderr
        else:
            assert proc.stderr == want + "\n"


def test_cli_pull_list_and_run_without_network(hub, tmp_path):
    proc = _edge("pull", f"hf.co/{REPO}:Q8_0")
    path = tmp_path / "edge" / "models" / "hf.co--alice--Tiny-GGUF--Q8_0.gguf"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"hf.co/{REPO}:Q8_0: {path}\n"
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "COLUMNS": "200"}
    proc = _edge("list", env=offline)
    assert proc.returncode == 0 and f"hf.co/{REPO}:Q8_0" in proc.stdout and "llama" in proc.stdout, proc.stdout
    proc = _edge("run", "-m", f"hf.co/{REPO}:Q8_0", "-n", "3", "--temp", "0", "hello", env=offline, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "generated: 3 tokens" in proc.stderr
