"""GGUF reader: valid files read back exactly; malformed ones are refused at once with an
error naming the field (../shared/BUGS.md G1, G3)."""
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from edge.gguf_file import GGUFError, GGUFFile


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def _kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", GGUFValueType.STRING) + _s(value)


def _tensor_info(name: str, shape, gtype=GGMLQuantizationType.F32, offset=0) -> bytes:
    return _s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape) \
        + struct.pack("<IQ", gtype, offset)


def _file(tmp_path, kvs=(), tensors=(), n_kv=None, n_tensors=None, data=b"", version=3, magic=b"GGUF",
          align=32):
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * ((-len(body)) % align)
    p = tmp_path / "t.gguf"
    p.write_bytes(body + data)
    return p


def _refused(path, *words):
    t = time.perf_counter()
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    assert time.perf_counter() - t < 1.0
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_roundtrip_with_gguf_writer(tmp_path):
    p = tmp_path / "w.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_uint32("test.u32", 7)
    w.add_string("test.s", "héllo")
    w.add_array("test.arr", [1.5, 2.5, -3.0])
    w.add_array("test.strs", ["a", "", "ü🦙"])
    w.add_bool("test.b", True)
    a = np.arange(64, dtype=np.float32).reshape(2, 32)
    b = np.ones((3, 64), dtype=np.float16)
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(p)
    assert g.version == 3 and g.architecture == "llama"
    assert g.get_int("test.u32") == 7 and g.get_str("test.s") == "héllo" and g.get_bool("test.b") is True
    assert g.get("test.arr").tolist() == [1.5, 2.5, -3.0]
    assert g.get("test.strs") == ["a", "", "ü🦙"]
    assert g.tensors["a"].shape == (32, 2) and g.tensors["b"].ggml_type == GGMLQuantizationType.F16
    assert np.array_equal(g.tensor_f32("a"), a)
    assert np.array_equal(g.tensor_bytes("b").view(np.float16).reshape(3, 64), b)
    assert g.tensor_rows("b").shape == (3, 128)


def test_typed_getters_name_the_key(tmp_path):
    p = _file(tmp_path, kvs=[_kv_u32("general.alignment", 32), _kv_str("x.s", "v")])
    g = GGUFFile(p)
    with pytest.raises(GGUFError, match="'x.s'.*STRING, expected an integer"):
        g.get_int("x.s")
    with pytest.raises(GGUFError, match="required metadata key 'x.missing' is missing"):
        g.get_str("x.missing")
    with pytest.raises(GGUFError, match="'x.s'.*expected ARRAY of FLOAT32"):
        g.get_array("x.s", (GGUFValueType.FLOAT32,))
    assert g.get_float("x.none", default=1.5) == 1.5


def test_not_gguf(tmp_path):
    p = tmp_path / "e.gguf"
    p.write_bytes(b"")
    _refused(p, "empty")
    p.write_bytes(b"GGML" + b"\0" * 60)
    _refused(p, "magic")
    _refused(_file(tmp_path, version=1), "version", "not supported")
    _refused(_file(tmp_path, version=0x03000000), "big-endian")


def test_short_header(tmp_path):
    p = tmp_path / "s.gguf"
    p.write_bytes(b"GGUF\x03\0\0\0\x01")
    _refused(p, "tensor_count", "offset 8")


@pytest.mark.parametrize("field,kw", [("tensor_count", dict(n_tensors=2**63)), ("kv_count", dict(n_kv=2**63)),
                                      ("kv_count", dict(n_kv=2**64 - 1))])
def test_huge_counts(tmp_path, field, kw):
    _refused(_file(tmp_path, **kw), field, "cannot fit")


def test_empty_and_duplicate_keys(tmp_path):
    _refused(_file(tmp_path, kvs=[_kv_u32("", 1)]), "metadata key #0", "empty key")
    _refused(_file(tmp_path, kvs=[_kv_u32("a.b", 1), _kv_u32("a.b", 2)]), "duplicate key 'a.b'", "key #1")


def test_string_longer_than_file(tmp_path):
    bad_key = struct.pack("<Q", 2**62) + b"abc"
    _refused(_file(tmp_path, kvs=[bad_key]), "metadata key #0", "string length 4611686018427387904")
    bad_val = _s("k") + struct.pack("<IQ", GGUFValueType.STRING, 10**12) + b"xy"
    _refused(_file(tmp_path, kvs=[bad_val]), "value of 'k'", "larger than")


def test_array_longer_than_file(tmp_path):
    for at in (GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.ARRAY):
        kv = _s("arr") + struct.pack("<IIQ", GGUFValueType.ARRAY, at, 2**61)
        _refused(_file(tmp_path, kvs=[kv]), "array length of 'arr'", "cannot fit")
    # string array whose last element's length runs past the end
    kv = _s("toks") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, 2) + _s("ok") \
        + struct.pack("<Q", 5000)
    _refused(_file(tmp_path, kvs=[kv]), "'toks'[1]", "string length 5000")


def test_unknown_value_type(tmp_path):
    kv = _s("k") + struct.pack("<I", 99) + b"\0" * 16
    _refused(_file(tmp_path, kvs=[kv]), "type of 'k'", "unknown value type 99")


@pytest.mark.parametrize("align", [0, 3, 48])
def test_alignment_not_power_of_two(tmp_path, align):
    _refused(_file(tmp_path, kvs=[_kv_u32("general.alignment", align)]), "general.alignment", "power of two")


def test_alignment_wrong_type(tmp_path):
    _refused(_file(tmp_path, kvs=[_kv_str("general.alignment", "32")]), "general.alignment")


@pytest.mark.parametrize("shape", [(), (32, 1, 1, 1, 1)])
def test_n_dims(tmp_path, shape):
    _refused(_file(tmp_path, tensors=[_tensor_info("w", shape)], data=b"\0" * 128), "'w' n_dims", "not in 1..4")


def test_zero_and_overflowing_dims(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (32, 0))]), "'w' ne[1]", "dimension is 0")
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (2**32, 2**32))]), "'w' shape", "overflows 64 bits")
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (2**62, 4))]), "overflows 64 bits")


def test_tensor_past_end_of_file(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (32, 4))], data=b"\0" * 100),
             "'w' data offset", "runs past the end of the file")
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (32,), offset=2**63)], data=b"\0" * 128),
             "'w' data offset", "runs past the end")


def test_unaligned_offset_unknown_type_duplicate_tensor(tmp_path):
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (8,), offset=4)], data=b"\0" * 64), "not a multiple of the alignment")
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (8,), gtype=250)], data=b"\0" * 64), "unknown GGML type 250")
    _refused(_file(tmp_path, tensors=[_tensor_info("w", (8,)), _tensor_info("w", (8,), offset=32)], data=b"\0" * 64),
             "duplicate name 'w'")


def test_row_length_not_multiple_of_block(tmp_path):
    """G3: a Q4_K row of 896 values does not divide into blocks of 256."""
    _refused(_file(tmp_path, tensors=[_tensor_info("blk.0.ffn_down.weight", (896, 2), GGMLQuantizationType.Q4_K)],
                   data=b"\0" * 4096), "'blk.0.ffn_down.weight'", "row length 896", "Q4_K block size 256")


def test_truncated_real_header(tmp_path, qwen_path):
    """Every prefix of a real header is refused cleanly (never a crash or hang)."""
    head = qwen_path.read_bytes()[:300_000]
    for n in (3, 10, 23, 24, 100, 1000, 50_000, 299_999):
        p = tmp_path / "cut.gguf"
        p.write_bytes(head[:n])
        with pytest.raises(GGUFError):
            GGUFFile(p)
