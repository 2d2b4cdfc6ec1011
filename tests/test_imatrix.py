"""edge.imatrix (llama-imatrix) and quantization weighted by it (edge quantize --imatrix).

1. Collection on gemma-3-270m: the sums of blk.0's attention input equal a numpy recomputation
   from the token embeddings; entries, counts, chunk count; batches under 16 rows ignored;
   the GGUF file round-trips; bad files are named errors.
2. (slow) Q4_K_M of the F16 source with an imatrix of calib_text.txt: the same file bytes as
   llama.cpp's llama_model_quantize given the same weights (ctypes, llama-cpp-python); and
   Q3_K_M with the imatrix has a much lower mean KL divergence from the F16 model on
   ppl_text.txt than without it (Q4_K_M: not significantly higher).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from edge.engine import Engine
from edge.imatrix import ImatrixError, compute_imatrix, load_imatrix, write_imatrix
from tests.conftest import GOLDEN

ORACLE_SCRIPT = Path(__file__).with_name("llama_quantize_imatrix.py")
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return Engine(gemma_path, n_ctx=64, n_batch=64)


@pytest.fixture(scope="module")
def text() -> str:
    return (GOLDEN / "ppl_text.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def small_imatrix(gemma, text):
    return compute_imatrix(gemma, text, n_ctx=64, max_chunks=2, dataset="ppl_text.txt")


def test_layer0_input_sums_match_numpy(gemma, text, small_imatrix):
    """blk.0.attn_q's input is rms_norm(token embeddings * embed_scale) * attn_norm: recomputed
    in float64 from the chunks (BOS first) it equals the collected float32 sums."""
    model, tok = gemma.model, gemma.tokenizer
    ids = tok.encode(text, add_special=True, parse_special=False)
    chunks = [list(ids[c * 64:(c + 1) * 64]) for c in range(2)]
    for chunk in chunks:
        chunk[0] = tok.bos_id
    x = model.token_embd.get_rows(np.array(sum(chunks, []))).astype(np.float64) * model.args.embed_scale
    h = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + model.args.rms_eps) * model.blocks[0].attn_norm
    want = (h * h).sum(axis=0)
    got = small_imatrix.sums["blk.0.attn_q.weight"]
    assert got.dtype == np.float32 and got.shape == (model.args.n_embd,)
    np.testing.assert_allclose(got, want, rtol=2e-4)
    for name in ("attn_k", "attn_v"):   # the same input
        assert np.array_equal(small_imatrix.sums[f"blk.0.{name}.weight"], got)


def test_entries_counts_and_chunks(gemma, small_imatrix):
    n_layer = gemma.model.args.n_layer
    assert set(small_imatrix.sums) == {f"blk.{i}.{m}.weight" for i in range(n_layer) for m in MATRICES}
    assert set(small_imatrix.counts.values()) == {128}
    assert small_imatrix.chunk_count == 2 and small_imatrix.chunk_size == 64
    assert small_imatrix.sums["blk.0.ffn_down.weight"].shape == (gemma.model.args.n_ff,)
    assert all(np.isfinite(s).all() and (s > 0).any() for s in small_imatrix.sums.values())


def test_small_batches_are_not_collected(gemma, text):
    """llama-imatrix skips products of fewer than 16 activation rows: batches of 8 give nothing."""
    imatrix = compute_imatrix(gemma, text, n_ctx=32, n_batch=8, max_chunks=1)
    assert imatrix.sums == {} and imatrix.chunk_count == 0


def test_observer_is_removed(gemma, small_imatrix):
    assert all(w.observer is None for w in gemma.model.weights())


def test_file_round_trip(tmp_path, small_imatrix):
    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, small_imatrix)
    loaded = load_imatrix(path)
    assert loaded.datasets == ["ppl_text.txt"] and loaded.chunk_count == 2
    assert set(loaded.weights) == set(small_imatrix.sums)
    for name, sums in small_imatrix.sums.items():
        assert np.array_equal(loaded.weights[name], sums / np.float32(128))
    assert [p.name for p in tmp_path.iterdir()] == ["imatrix.gguf"]   # no temporary file left
    assert path.stat().st_mode & 0o777 == 0o644
    # as llama-imatrix writes them: ggml [n_in, 1] and [1, 1] stored with ggml_n_dims dimensions
    from edge.gguf_file import GGUFFile

    gf = GGUFFile(path)
    assert gf.tensors["blk.0.ffn_down.weight.in_sum2"].shape == (small_imatrix.sums["blk.0.ffn_down.weight"].size,)
    assert gf.tensors["blk.0.ffn_down.weight.counts"].shape == (1,)
    gf.close()


def test_quantize_will_not_write_over_its_imatrix(tmp_path, small_imatrix, gemma_f16_path, capsys):
    from edge.cli import main

    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, small_imatrix)
    before = path.read_bytes()
    assert main(["quantize", str(gemma_f16_path), str(path), "Q4_K_M", "--imatrix", str(path)]) == 1
    assert "is the --imatrix file" in capsys.readouterr().err and path.read_bytes() == before


def test_quantize_says_how_much_the_imatrix_covers(tmp_path, small_imatrix, gemma_f16_path, capsys):
    """edge quantize --imatrix reports its entries and how many converted tensors it weighted
    (gemma Q4_K_M: all 126 matrices of the blocks; token_embd takes none)."""
    from edge.cli import main

    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, small_imatrix)
    assert main(["quantize", str(gemma_f16_path), str(tmp_path / "out.gguf"), "Q4_K_M", "--imatrix", str(path)]) == 0
    assert f"imatrix {path}: 126 entries, 126 of the 127 converted tensors weighted by it" in capsys.readouterr().err


def test_two_dimensional_entries_are_read(tmp_path):
    """llama.cpp's loader takes in_sum2 [n, n_mat] with counts [1, n_mat] (n_mat matrices, e.g.
    experts) and divides each matrix's sums by its own count; a zero count gives weights of 1."""
    from gguf import GGUFWriter

    path = tmp_path / "two.gguf"
    w = GGUFWriter(path, arch="")
    w.kv_data[0].clear()
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["x.txt"])
    w.add_uint32("imatrix.chunk_count", 3)
    w.add_uint32("imatrix.chunk_size", 512)
    w.add_tensor("blk.0.ffn_up.weight.in_sum2", np.array([[2, 4, 6], [1, 1, 1]], np.float32))    # [3, 2]
    w.add_tensor("blk.0.ffn_up.weight.counts", np.array([[2], [0]], np.float32))                # [1, 2]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load_imatrix(path)
    assert loaded.chunk_count == 3 and loaded.datasets == ["x.txt"]
    assert loaded.weights["blk.0.ffn_up.weight"].tolist() == [1, 2, 3, 1, 1, 1]


def test_bad_files_are_named(tmp_path, gemma_path):
    with pytest.raises(ImatrixError, match="no such imatrix file"):
        load_imatrix(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x01\x00\x00\x00 not gguf")
    with pytest.raises(ImatrixError, match="cannot be read as a GGUF imatrix file.*legacy .dat"):
        load_imatrix(junk)
    with pytest.raises(ImatrixError, match="not an imatrix"):
        load_imatrix(gemma_path)


def test_cli_refuses_to_overwrite_its_inputs(tmp_path, gemma_path, capsys):
    """edge imatrix -o MODEL (or -o TEXT) is refused before anything runs: it would replace the
    model with the imatrix (a symlink here: were it not refused, only the link would go)."""
    from edge.cli import main

    (tmp_path / "model.gguf").symlink_to(gemma_path)
    text = tmp_path / "calib.txt"
    text.write_text((GOLDEN / "calib_text.txt").read_text(encoding="utf-8"), encoding="utf-8")
    for out, what in ((tmp_path / "model.gguf", "model"), (text, "text")):
        assert main(["imatrix", "-m", str(gemma_path), "-f", str(text), "-o", str(out), "-c", "64"]) == 1
        assert f"-o {out} is the {what} file; give another output path" in capsys.readouterr().err
    assert (tmp_path / "model.gguf").is_symlink() and text.stat().st_size > 1000
    # another GGUF (a model), a directory, a missing folder, batches under 16 rows: refused up front
    (tmp_path / "other.gguf").write_bytes(b"GGUF" + bytes(60))     # not an imatrix
    for out, extra, message in ((tmp_path / "other.gguf", [], "exists and is not an imatrix file"),
                                (tmp_path, [], "is a directory"),
                                (tmp_path / "none" / "x.gguf", [], "the folder"),
                                (tmp_path / "x.gguf", ["-b", "8"], "collects only batches of at least 16")):
        assert main(["imatrix", "-m", str(gemma_path), "-f", str(text), "-o", str(out), "-c", "64", *extra]) == 1
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "x.gguf").exists() and (tmp_path / "other.gguf").read_bytes() == b"GGUF" + bytes(60)


def test_too_short_text(gemma):
    with pytest.raises(ValueError, match="needs at least"):
        compute_imatrix(gemma, "short text", n_ctx=64)


# ---------------------------------------------------------------------------------------------
# quantization with the imatrix of calib_text.txt (slow)


@pytest.fixture(scope="module")
def calib_imatrix(gemma_quant_lab):
    """The imatrix of the F16 source on calib_text.txt with llama-imatrix's defaults (-c 512, all
    13 chunks), as a loaded file."""
    return load_imatrix(gemma_quant_lab.calib_imatrix())


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q4_0"])
def test_same_file_as_llama_quantize(gemma_quant_lab, gemma_f16_path, calib_imatrix, tmp_path, ftype, oracle_python):
    """edge's quantization with the calib imatrix (the session's file: Q4_K_M's is the one
    test_imatrix_lowers_kld measures) has the bytes of llama_model_quantize given the same weights."""
    ours = gemma_quant_lab.quantized(ftype, imatrix=True)
    np.savez(tmp_path / "w.npz", __file__=calib_imatrix.path, __dataset__=calib_imatrix.datasets[0],
             __chunks__=calib_imatrix.chunk_count, **calib_imatrix.weights)
    subprocess.run([str(oracle_python), str(ORACLE_SCRIPT), str(gemma_f16_path), str(tmp_path / "ll.gguf"), ftype,
                    str(tmp_path / "w.npz")], check=True, timeout=900, capture_output=True)
    a, b = ours.read_bytes(), (tmp_path / "ll.gguf").read_bytes()
    assert len(a) == len(b)
    assert a == b, f"first difference at byte {next(i for i in range(len(a)) if a[i] != b[i])}"


def _paired_kld_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of b - a (per-position KLDs f64[N] of the same positions) and its standard error."""
    d = b - a
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


KLD_CHUNKS = 4  # of ppl_text.txt's 13 chunks of 256, for test_imatrix_lowers_kld


@pytest.mark.slow
def test_imatrix_lowers_kld(gemma_quant_lab):
    """The issue's check: the calib_text imatrix brings Q3_K_M much closer to the F16 model (mean
    KLD on ppl_text.txt, as edge perplexity --kl-divergence). Measured on all 13 chunks of 256:
    Q3_K_M 0.268 -> 0.147.

    Q4_K_M of gemma-3-270m moves only within the noise: its rows of 640 leave few Q4_K tensors,
    and its biggest loss, the tied output matrix in Q8_0, takes no imatrix. Measured on all 13
    chunks: 0.00588 -> 0.00581, paired difference -0.00007 +- 0.00021 (earlier, 0.00589 -> 0.00596
    with edge's imatrix and 0.00581 with llama-imatrix's own of the same text, which differs from
    edge's by < 1e-3 relative, test_same_imatrix_as_llama_imatrix). So Q4_K_M is held to "not
    significantly worse".

    Both claims compare two quantizations on the same positions, so they are checked on the
    first KLD_CHUNKS chunks (508 scored tokens; a pass over all 13 costs three times as much, for
    each of the three models only this test runs). The imatrix's effect on Q3_K_M is systematic:
    the ratio is 0.39 .. 0.65 in every one of the 13 chunks, 0.181 -> 0.104 (0.575) over the first
    4; Q4_K_M's paired difference there is -0.00048 +- 0.00021. A broken imatrix (ignored: ratio 1;
    weights of the wrong columns: a higher KLD) still fails. Plain Q4_K_M is the all-chunks run
    the golden tests need; its first KLD_CHUNKS chunks are the imatrix run's positions."""
    q3 = gemma_quant_lab.kld("Q3_K_M", max_chunks=KLD_CHUNKS)
    q3w = gemma_quant_lab.kld("Q3_K_M", imatrix=True, max_chunks=KLD_CHUNKS)
    assert q3.n_chunks == q3w.n_chunks == KLD_CHUNKS
    assert q3w.summary()["kld"][0] < 0.75 * q3.summary()["kld"][0]
    q4w = gemma_quant_lab.kld("Q4_K_M", imatrix=True, max_chunks=KLD_CHUNKS)
    q4 = gemma_quant_lab.kld("Q4_K_M").kld[: q4w.count]
    diff, se = _paired_kld_difference(q4, q4w.kld)
    print(f"Q4_K_M, {KLD_CHUNKS} chunks: imatrix - plain mean KLD {diff:+.6f} +- {se:.6f}")
    assert diff < 2 * se


@pytest.mark.slow
def test_same_imatrix_as_llama_imatrix(gemma_quant_lab, gemma_f16_path, tmp_path, llama_cpp_tools):
    """llama-imatrix on the same model and text: the same entries, counts and chunk count, sums
    within 2e-3 of the largest (edge's F16 products round differently), and llama-quantize reads
    edge's file into the same bytes edge quantize writes with it."""
    from edge.gguf_file import GGUFFile

    theirs_path = tmp_path / "llama.imatrix.gguf"
    subprocess.run([str(llama_cpp_tools / "llama-imatrix"), "-m", str(gemma_f16_path), "-f", str(GOLDEN / "calib_text.txt"),
                    "-o", str(theirs_path), "-t", "2", "--no-ppl"], check=True, capture_output=True, timeout=900)
    ours, theirs = load_imatrix(gemma_quant_lab.calib_imatrix()), load_imatrix(theirs_path)
    assert set(ours.weights) == set(theirs.weights) and ours.chunk_count == theirs.chunk_count == 13
    for name, w in theirs.weights.items():
        assert np.abs(ours.weights[name] - w).max() <= 2e-3 * np.abs(w).max(), name
    a, b = GGUFFile(gemma_quant_lab.calib_imatrix()), GGUFFile(theirs_path)
    assert [(t.name, t.shape) for t in a.tensors.values()] == [(t.name, t.shape) for t in b.tensors.values()]
    assert all(a.tensor_f32(n).tolist() == b.tensor_f32(n).tolist() for n in a.tensors if n.endswith(".counts"))
    a.close()
    b.close()
    out = tmp_path / "ll-Q3_K_M.gguf"
    subprocess.run([str(llama_cpp_tools / "llama-quantize"), "--imatrix", str(gemma_quant_lab.calib_imatrix()),
                    str(gemma_f16_path), str(out), "Q3_K_M", "2"], check=True, capture_output=True, timeout=900)
    mine = gemma_quant_lab.quantized("Q3_K_M", imatrix=True)   # edge quantize --imatrix of the same file
    assert out.read_bytes() == mine.read_bytes()


def test_plan_with_imatrix(gemma_f16_path):
    """The metadata keys llama-quantize adds, the Q4_0 ffn_down rule, and a wrong-sized entry
    refused before anything is written."""
    from edge.imatrix import ImatrixFile
    from quant.mix import QuantizeOptions, parse_file_type
    from quant.pipeline import plan_quantize

    weights = {"blk.0.ffn_down.weight": np.ones(2048, np.float32)}
    imatrix = ImatrixFile(path="x" * 200, weights=weights, datasets=["calib.txt"], chunk_count=13)
    plan = plan_quantize(gemma_f16_path, parse_file_type("Q4_0"), QuantizeOptions(), imatrix)
    keys = [m[0] for m in plan.metadata]
    assert keys[-6:] == ["general.quantization_version", "general.file_type", "quantize.imatrix.file",
                         "quantize.imatrix.dataset", "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"]
    assert [m[1] for m in plan.metadata[-4:]] == [b"x" * 127, b"calib.txt", 1, 13]
    types = {t.name: t.new_type.name for t in plan.tensors}
    n_layer = sum(name.endswith("ffn_down.weight") for name in types)
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(n_layer)] == \
        ["Q4_1"] * (n_layer // 8) + ["Q4_0"] * (n_layer - n_layer // 8)
    bad = ImatrixFile(path="bad.gguf", weights={"blk.0.attn_q.weight": np.ones(64, np.float32)}, datasets=[],
                      chunk_count=0)
    with pytest.raises(ImatrixError, match="bad.gguf: the entry for blk.0.attn_q.weight has 64 values"):
        plan_quantize(gemma_f16_path, parse_file_type("Q4_K_M"), QuantizeOptions(), bad)
    empty = ImatrixFile(path="empty.gguf", weights={}, datasets=[], chunk_count=0)
    with pytest.raises(ImatrixError, match="empty.gguf has no entries"):
        plan_quantize(gemma_f16_path, parse_file_type("Q4_K_M"), QuantizeOptions(), empty)
    foreign = ImatrixFile(path="llama.gguf", weights={"layers.0.wq": np.ones(640, np.float32)}, datasets=[],
                          chunk_count=1)
    with pytest.raises(ImatrixError, match="llama.gguf: none of its 1 entries names a tensor"):
        plan_quantize(gemma_f16_path, parse_file_type("Q4_K_M"), QuantizeOptions(), foreign)
