"""A local HTTP server that answers the Hugging Face Hub endpoints huggingface_hub calls for a
download, standing in for the Hub in tests (``HF_ENDPOINT``):

- ``GET /api/models/{user}/{repo}/revision/{rev}?blobs=true`` (HfApi.model_info with
  files_metadata): ``id``, ``sha`` and ``siblings`` with ``size``, ``blobId`` and, for LFS
  files, ``lfs: {sha256, size, pointerSize}``;
- ``HEAD /{user}/{repo}/resolve/{rev}/{path}`` (get_hf_file_metadata): for an LFS file a 302 to
  ``/cdn/{sha256}`` with ``X-Linked-Size``, ``X-Linked-Etag`` and ``X-Repo-Commit``, as the Hub
  does; a small file answers 200 with ``ETag`` (its git blob id);
- ``GET`` of either, with ``Range: bytes=N-`` answered 206.

Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which huggingface_hub turns into its exception classes. Every request is logged
(method, path, Range, Authorization, body bytes sent). ``drop_after[path] = n`` makes the next
GET of that file send n bytes and close the connection; ``stall_after[path] = n`` makes it send
n bytes, set ``stalled`` and hang until ``release`` is set.
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """The server, on 127.0.0.1 and a free port, in a daemon thread; ``url`` is its endpoint."""

    def __init__(self):
        self.repos: dict[str, dict] = {}         # repo id -> {"sha", "files": {path: bytes}, "gated", "lfs": {path: sha256 override}}
        self.log: list[dict] = []
        self.drop_after: dict[str, int] = {}
        self.stall_after: dict[str, int] = {}
        self.stalled, self.release = threading.Event(), threading.Event()
        self.token = "hf_test_token"
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated: bool = False, sha: str | None = None,
                 lfs_sha256: dict[str, str] | None = None) -> str:
        """Publish a repo; files over 1 KiB (and every .gguf) are LFS files. Returns its commit."""
        sha = sha or hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = {"sha": sha, "files": files, "gated": gated, "lfs_sha256": lfs_sha256 or {}}
        return sha

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, path_part: str) -> list[dict]:
        """The logged body GETs whose path contains ``path_part``."""
        return [e for e in self.log if e["method"] == "GET" and path_part in e["path"]]

    # ------------------------------------------------------------------ answering
    def _is_lfs(self, path: str, data: bytes) -> bool:
        return path.endswith(".gguf") or len(data) > 1024

    def _sha256(self, repo: dict, path: str) -> str:
        return repo["lfs_sha256"].get(path) or hashlib.sha256(repo["files"][path]).hexdigest()

    def _error(self, h, status: int, code: str | None, entry: dict, commit: str | None = None):
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        body = json.dumps({"error": code or "error"}).encode()
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
        entry["status"] = status

    def _answer(self, h, head: bool):
        url = urlsplit(h.path)
        parts = [p for p in url.path.split("/") if p]
        entry = {"method": h.command, "path": url.path, "range": h.headers.get("Range"),
                 "auth": h.headers.get("Authorization"), "sent": 0, "status": None}
        self.log.append(entry)
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._model_info(h, "/".join(parts[2:4]), parts[5], entry)
        if parts and parts[0] == "cdn" and len(parts) == 2:
            for repo in self.repos.values():
                for path, data in repo["files"].items():
                    if hashlib.sha256(data).hexdigest() == parts[1]:
                        return self._send_file(h, path, data, head, entry, {})
            return self._error(h, 404, None, entry)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head, entry)
        return self._error(h, 404, None, entry)

    def _repo(self, h, repo_id: str, rev: str, entry: dict) -> dict | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", entry)
            return None
        if repo["gated"] and entry["auth"] != f"Bearer {self.token}":
            self._error(h, 401, "GatedRepo", entry)
            return None
        if rev not in ("main", repo["sha"]):
            self._error(h, 404, "RevisionNotFound", entry)
            return None
        return repo

    def _model_info(self, h, repo_id: str, rev: str, entry: dict):
        repo = self._repo(h, repo_id, rev, entry)
        if repo is None:
            return
        siblings = []
        for path, data in repo["files"].items():
            s = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
            if self._is_lfs(path, data):
                s["lfs"] = {"sha256": self._sha256(repo, path), "size": len(data), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo["sha"], "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
        entry["status"] = 200

    def _resolve(self, h, repo_id: str, rev: str, path: str, head: bool, entry: dict):
        repo = self._repo(h, repo_id, rev, entry)
        if repo is None:
            return
        data = repo["files"].get(path)
        if data is None:
            return self._error(h, 404, "EntryNotFound", entry, repo["sha"])
        if self._is_lfs(path, data):
            h.send_response(302)
            h.send_header("Location", f"{self.url}/cdn/{hashlib.sha256(data).hexdigest()}")
            h.send_header("X-Repo-Commit", repo["sha"])
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("X-Linked-Etag", f'"{self._sha256(repo, path)}"')
            h.send_header("Content-Length", "0")
            h.end_headers()
            entry["status"] = 302
            return
        self._send_file(h, path, data, head, entry, {"X-Repo-Commit": repo["sha"], "ETag": f'"{git_blob_id(data)}"'})

    def _send_file(self, h, path: str, data: bytes, head: bool, entry: dict, extra: dict):
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
        body = data[start:]
        h.send_response(206 if start else 200)
        for k, v in extra.items():
            h.send_header(k, v)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        entry["status"] = 206 if start else 200
        if head:
            return
        name = path.rsplit("/", 1)[-1]
        key = next((k for k in (path, name) if k in self.drop_after or k in self.stall_after), None)
        if key in self.drop_after:
            n = self.drop_after.pop(key)
            h.wfile.write(body[:n])
            h.wfile.flush()
            entry["sent"] = n
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if key in self.stall_after:
            n = self.stall_after.pop(key)
            h.wfile.write(body[:n])
            h.wfile.flush()
            entry["sent"] = n
            self.stalled.set()
            self.release.wait(60)
            h.close_connection = True
            return
        h.wfile.write(body)
        entry["sent"] = len(body)
