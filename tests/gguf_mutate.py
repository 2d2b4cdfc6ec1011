"""Rewrite a GGUF file with changed metadata: the tests' tool for malformed model files.

:class:`Header` reads a file's metadata (an ordered ``{key: (value_type, array_type, value)}``)
and tensor infos once; :meth:`Header.write` writes them back with changes (any value of any
GGUF type, so a count can become a string, a float or an array) followed by the tensor data,
either copied from the source file or left as a sparse hole of the same length, which costs
no disk and no time even under a real model's header. Unchanged fields are copied as bytes.
"""
from __future__ import annotations

import os
import struct

import numpy as np
from gguf import GGUFValueType as VT

from edge.gguf_file import GGUFFile

_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
        VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def pack_value(vtype: VT, atype: VT | None, value) -> bytes:
    """The bytes of one metadata value (after its type tag) of GGUF type ``vtype``."""
    if vtype == VT.STRING:
        return _string(value)
    if vtype != VT.ARRAY:
        return struct.pack(_FMT[vtype], value)
    head = struct.pack("<IQ", int(atype), len(value))
    if atype == VT.STRING:
        return head + b"".join(_string(s) for s in value)
    if atype == VT.ARRAY:
        raise ValueError("nested arrays are not supported")
    dtype = np.uint8 if atype == VT.BOOL else np.dtype(_FMT[atype])
    return head + np.asarray(value).astype(dtype).tobytes()


def pack_field(key: str, vtype: VT, atype: VT | None, value) -> bytes:
    """One metadata key-value pair as stored in a GGUF header."""
    return _string(key) + struct.pack("<I", int(vtype)) + pack_value(vtype, atype, value)


class Header:
    """The metadata and tensor infos of a GGUF file, to write again with changes.

    Attributes: path; fields {key: (value_type, array_type, value)} in file order; tensors
    [(name, shape, ggml_type, offset relative to the data)]; alignment; data_offset; file_size.
    """

    def __init__(self, path):
        gf = GGUFFile(path)
        self.path = os.fspath(path)
        self.fields = {k: (f.value_type, f.array_type, f.value) for k, f in gf.fields.items()}
        self.tensors = [(t.name, t.shape, int(t.ggml_type), t.offset - gf.data_offset) for t in gf.tensors.values()]
        self.alignment, self.data_offset, self.file_size = gf.alignment, gf.data_offset, gf.file_size
        offsets = [f.offset for f in gf.fields.values()]
        gf.close()
        with open(path, "rb") as f:
            head = f.read(offsets[-1] if offsets else 0)
        # each field's bytes as in the file (the last one is packed again: its end is not kept)
        self._raw = {k: head[a:b] for k, a, b in zip(self.fields, offsets, offsets[1:])}

    def write(self, dst, changes: dict | None = None, sparse: bool = False) -> str:
        """Write the file to ``dst`` with ``changes``: key -> (value_type, array_type, value) to
        set (a new key goes last), or None to remove the key. ``sparse`` leaves the data a hole
        of its length (tensor bounds still check out; every weight reads as zero bytes).
        Returns the path."""
        changes = changes or {}
        fields = {k: v for k, v in self.fields.items() if changes.get(k, v) is not None}
        fields.update({k: v for k, v in changes.items() if v is not None})
        out = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(fields))]
        for key, (vtype, atype, value) in fields.items():
            raw = None if key in changes else self._raw.get(key)
            out.append(raw if raw is not None else pack_field(key, vtype, atype, value))
        for name, shape, ggml_type, rel in self.tensors:
            out.append(_string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, ggml_type, rel))
        header = b"".join(out)
        header += b"\0" * ((-len(header)) % self.alignment)
        n_data = self.file_size - self.data_offset
        with open(dst, "wb") as f:
            f.write(header)
            if sparse:
                f.truncate(len(header) + n_data)
            else:
                with open(self.path, "rb") as src:
                    src.seek(self.data_offset)
                    f.write(src.read(n_data))
        return os.fspath(dst)


def mutate(src, dst, changes: dict, sparse: bool = False) -> str:
    """Copy the GGUF ``src`` to ``dst`` with metadata ``changes`` (see :meth:`Header.write`)."""
    return Header(src).write(dst, changes, sparse)
