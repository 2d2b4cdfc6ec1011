"""Embeddings (edge.embedding, edge.server.embeddings) against llama.cpp and through the clients.

The library: Engine.embed on qwen2.5-coder-0.5b, smollm2-135m and gemma-3-270m against
llama.cpp's embeddings (llama-cpp-python 0.3.36, ``Llama(embedding=True, pooling_type=...)``,
``.embed(texts)``, run as a subprocess: the oracle), pooled mean, last, cls and none (per token),
both normalised as llama-server does (euclidean). Measured on this 2-core machine (2026-12-06,
10 texts of 1 to 434 tokens, vectors of length 1): edge's default kernels, batched as
llama-cpp-python batches (every text that fits in one n_batch), are within 8e-3 (max |edge -
llama.cpp|) and a cosine of 0.9993 on qwen2.5-coder-0.5b / 1.5b and smollm2, 1.6e-2 and 0.9990
on gemma-3-270m (most texts within 1e-7); the server's batch-invariant kernels within 9e-3 and
0.9993 (qwen, smollm2), 2.5e-2 and 0.9975 (gemma). Asserted, with room for other CPUs
(llama.cpp's AVX2 kernels sum in another order): LIB_TOL / LIB_COS and SERVER_TOL / SERVER_COS.

The server (`edge serve -m smollm2`, started as a subprocess once per module, and one with
``--pooling none``): /v1/embeddings through the openai client (float and base64 equal to the
bit, default pooling last, usage, indexes), llama-server's /embedding shape (pooled: one
vector; pooling none: one unnormalised vector per token), Ollama's /api/embed and
/api/embeddings through the ollama client, errors (empty input, too long, dimensions,
encoding_format, unknown model 404, pooling none on /v1/embeddings), and a generation whose
greedy text does not change while embeddings run beside it (the scratch KV cache and
STEP_LOCK).

Without the oracle interpreter the llama.cpp comparisons skip, saying so (a failure with
EDGE_REQUIRE_ORACLE=1, tests/conftest.py).
"""
from __future__ import annotations

import base64
import json
import subprocess
import threading

import numpy as np
import pytest

from edge.embedding import (DEFAULT_POOLING, EmbeddingError, check_pooling, default_pooling, model_pooling,
                            normalize_vectors)
from edge.engine import ContextLengthExceeded, Engine
from tests.server_process import Server, assert_error

openai = pytest.importorskip("openai", reason="the routes are tested through the openai client (pip install -e .[test])")
ollama = pytest.importorskip("ollama", reason="the Ollama routes are tested through the ollama client")

# edge vs llama.cpp, on vectors normalised to length 1 (module docstring: measured values)
LIB_TOL, LIB_COS = 3e-2, 0.998          # Engine.embed, default kernels
SERVER_TOL, SERVER_COS = 4e-2, 0.995    # edge serve: batch-invariant kernels

TEXTS = ["Hello world", "def add(a, b):\n    return a + b",
         "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and "
         "again, and once more.", "x"]
# (golden id, poolings compared); "none" on the first text alone (llama-cpp-python's embed reads
# per-token vectors of later texts of a batch at the wrong offset)
ORACLE_JOBS = [("qwen2.5-coder-0.5b", ("mean", "last", "cls", "none")), ("smollm2-135m", ("mean", "last")),
               ("gemma3-270m", ("last",))]
SERVED = "smollm2-135m-instruct"
N_CTX = 256

_ORACLE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
jobs, texts, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
res = {}
for path, name, poolings in jobs:
    for pooling in poolings:
        pt = {"none": 0, "mean": 1, "cls": 2, "last": 3}[pooling]
        llm = Llama(model_path=path, embedding=True, pooling_type=pt, verbose=False, n_ctx=512, n_threads=2)
        if pooling == "none":
            res[f"{name}/none/0"] = np.asarray(llm.embed(texts[0], normalize=True), np.float32)
        else:
            for i, v in enumerate(llm.embed(texts, normalize=True)):
                res[f"{name}/{pooling}/{i}"] = np.asarray(v, np.float32)
        del llm
np.savez(out, **res)
"""


def _agree(got: np.ndarray, ref: np.ndarray, tol: float, cos: float, what: str) -> tuple[float, float]:
    """Assert |got - ref| <= tol everywhere and a cosine >= cos per vector; returns both measures."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    diff = float(np.abs(got - ref).max())
    g, r = np.atleast_2d(got).astype(np.float64), np.atleast_2d(ref).astype(np.float64)
    c = float(((g * r).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(r, axis=-1)).min())
    assert diff <= tol and c >= cos, f"{what}: max |diff| {diff:.3g} (tolerance {tol}), cosine {c:.6f} (>= {cos})"
    return diff, c


# ---- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two `edge serve` subprocesses on smollm2, started at once (the default pooling, and
    --pooling none); the tests wait for them when they first need them."""
    from tests.conftest import real_model_path

    path = real_model_path("smollm2-135m")
    folder = tmp_path_factory.mktemp("embed-serve")
    started = {"default": Server(["-m", str(path), "-np", "2", "-c", str(N_CTX)], folder / "serve.log"),
               "none": Server(["-m", str(path), "-np", "1", "-c", str(N_CTX), "--pooling", "none", "--embeddings"],
                              folder / "serve-none.log")}
    try:
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def _ready(srv: Server) -> Server:
    srv.wait_ready(180)
    return srv


@pytest.fixture(scope="module")
def server(servers):
    return _ready(servers["default"])


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle(servers, oracle_python, tmp_path_factory):
    """llama.cpp's normalised embeddings: {"model/pooling/i": f32[n_embd] (none: f32[T, n_embd])}."""
    from tests.conftest import real_model_path

    out = tmp_path_factory.mktemp("embed-oracle") / "oracle.npz"
    jobs = [(str(real_model_path(g)), g, list(p)) for g, p in ORACLE_JOBS]
    proc = subprocess.run([str(oracle_python), "-c", _ORACLE, json.dumps(jobs), json.dumps(TEXTS), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


_engines: dict[str, Engine] = {}


def _engine(golden_id: str) -> Engine:
    from tests.conftest import real_model_path

    if golden_id not in _engines:
        _engines[golden_id] = Engine(real_model_path(golden_id), n_ctx=512)
    return _engines[golden_id]


# ---- without a model --------------------------------------------------------------------------------------

def test_normalize_as_common_embd_normalize():
    """-1 none, 0 max-abs to 32760, 1 taxicab, 2 euclidean, p-norm; zero stays zero; rows apart."""
    x = np.array([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(normalize_vectors(x, -1), x)
    np.testing.assert_allclose(normalize_vectors(x, 0)[0], [3 * 32760 / 4, -32760, 0], rtol=1e-6)
    np.testing.assert_allclose(normalize_vectors(x, 1)[0], [3 / 7, -4 / 7, 0], rtol=1e-6)
    np.testing.assert_allclose(normalize_vectors(x, 2)[0], [0.6, -0.8, 0], rtol=1e-6)
    p3 = (27 + 64) ** (1 / 3)
    np.testing.assert_allclose(normalize_vectors(x, 3)[0], [3 / p3, -4 / p3, 0], rtol=1e-6)
    for p in (-1, 0, 1, 2, 3):
        assert not normalize_vectors(x, p)[1].any()
    for bad in (-2, 1.5, True, "2"):
        with pytest.raises(EmbeddingError) as e:
            normalize_vectors(x, bad)
        assert e.value.param == "normalize"


def test_pooling_from_the_file():
    """{arch}.pooling_type names the pooling (llama.h's enum); without it, last; rank is refused."""
    class Fake:
        def __init__(self, value):
            self.fields = {"bert.pooling_type": value} if value is not None else {}

        def get_str(self, key, default=None):
            return "bert"

        def get_int(self, key, required=True):
            return self.fields[key]

    assert [model_pooling(Fake(v)) for v in (None, 0, 1, 2, 3, 4)] == [None, "none", "mean", "cls", "last", "rank"]
    assert default_pooling(Fake(None)) == DEFAULT_POOLING == "last" and default_pooling(Fake(1)) == "mean"
    with pytest.raises(EmbeddingError, match="not a pooling type"):
        model_pooling(Fake(9))
    with pytest.raises(EmbeddingError, match="rank pooling"):
        check_pooling("rank")


# ---- the library against llama.cpp -------------------------------------------------------------------------

@pytest.mark.parametrize("golden_id,pooling", [(g, p) for g, ps in ORACLE_JOBS for p in ps])
def test_library_equals_llama_cpp(golden_id, pooling, oracle):
    engine = _engine(golden_id)
    engine.model.set_batch_invariant(False)
    texts = TEXTS[:1] if pooling == "none" else TEXTS
    got = engine.embed(texts, pooling=pooling)
    worst = [_agree(v, oracle[f"{golden_id}/{pooling}/{i}"], LIB_TOL, LIB_COS, f"{golden_id} {pooling} text {i}")
             for i, v in enumerate(got)]
    print(f"{golden_id} {pooling}: max |diff| {max(w[0] for w in worst):.2e}, min cosine {min(w[1] for w in worst):.7f}")


def test_library_inputs_and_scratch_cache():
    """Texts and their token lists give the same vectors; the engine's own KV cache is never
    made; an input longer than n_batch (chunks) equals it in one pass (batch-invariant);
    errors: empty, past n_ctx, bad token; truncate cuts to n_ctx."""
    engine = _engine("qwen2.5-coder-0.5b")
    engine.model.set_batch_invariant(True)
    ids = [engine.tokenizer.encode(t, add_special=True, parse_special=True) for t in TEXTS]
    by_text = engine.embed(TEXTS, pooling="mean")
    by_ids = engine.embed(ids, pooling="mean")
    for a, b in zip(by_text, by_ids):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(engine.embed(ids[1], pooling="mean")[0], by_text[1])   # one token list
    assert engine._kv is None                     # the paged KV cache was never created
    long = ids[2] * 2                             # 60+ tokens
    poolings = ("mean", "last", "cls", "none")
    one_pass = {p: engine.embed([long], pooling=p, normalize=-1)[0] for p in poolings}
    engine.n_batch = 16
    try:
        for p in poolings:                        # four or more passes of 16 rows
            np.testing.assert_array_equal(engine.embed([long], pooling=p, normalize=-1)[0], one_pass[p])
    finally:
        engine.n_batch = 512
    whole = one_pass["none"]
    assert whole.shape == (len(long), engine.model.args.n_embd)
    np.testing.assert_allclose(engine.embed([long], pooling="last", normalize=-1)[0], whole[-1], rtol=0, atol=0)
    with pytest.raises(EmbeddingError, match="no tokens"):
        engine.embed([[1, 2], []])
    with pytest.raises(ContextLengthExceeded):
        engine.embed([[1] * 513])
    assert engine.embed([[1] * 513], truncate=True)[0].shape == (engine.model.args.n_embd,)
    with pytest.raises(EmbeddingError, match="not in the vocabulary"):
        engine.embed([[engine.model.args.n_vocab]])


# ---- the server -----------------------------------------------------------------------------------------------

def test_served_equals_llama_cpp(oai, oracle):
    """/v1/embeddings (the default pooling, last) against llama.cpp's last pooling: SERVER_TOL / SERVER_COS."""
    got = oai.embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    worst = [_agree(np.asarray(d.embedding, np.float32), oracle[f"smollm2-135m/last/{i}"], SERVER_TOL, SERVER_COS,
                    f"served text {i}") for i, d in enumerate(got.data)]
    print(f"served smollm2 last: max |diff| {max(w[0] for w in worst):.2e}, min cosine {min(w[1] for w in worst):.7f}")


def test_openai_client_float_and_base64(oai, server):
    """client.embeddings.create: floats, the client's default (base64, decoded) and base64 as
    sent are the same float32 values; usage; indexes; a text, its token list, and it in a list."""
    floats = oai.embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    default = oai.embeddings.create(model=SERVED, input=TEXTS)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.model == SERVED and floats.object == "list"
    n_tokens = floats.usage.prompt_tokens
    assert n_tokens == floats.usage.total_tokens == default.usage.total_tokens > len(TEXTS)
    status, raw = server.post("/v1/embeddings", {"model": SERVED, "input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    for i, d in enumerate(floats.data):
        v = np.asarray(d.embedding, np.float32)
        assert v.shape == (576,)
        np.testing.assert_array_equal(np.asarray(default.data[i].embedding, np.float32), v)
        sent = np.frombuffer(base64.b64decode(raw["data"][i]["embedding"]), "<f4")
        np.testing.assert_array_equal(sent, v)
        assert raw["data"][i]["object"] == "embedding" and raw["data"][i]["index"] == i
        assert abs(float(np.linalg.norm(v.astype(np.float64))) - 1) < 1e-6
    one = oai.embeddings.create(model=SERVED, input=TEXTS[1], encoding_format="float")
    np.testing.assert_array_equal(np.asarray(one.data[0].embedding, np.float32),
                                  np.asarray(floats.data[1].embedding, np.float32))
    status, ids = server.post("/tokenize", {"content": TEXTS[1], "add_special": True})
    tok = oai.embeddings.create(model=SERVED, input=[ids["tokens"]], encoding_format="float")
    np.testing.assert_array_equal(np.asarray(tok.data[0].embedding, np.float32),
                                  np.asarray(one.data[0].embedding, np.float32))
    assert tok.usage.prompt_tokens == len(ids["tokens"])


def test_llama_server_embedding_shape(server, servers):
    """/embedding (and /embeddings): [{"index", "embedding": [[...]]}] per input; pooled is one
    vector equal to /v1/embeddings'; with --pooling none one unnormalised vector per token,
    whose last row is the pooled-last vector before its normalisation."""
    status, native = server.post("/embedding", {"content": TEXTS[:2]})
    status2, same = server.post("/embeddings", {"input": TEXTS[:2]})
    _, oai_raw = server.post("/v1/embeddings", {"input": TEXTS[:2]})
    assert status == status2 == 200 and native == same
    assert [set(x) for x in native] == [{"index", "embedding"}] * 2 and [x["index"] for x in native] == [0, 1]
    for x, d in zip(native, oai_raw["data"]):
        assert len(x["embedding"]) == 1 and x["embedding"][0] == d["embedding"]
    none = _ready(servers["none"])
    status, per_token = none.post("/embedding", {"content": TEXTS[0]})
    _, ids = none.post("/tokenize", {"content": TEXTS[0], "add_special": True})
    assert status == 200 and len(per_token) == 1
    rows = np.asarray(per_token[0]["embedding"], np.float32)
    assert rows.shape == (len(ids["tokens"]), 576)
    assert abs(float(np.linalg.norm(rows[-1])) - 1) > 0.1           # not normalised
    last = np.asarray(native[0]["embedding"][0], np.float32)
    np.testing.assert_allclose(normalize_vectors(rows[-1]), last, rtol=0, atol=1e-6)
    status, body = none.post("/v1/embeddings", {"input": "hi"})
    assert_error(status, body, 400, param="input")
    assert body["error"]["message"] == "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
    _, o = none.post("/api/embed", {"model": SERVED, "input": TEXTS[0]})   # Ollama's runner: the last token
    np.testing.assert_allclose(np.asarray(o["embeddings"][0], np.float32), last, rtol=0, atol=1e-6)


def test_ollama_client_embed(server, oai):
    """client.embed: Ollama's shape, euclidean vectors equal to /v1/embeddings'; dimensions cut and
    normalise again; the legacy client.embeddings is not normalised; truncate."""
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)
    r = client.embed(model=SERVED, input=TEXTS[:2])
    ref = oai.embeddings.create(model=SERVED, input=TEXTS[:2], encoding_format="float")
    assert r.model == SERVED and len(r.embeddings) == 2
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.total_duration >= r.load_duration >= 0 and r.total_duration > 0
    for got, want in zip(r.embeddings, ref.data):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.embedding, np.float32))
    one = client.embed(model=f"{SERVED}:latest", input=TEXTS[0])
    np.testing.assert_array_equal(np.asarray(one.embeddings[0], np.float32), np.asarray(r.embeddings[0], np.float32))
    short = np.asarray(client.embed(model=SERVED, input=TEXTS[0], dimensions=8).embeddings[0], np.float32)
    np.testing.assert_allclose(short, normalize_vectors(np.asarray(r.embeddings[0], np.float32)[:8]), atol=1e-6)
    legacy = np.asarray(client.embeddings(model=SERVED, prompt=TEXTS[0]).embedding, np.float32)
    assert abs(float(np.linalg.norm(legacy)) - 1) > 0.1
    np.testing.assert_allclose(normalize_vectors(legacy), np.asarray(r.embeddings[0], np.float32), atol=1e-6)
    assert client.embed(model=SERVED, input=[]).embeddings == []          # loads the model
    assert client.embeddings(model=SERVED, prompt="").embedding == []
    long = "hello " * (N_CTX + 10)
    assert client.embed(model=SERVED, input=long).prompt_eval_count == N_CTX          # truncate: true (default)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=SERVED, input=long, truncate=False)
    assert (e.value.status_code, e.value.error) == (400, "the input length exceeds the context length")
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="llama3.2", input="hi")
    assert (e.value.status_code, e.value.error) == (404, 'model "llama3.2" not found, try pulling it first')


def test_errors(server):
    """400 naming the field: empty, too long, a bad token, dimensions, encoding_format,
    embd_normalize, no input; 404 for a model not served."""
    cases = [({"input": ""}, "input", "Input content cannot be empty"),
             ({"input": ["a", ""]}, "input", "Input content cannot be empty"),
             ({"input": []}, "input", None),
             ({"input": "hello " * (N_CTX + 10)}, "input", None),
             ({"input": [[1, 10**9]]}, "input", "vocabulary"),
             ({"input": "hi", "dimensions": 8}, "dimensions", "576"),
             ({"input": "hi", "encoding_format": "hex"}, "encoding_format", None),
             ({"input": "hi", "embd_normalize": -2}, "embd_normalize", None),
             ({"model": SERVED}, "input", None)]
    for body, param, words in cases:
        status, out = server.post("/v1/embeddings", {"model": SERVED, **body})
        err = assert_error(status, out, 400, param=param)
        assert words is None or words in err["message"], (body, err)
    status, out = server.post("/v1/embeddings", {"model": SERVED, "input": "hello " * (N_CTX + 10)})
    assert out["error"]["code"] == "context_length_exceeded"
    status, out = server.post("/v1/embeddings", {"model": "no-such-model", "input": "hi"})
    assert status == 200 and len(out["data"]) == 1         # a -m server serves any name (llama-server)
    status, out = server.post("/embedding", {"content": ""})
    assert_error(status, out, 400, param="input")


def test_generation_beside_embeddings(server, oai):
    """A greedy completion's text is the same while embedding requests run beside it (their own
    KV cache; forward passes take turns under STEP_LOCK)."""
    ask = dict(model=SERVED, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    alone = oai.completions.create(**ask).choices[0].text
    errors = []

    def embed_many():
        try:
            for _ in range(4):
                oai.embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
        except Exception as e:          # reported below
            errors.append(e)

    t = threading.Thread(target=embed_many)
    t.start()
    beside = oai.completions.create(**ask).choices[0].text
    t.join(120)
    assert not errors and beside == alone
    m = server.wait_idle()
    assert m["edge_kv_blocks_used"] == 0
