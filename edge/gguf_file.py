"""GGUF files: a validating, memory-mapped reader.

Format: the GGUF specification (ggml/docs/gguf.md), versions 2 and 3, little-endian:

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key | u32 value_type | value)
    tensor_count x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32)
    tensor data; each tensor at data_start + offset

    string = u64 length + UTF-8 bytes;  array = u32 element type + u64 count + elements

Why not ``gguf.GGUFReader``: it builds a numpy view per array element, which takes ~10 s
for Gemma 3's 262,144-token vocabulary, and it trusts every length and count in the header.
This reader checks every length, count, type, shape and offset against the bytes that are
actually there before using it (../shared/BUGS.md G1), so a malformed file fails at once with
a :class:`GGUFError` naming the field and its byte offset. Names of keys, value types and
GGML types come from the ``gguf`` package; tensors stay in the memory map (zero-copy views).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8

# byte size of each fixed-size value type, and the numpy dtype its arrays are viewed as
# value type -> (numpy dtype, struct format); the byte size is the dtype's itemsize
_SCALAR = {
    GGUFValueType.UINT8: (np.dtype("<u1"), "<B"),
    GGUFValueType.INT8: (np.dtype("<i1"), "<b"),
    GGUFValueType.UINT16: (np.dtype("<u2"), "<H"),
    GGUFValueType.INT16: (np.dtype("<i2"), "<h"),
    GGUFValueType.UINT32: (np.dtype("<u4"), "<I"),
    GGUFValueType.INT32: (np.dtype("<i4"), "<i"),
    GGUFValueType.FLOAT32: (np.dtype("<f4"), "<f"),
    GGUFValueType.BOOL: (np.dtype("<u1"), "<?"),
    GGUFValueType.UINT64: (np.dtype("<u8"), "<Q"),
    GGUFValueType.INT64: (np.dtype("<i8"), "<q"),
    GGUFValueType.FLOAT64: (np.dtype("<f8"), "<d"),
}
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, one key byte, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, one byte, n_dims, one dim, type, offset


class GGUFError(ValueError):
    """A GGUF file (or its metadata) is malformed. The message names the field and offset."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ``shape`` is in GGUF/ggml order: ``shape[0]`` (ne0) is the row length, the fastest-varying
    dimension. ``offset`` is the absolute byte offset of the data in the file.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_length(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[0] // block * size


@dataclass(frozen=True)
class MetadataField:
    """A metadata value with its GGUF type (``array_type`` set for arrays) and file offset."""

    value: Any
    value_type: GGUFValueType
    array_type: GGUFValueType | None
    offset: int


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every read names its field."""

    def __init__(self, buf, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, field: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise GGUFError(
                f"{field} at offset {self.pos}: needs {n} bytes but only {self.size - self.pos} remain"
            )

    def unpack(self, fmt: str, n: int, field: str):
        self.need(n, field)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, field: str) -> int:
        return self.unpack("<I", 4, field)

    def u64(self, field: str) -> int:
        return self.unpack("<Q", 8, field)

    def value_type(self, field: str) -> GGUFValueType:
        start = self.pos
        raw = self.u32(field)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{field} at offset {start}: unknown value type {raw}") from None

    def string(self, field: str) -> str:
        start = self.pos
        n = self.u64(f"{field} length")
        if n > self.left():
            raise GGUFError(
                f"{field} at offset {start}: string length {n} is larger than the "
                f"{self.left()} bytes left in the file"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")


class GGUFFile:
    """A memory-mapped, validated GGUF file.

    Attributes:
        path: the file path.
        version: GGUF version (2 or 3).
        alignment: data alignment in bytes (``general.alignment``, default 32).
        fields: metadata key -> :class:`MetadataField`, in file order.
        tensors: tensor name -> :class:`TensorInfo`, in file order.
        data_offset: absolute offset of the tensor data section.

    Raises:
        GGUFError: on any malformed header, naming the field and byte offset.
        OSError: if the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(f"{self.path}: file is empty, not a GGUF file")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        try:
            self._parse()
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}") from None

    # ------------------------------------------------------------------ parsing
    def _parse(self) -> None:
        c = _Cursor(self._mmap, self.file_size)
        c.need(4, "magic")
        magic = bytes(self._mmap[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"magic at offset 0: expected b'GGUF', found {magic!r}; not a GGUF file")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            if self.version & 0xFFFF == 0 and (self.version >> 16) in (0x200, 0x300):
                raise GGUFError("version at offset 4: big-endian GGUF files are not supported")
            raise GGUFError(
                f"version at offset 4: {self.version} is not supported (supported: 2, 3)"
            )
        n_tensors = c.u64("tensor_count")
        if n_tensors * _MIN_TENSOR_INFO_BYTES > c.left():
            raise GGUFError(
                f"tensor_count at offset 8: {n_tensors} tensors cannot fit in the "
                f"{c.left()} bytes left in the file"
            )
        n_kv = c.u64("kv_count")
        if n_kv * _MIN_KV_BYTES > c.left():
            raise GGUFError(
                f"kv_count at offset 16: {n_kv} key-value pairs cannot fit in the "
                f"{c.left()} bytes left in the file"
            )

        fields: dict[str, MetadataField] = {}
        for i in range(n_kv):
            key_offset = c.pos
            key = c.string(f"metadata key #{i}")
            if not key:
                raise GGUFError(f"metadata key #{i} at offset {key_offset}: empty key")
            if key in fields:
                raise GGUFError(f"metadata key #{i} at offset {key_offset}: duplicate key {key!r}")
            vtype = c.value_type(f"type of {key!r}")
            value, array_type = self._read_value(c, vtype, key, 0)
            fields[key] = MetadataField(value, vtype, array_type, key_offset)
        self.fields = fields

        align_field = fields.get("general.alignment")
        self.alignment = DEFAULT_ALIGNMENT
        if align_field is not None:
            a = align_field.value
            if align_field.value_type != GGUFValueType.UINT32 or a <= 0 or a & (a - 1):
                raise GGUFError(
                    f"general.alignment at offset {align_field.offset}: {a!r} is not a "
                    "power of two (uint32)"
                )
            self.alignment = a

        infos = []
        names = set()
        for i in range(n_tensors):
            info_offset = c.pos
            name = c.string(f"tensor #{i} name")
            if not name:
                raise GGUFError(f"tensor #{i} name at offset {info_offset}: empty name")
            if name in names:
                raise GGUFError(f"tensor #{i} at offset {info_offset}: duplicate name {name!r}")
            names.add(name)
            nd_offset = c.pos
            n_dims = c.u32(f"tensor {name!r} n_dims")
            if n_dims == 0 or n_dims > MAX_DIMS:
                raise GGUFError(
                    f"tensor {name!r} n_dims at offset {nd_offset}: {n_dims} is not in 1..{MAX_DIMS}"
                )
            shape = tuple(c.u64(f"tensor {name!r} ne[{d}]") for d in range(n_dims))
            n_el = 1
            for d, ne in enumerate(shape):
                if ne == 0:
                    raise GGUFError(f"tensor {name!r} ne[{d}] at offset {nd_offset + 4 + 8 * d}: dimension is 0")
                n_el *= ne
                if n_el >= 2**63:
                    raise GGUFError(
                        f"tensor {name!r} shape {shape} at offset {nd_offset}: element count "
                        "overflows 64 bits"
                    )
            t_offset = c.pos
            raw_t = c.u32(f"tensor {name!r} type")
            try:
                gtype = GGMLQuantizationType(raw_t)
            except ValueError:
                raise GGUFError(
                    f"tensor {name!r} type at offset {t_offset}: unknown GGML type {raw_t}"
                ) from None
            if gtype not in GGML_QUANT_SIZES:
                raise GGUFError(f"tensor {name!r} type at offset {t_offset}: GGML type {gtype.name} has no block size")
            block, type_size = GGML_QUANT_SIZES[gtype]
            if shape[0] % block:
                raise GGUFError(
                    f"tensor {name!r} at offset {info_offset}: row length {shape[0]} is not a "
                    f"multiple of the {gtype.name} block size {block}"
                )
            o_offset = c.pos
            rel = c.u64(f"tensor {name!r} offset")
            if rel % self.alignment:
                raise GGUFError(
                    f"tensor {name!r} data offset (at file offset {o_offset}): {rel} is not a multiple of "
                    f"the alignment {self.alignment}"
                )
            infos.append((name, gtype, shape, rel, n_el // block * type_size, o_offset))

        pad = (-c.pos) % self.alignment
        self.data_offset = c.pos + pad
        tensors: dict[str, TensorInfo] = {}
        for name, gtype, shape, rel, n_bytes, o_offset in infos:
            start = self.data_offset + rel
            if start + n_bytes > self.file_size:
                raise GGUFError(
                    f"tensor {name!r} data offset (at file offset {o_offset}): data [{start}, {start + n_bytes}) "
                    f"runs past the end of the file ({self.file_size} bytes)"
                )
            tensors[name] = TensorInfo(name, gtype, shape, start, n_bytes)
        self.tensors = tensors

    def _read_value(self, c: _Cursor, vtype: GGUFValueType, key: str, depth: int):
        if vtype == GGUFValueType.STRING:
            return c.string(f"value of {key!r}"), None
        if vtype in _SCALAR:
            dtype, fmt = _SCALAR[vtype]
            return c.unpack(fmt, dtype.itemsize, f"value of {key!r}"), None
        if vtype != GGUFValueType.ARRAY:
            raise GGUFError(f"value of {key!r} at offset {c.pos}: unknown value type {vtype}")
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(f"value of {key!r} at offset {c.pos}: arrays nested too deep")
        atype = c.value_type(f"array type of {key!r}")
        n_offset = c.pos
        n = c.u64(f"array length of {key!r}")
        min_el = _SCALAR[atype][0].itemsize if atype in _SCALAR else (8 if atype == GGUFValueType.STRING else 12)
        if n * min_el > c.left():
            raise GGUFError(
                f"array length of {key!r} at offset {n_offset}: {n} elements cannot fit in the "
                f"{c.left()} bytes left in the file"
            )
        if atype in _SCALAR:
            dtype = _SCALAR[atype][0]
            arr = np.frombuffer(self._mmap, dtype=dtype, count=n, offset=c.pos)
            if atype == GGUFValueType.BOOL:
                arr = arr.astype(bool)
            c.pos += n * dtype.itemsize
            return arr, atype
        if atype == GGUFValueType.STRING:
            return self._read_string_array(c, n, key), atype
        return [self._read_value(c, atype, key, depth + 1)[0] for _ in range(n)], atype

    def _read_string_array(self, c: _Cursor, n: int, key: str) -> list[str]:
        buf, size, pos = self._mmap, self.file_size, c.pos
        out = []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(n):
            if pos + 8 > size:
                raise GGUFError(f"{key!r}[{i}] length at offset {pos}: runs past the end of the file")
            ln = unpack(buf, pos)[0]
            pos += 8
            if ln > size - pos:
                raise GGUFError(
                    f"{key!r}[{i}] at offset {pos - 8}: string length {ln} is larger than the "
                    f"{size - pos} bytes left in the file"
                )
            out.append(buf[pos : pos + ln].decode("utf-8", errors="surrogateescape"))
            pos += ln
        c.pos = pos
        return out

    # ------------------------------------------------------------------ access
    @property
    def metadata(self) -> dict[str, Any]:
        """Metadata key -> value (scalars as Python values, numeric arrays as numpy views)."""
        return {k: f.value for k, f in self.fields.items()}

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.value

    def _typed(self, key: str, kinds: tuple[GGUFValueType, ...], what: str, required: bool, default):
        f = self.fields.get(key)
        if f is None:
            if required:
                raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
            return default
        if f.value_type not in kinds:
            raise GGUFError(
                f"{self.path}: metadata key {key!r} at offset {f.offset} has type "
                f"{f.value_type.name}, expected {what}"
            )
        return f.value

    def get_str(self, key: str, default: str | None = None, required: bool = True) -> str:
        """String metadata. Raises GGUFError naming the key if missing (when required) or mistyped."""
        return self._typed(key, (GGUFValueType.STRING,), "STRING", required and default is None, default)

    def get_int(self, key: str, default: int | None = None, required: bool = True) -> int:
        """Integer metadata (any integer type)."""
        kinds = (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                 GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64)
        v = self._typed(key, kinds, "an integer", required and default is None, default)
        return v if v is None else int(v)

    def get_float(self, key: str, default: float | None = None, required: bool = True) -> float:
        """Float metadata (float or integer types are accepted)."""
        kinds = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.UINT32, GGUFValueType.INT32,
                 GGUFValueType.UINT64, GGUFValueType.INT64)
        v = self._typed(key, kinds, "a number", required and default is None, default)
        return v if v is None else float(v)

    def get_bool(self, key: str, default: bool | None = None, required: bool = True) -> bool:
        v = self._typed(key, (GGUFValueType.BOOL,), "BOOL", required and default is None, default)
        return v if v is None else bool(v)

    def get_array(self, key: str, element_types: tuple[GGUFValueType, ...], required: bool = True):
        """Array metadata whose elements have one of ``element_types``; None if absent and optional."""
        f = self.fields.get(key)
        if f is None:
            if required:
                raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
            return None
        if f.value_type != GGUFValueType.ARRAY or f.array_type not in element_types:
            got = f.value_type.name if f.array_type is None else f"ARRAY of {f.array_type.name}"
            want = " or ".join(t.name for t in element_types)
            raise GGUFError(
                f"{self.path}: metadata key {key!r} at offset {f.offset} has type {got}, "
                f"expected ARRAY of {want}"
            )
        return f.value

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor as a zero-copy uint8 view of the memory map."""
        t = self.tensors[name]
        return self._bytes[t.offset : t.offset + t.n_bytes]

    def tensor_rows(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 ``[n_rows, row_bytes]`` (zero-copy), for block-format kernels."""
        t = self.tensors[name]
        return self.tensor_bytes(name).reshape(t.n_rows, t.row_bytes)

    def tensor_f32(self, name: str) -> np.ndarray:
        """An F32 tensor as a zero-copy float32 view shaped in numpy order (reversed ne)."""
        t = self.tensors[name]
        if t.ggml_type != GGMLQuantizationType.F32:
            raise GGUFError(f"{self.path}: tensor {name!r} is {t.ggml_type.name}, expected F32")
        return self.tensor_bytes(name).view(np.float32).reshape(tuple(reversed(t.shape)))

    def close(self) -> None:
        self._bytes = None
        self.tensors = {}
        try:
            self._mmap.close()
        except BufferError:
            pass  # numpy views still reference the map; it closes when they go

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.fields)} keys, {len(self.tensors)} tensors)"


def tensor_type_counts(gf: GGUFFile) -> dict[str, int]:
    """GGML type name -> number of tensors of ``gf`` of that type, most common first (ties in file
    order): what llama.cpp's model loader prints as "type q8_0: 169 tensors"."""
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def format_type_counts(counts: dict[str, int]) -> str:
    """``{"IQ4_NL": 120, "F32": 121}`` -> "IQ4_NL×120, F32×121" (edge list, edge bench)."""
    return ", ".join(f"{name}×{n}" for name, n in counts.items())


def file_type_label(gf: GGUFFile) -> str:
    """The file's type as llama.cpp names it (``general.file_type``, llama_ftype: "Q4_K_M",
    "F16", "Q4_1" ...); without that key, the most common quantized tensor type (else the most
    common type); "ftype N" for a number llama.cpp does not know."""
    from gguf import LlamaFileType

    value = gf.get("general.file_type")
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            name = LlamaFileType(value & ~int(LlamaFileType.GUESSED)).name
        except ValueError:
            return f"ftype {value}"
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts = tensor_type_counts(gf)
    quantized = [t for t in counts if t not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")]
    return (quantized or list(counts) or ["?"])[0]


def format_params(n: int) -> str:
    """A parameter count as Ollama prints it: 494.03M, 1.54B, 135M -> "134.52M"."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.2f}K"
