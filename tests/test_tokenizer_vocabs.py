"""llama.cpp's own tokenizer test vectors (tests/test-tokenizer-0.cpp), case for case.

The sdist of llama-cpp-python 0.3.36 (the oracle's version) holds llama.cpp's
``models/ggml-vocab-<name>.gguf`` (tokenizer metadata only, no tensors) with ``.gguf.inp``
(texts separated by ``\\n__ggml_vocab_test__\\n``) and ``.gguf.out`` (one line of expected
ids per text). test-tokenizer-0 tokenizes each text with ``add_special=false,
parse_special=false`` and compares the ids; it does not check the decoded text, so the decode
check here asks the oracle itself (``llama_detokenize``). The sdist is fetched once with pip
into ``${XDG_CACHE_HOME:-~/.cache}/edge/test-data/`` and only the vocab files are extracted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from edge.gguf_file import GGUFError, GGUFFile
from edge.tokenizer import Tokenizer

SDIST_VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
MODELS_DIR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/"
TEST_DATA = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge" / "test-data"
SEPARATOR = "\n__ggml_vocab_test__\n"

# vocab -> number of distinct test texts (test-tokenizer-0 keeps them in a std::map)
VOCABS_WITH_TESTS = {
    "bert-bge": 46, "command-r": 46, "deepseek-coder": 46, "deepseek-llm": 46, "falcon": 46, "gemma-4": 46,
    "gpt-2": 46, "llama-bpe": 46, "llama-spm": 46, "mpt": 46, "phi-3": 46, "qwen2": 46, "qwen35": 50,
    "refact": 46, "starcoder": 46,
}
# vocabs shipped without test texts: each must load (or be refused with a one-line error)
VOCABS_WITHOUT_TESTS = {"aquila": "gpt2", "baichuan": "llama", "gpt-neox": "gpt2", "nomic-bert-moe": None}


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """The folder of llama.cpp's ggml-vocab-* files, fetched and extracted on first use."""
    folder = TEST_DATA / f"llama.cpp-vocabs-{SDIST_VERSION}"
    done = folder / ".complete"
    if done.is_file():
        return folder
    sdist = TEST_DATA / SDIST
    if not sdist.is_file():
        TEST_DATA.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={SDIST_VERSION}", "-d", str(TEST_DATA)],
                              check=False, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not sdist.is_file():
            pytest.skip(f"could not fetch {SDIST} with pip: {proc.stderr.strip()[-300:]}")
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(MODELS_DIR)
            if member.isfile() and name != member.name and name.startswith("ggml-vocab-") and "/" not in name:
                with tar.extractfile(member) as src:
                    (folder / name).write_bytes(src.read())
    done.write_text("ok\n")
    return folder


def read_cases(gguf_path: Path) -> dict[str, list[int]]:
    """text -> expected ids, read as test-tokenizer-0's ``read_tests`` does (a later
    duplicate text wins; a separator at the very end opens no empty case)."""
    raw = gguf_path.with_name(gguf_path.name + ".inp").read_bytes().decode("utf-8")
    lines = gguf_path.with_name(gguf_path.name + ".out").read_bytes().decode("utf-8").split("\n")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), f"{gguf_path.name}: {len(texts)} texts but {len(lines)} id lines"
    return {t: [int(x) for x in line.split()] for t, line in zip(texts, lines)}


@pytest.fixture(scope="module")
def tokenizers(vocab_dir):
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_gguf(GGUFFile(vocab_dir / f"ggml-vocab-{name}.gguf"))
        return cache[name]

    return get


def test_the_sdist_has_the_vocabs_we_expect(vocab_dir):
    """The parametrization below covers every vocab of the sdist (none is silently left out)."""
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_dir.glob("ggml-vocab-*.gguf")}
    with_tests = {n for n in names if (vocab_dir / f"ggml-vocab-{n}.gguf.inp").is_file()}
    assert with_tests == set(VOCABS_WITH_TESTS)
    assert names - with_tests == set(VOCABS_WITHOUT_TESTS)


@pytest.mark.parametrize("name", sorted(VOCABS_WITH_TESTS))
def test_llama_cpp_vocab_cases(vocab_dir, tokenizers, name, record_property):
    """Every case of the vocab gives llama.cpp's ids (test-tokenizer-0: no BOS/EOS, no specials)."""
    tok = tokenizers(name)
    cases = read_cases(vocab_dir / f"ggml-vocab-{name}.gguf")
    assert len(cases) == VOCABS_WITH_TESTS[name]
    failed = [(text, want, got) for text, want in cases.items()
              if (got := tok.encode(text, add_special=False, parse_special=False)) != want]
    record_property("cases_passed", f"{len(cases) - len(failed)}/{len(cases)}")
    assert not failed, f"{len(failed)}/{len(cases)} cases differ, first: {failed[0]!r}"


@pytest.mark.parametrize("name", sorted(VOCABS_WITHOUT_TESTS))
def test_vocabs_without_cases_load_or_refuse_clearly(vocab_dir, name):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    model = VOCABS_WITHOUT_TESTS[name]
    if model is None:
        with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model 't5' is not supported"):
            Tokenizer.from_gguf(GGUFFile(path))
        return
    tok = Tokenizer.from_gguf(GGUFFile(path))
    assert tok.model == model and tok.encode("Hello world", False, False)


_DETOKENIZE = r"""
import json, sys, llama_cpp
path, cases = sys.argv[1], json.load(sys.stdin)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(path.encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
out = []
for ids in cases:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = llama_cpp.ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, False)
    out.append(buf.raw[:n].hex())
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", sorted(VOCABS_WITH_TESTS))
def test_llama_cpp_vocab_decode_matches_oracle(vocab_dir, tokenizers, oracle_python, name):
    """``decode`` of each case's ids gives the bytes of llama.cpp's ``llama_detokenize``."""
    tok = tokenizers(name)
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    ids = list(read_cases(path).values())
    proc = subprocess.run([str(oracle_python), "-c", _DETOKENIZE, str(path)], input=json.dumps(ids),
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = [bytes.fromhex(h) for h in json.loads(proc.stdout)]
    got = [tok.decode(i) for i in ids]
    bad = [(i, w, g) for i, w, g in zip(ids, want, got) if w != g]
    assert not bad, f"{len(bad)}/{len(ids)} decodes differ, first: {bad[0]!r}"
