"""Saved sessions: a sequence's tokens, KV cache and last logits in a file, restored by a
later process without recomputing the prompt (llama.cpp's --prompt-cache).

File format (edge's own; all integers little-endian)::

    b"EDGESESS"  magic (8 bytes)
    u32          format version (2; version 1 stored a quantized K cache without the shift of
                 edge.models.rope.static_k_bias, so its K rows do not fit this edge)
    u32          header length H
    H bytes      header, UTF-8 JSON: model (name, architecture, file size, fingerprint),
                 KV types, n_tokens, n_vocab, and per layer the first stored position and the
                 dtype and row shape of its K and V rows
    int32[n]     token ids
    f32[n_vocab] logits after the last token
    per layer    K rows then V rows of positions first .. n-1, [rows, n_head_kv, row] in the
                 KV type's pool layout (edge.kv.cache)
    32 bytes     SHA-256 of everything before it

A file is written to a temporary name in the same folder, fsynced, then renamed over the
target (edge.files.atomic_write), so an interrupted save leaves the old file whole, and the
temporary file a killed save left is removed by the next save. Loading checks the digest first
(truncated or corrupted files are refused), then that the model fingerprint, KV types and
shapes are this engine's.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.files import atomic_write

MAGIC = b"EDGESESS"
VERSION = 2
_DIGEST = 32
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


class SessionError(ValueError):
    """A session file that cannot be used here: names the file and what is wrong."""


def model_fingerprint(gf) -> str:
    """A SHA-256 hex digest that names a GGUF file's content without reading all of it: its
    size, its whole header (metadata and tensor infos, up to the tensor data) and 16 samples
    of 64 KiB spread over the tensor data. ``gf`` is an edge.gguf_file.GGUFFile."""
    h = hashlib.sha256(str(gf.file_size).encode())
    data = gf._bytes
    h.update(data[: gf.data_offset].tobytes())
    span = max(gf.file_size - gf.data_offset - _SAMPLE_BYTES, 0)
    for i in range(_SAMPLES):
        start = gf.data_offset + span * i // max(_SAMPLES - 1, 1)
        h.update(data[start : start + _SAMPLE_BYTES].tobytes())
    return h.hexdigest()


@dataclass
class Session:
    """A loaded session: token ids int32[n], logits f32[n_vocab] after the last token, and per
    layer the K and V rows (edge.kv.cache.PagedKVCache.export_sequence's arrays)."""

    tokens: np.ndarray
    logits: np.ndarray
    ks: list[np.ndarray]
    vs: list[np.ndarray]

    def prefix(self, m: int, first_position) -> Session | None:
        """The state after the first m tokens (0 < m <= n), or None when the file lacks rows
        it needs: ``first_position(il, n)`` gives the first position layer il keeps (a
        sliding-window layer keeps only its window, so a shorter prefix needs older rows).
        The prefix has no logits (its last token must be computed again)."""
        n = len(self.tokens)
        if m == n:
            return self
        ks, vs = [], []
        for il, (k, v) in enumerate(zip(self.ks, self.vs)):
            lo_n, lo_m = first_position(il, n), first_position(il, m)
            if lo_m < lo_n:
                return None
            ks.append(k[lo_m - lo_n : m - lo_n])
            vs.append(v[lo_m - lo_n : m - lo_n])
        return Session(self.tokens[:m], np.empty(0, np.float32), ks, vs)


def _header(engine, n_tokens: int, ks, vs) -> dict:
    kv = engine.kv
    return {
        "format": "edge-session",
        "model": {"name": engine.name, "architecture": engine.model.args.arch,
                  "file_size": engine.gguf.file_size, "fingerprint": engine.fingerprint},
        "kv": {"type_k": kv.type_k, "type_v": kv.type_v},
        "n_tokens": n_tokens,
        "n_vocab": engine.model.args.n_vocab,
        "layers": [{"first": kv.first_position(il, n_tokens),
                    "k": [str(k.dtype), list(k.shape[1:])], "v": [str(v.dtype), list(v.shape[1:])]}
                   for il, (k, v) in enumerate(zip(ks, vs))],
    }


def save_session(path: str | Path, engine, slot: int, logits: np.ndarray) -> int:
    """Write the computed state of ``slot`` in ``engine.kv`` and the ``logits`` f32[n_vocab]
    after its last token to ``path``, atomically (temporary file, fsync, rename). Returns the
    file size in bytes. Raises OSError when the file cannot be written (the old file, if
    any, is left as it was)."""
    path = Path(os.path.realpath(path))     # through a symlink: replace its target, keep the link
    if path.is_dir():
        raise OSError(f"{path}: is a directory, not a session file")
    tokens, ks, vs = engine.kv.export_sequence(slot)
    head = json.dumps(_header(engine, len(tokens), ks, vs)).encode()
    parts = [MAGIC, struct.pack("<II", VERSION, len(head)), head,
             np.ascontiguousarray(tokens, "<i4").tobytes(), np.ascontiguousarray(logits, "<f4").tobytes()]
    for k, v in zip(ks, vs):
        parts += [k.tobytes(), v.tobytes()]
    digest = hashlib.sha256()
    try:
        with atomic_write(path) as tmp, open(tmp, "wb") as f:
            for part in parts:
                digest.update(part)
                f.write(part)
            f.write(digest.digest())
    except OSError as e:
        raise OSError(f"{path}: cannot write the session file ({e.strerror or e})") from None
    return path.stat().st_size


def load_session(path: str | Path, engine) -> Session:
    """Read a session file written by :func:`save_session` for ``engine``'s model and KV types.

    Raises SessionError naming the file when it is not a session file, has another format
    version, is truncated or corrupted (digest mismatch), or was made with another model, KV
    types or layout; OSError when it cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        raise SessionError(f"{path}: is a directory, not a session file")
    if not path.is_file():                   # a device or pipe could be endless: never read one
        raise SessionError(f"{path}: not a regular file, not a session file")
    raw = path.read_bytes()
    if len(raw) < len(MAGIC) + 8 + _DIGEST or raw[: len(MAGIC)] != MAGIC:
        raise SessionError(f"{path}: not an edge session file")
    version, head_len = struct.unpack_from("<II", raw, len(MAGIC))
    if version != VERSION:
        raise SessionError(f"{path}: session format version {version} is not supported (this edge reads {VERSION})")
    if hashlib.sha256(raw[:-_DIGEST]).digest() != raw[-_DIGEST:]:
        raise SessionError(f"{path}: the file is truncated or corrupted (its SHA-256 does not match); "
                           f"delete it to start a new session")
    off = len(MAGIC) + 8
    try:
        head = json.loads(raw[off : off + head_len])
    except ValueError as e:
        raise SessionError(f"{path}: unreadable header ({e})") from None
    off += head_len
    model, kv = head.get("model", {}), head.get("kv", {})
    if model.get("fingerprint") != engine.fingerprint:
        raise SessionError(f"{path}: made with model {model.get('name')!r} ({model.get('file_size')} bytes), "
                           f"not with {engine.name!r} loaded now")
    want_kv = {"type_k": engine.kv.type_k, "type_v": engine.kv.type_v}
    if kv != want_kv:
        raise SessionError(f"{path}: KV cache types {kv.get('type_k')}/{kv.get('type_v')} in the file, "
                           f"this run uses {want_kv['type_k']}/{want_kv['type_v']} (--cache-type-k/-v)")
    try:
        return _arrays(raw, off, head, engine, path)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SessionError):
            raise
        raise SessionError(f"{path}: header and contents do not agree ({e})") from None


def _arrays(raw: bytes, off: int, head: dict, engine, path: Path) -> Session:
    n, n_vocab = head["n_tokens"], head["n_vocab"]
    if n_vocab != engine.model.args.n_vocab:
        raise SessionError(f"{path}: {n_vocab} logits per token, the model has {engine.model.args.n_vocab}")
    tokens = np.frombuffer(raw, "<i4", n, off).astype(np.int32)
    off += 4 * n
    logits = np.frombuffer(raw, "<f4", n_vocab, off).astype(np.float32)
    off += 4 * n_vocab
    ks, vs = [], []
    for il, layer in enumerate(head["layers"]):
        if layer["first"] != engine.kv.first_position(il, n):
            raise SessionError(f"{path}: layer {il} holds positions from {layer['first']}, this model "
                               f"needs them from {engine.kv.first_position(il, n)}")
        rows = n - layer["first"]
        for key, out in (("k", ks), ("v", vs)):
            dtype, shape = np.dtype(layer[key][0]), tuple(layer[key][1])
            count = rows * int(np.prod(shape))
            out.append(np.frombuffer(raw, dtype, count, off).reshape((rows,) + shape))
            off += count * dtype.itemsize
    if off != len(raw) - _DIGEST:
        raise SessionError(f"{path}: {len(raw) - _DIGEST - off} bytes more than its header describes")
    return Session(tokens, logits, ks, vs)
