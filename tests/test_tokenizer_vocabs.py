"""llama.cpp's own tokenizer test vectors (tests/test-tokenizer-0.cpp), case for case.

The sdist of llama-cpp-python 0.3.36 (the oracle's version) holds llama.cpp's
``models/ggml-vocab-<name>.gguf`` (tokenizer metadata only, no tensors) with ``.gguf.inp``
(texts separated by ``\\n__ggml_vocab_test__\\n``) and ``.gguf.out`` (one line of expected
ids per text). test-tokenizer-0 tokenizes each text with ``add_special=false,
parse_special=false`` and compares the ids; it does not check the decoded text, so the decode
check here asks the oracle itself (``llama_detokenize``). The sdist is fetched once with pip
into ``${XDG_CACHE_HOME:-~/.cache}/edge/test-data/``; only the vocab files and two sources
(src/llama-vocab.cpp, src/unicode-data.cpp, read by the table checks) are extracted.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import regex

from edge.gguf_file import GGUFFile
from edge.tokenizer import Tokenizer
from edge.tokenizer.pretokenize import llama_cpp_categories
from edge.tokenizer.pretypes import PRE_TOKENIZERS, UNSUPPORTED_PRE_TOKENIZERS

SDIST_VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
LLAMA_CPP_DIR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
SOURCES = ("src/llama-vocab.cpp", "src/unicode-data.cpp")
TEST_DATA = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge" / "test-data"
SEPARATOR = "\n__ggml_vocab_test__\n"

# vocab -> number of distinct test texts (test-tokenizer-0 keeps them in a std::map)
VOCABS_WITH_TESTS = {
    "bert-bge": 46, "command-r": 46, "deepseek-coder": 46, "deepseek-llm": 46, "falcon": 46, "gemma-4": 46,
    "gpt-2": 46, "llama-bpe": 46, "llama-spm": 46, "mpt": 46, "phi-3": 46, "qwen2": 46, "qwen35": 50,
    "refact": 46, "starcoder": 46,
}
# vocabs shipped without test texts (vocab -> tokenizer.ggml.model): checked against the oracle
# on the texts of VOCABS_FOR_TEXTS instead
VOCABS_WITHOUT_TESTS = {"aquila": "gpt2", "baichuan": "llama", "gpt-neox": "gpt2", "nomic-bert-moe": "t5"}
VOCABS_FOR_TEXTS = ("gpt-2", "qwen35")


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """The folder of llama.cpp's ggml-vocab-* files (and :data:`SOURCES` by their base names),
    fetched and extracted on first use."""
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
            msg = f"could not fetch {SDIST} with pip: {proc.stderr.strip()[-300:]}"
            if os.environ.get("EDGE_REQUIRE_ORACLE") == "1":   # CI: no silent skip
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
    part = folder.with_name(f"{folder.name}.part-{os.getpid()}")
    part.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            path = member.name.removeprefix(LLAMA_CPP_DIR)
            name = path.removeprefix("models/")
            wanted = path in SOURCES or (name != path and name.startswith("ggml-vocab-") and "/" not in name)
            if member.isfile() and path != member.name and wanted:
                with tar.extractfile(member) as src:
                    (part / Path(path).name).write_bytes(src.read())
    (part / ".complete").write_text("ok\n")
    if not done.is_file():
        if folder.exists():
            shutil.rmtree(folder)
        part.rename(folder)
    else:
        shutil.rmtree(part)
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
    assert all((vocab_dir / Path(s).name).is_file() for s in SOURCES)
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
def test_vocabs_without_cases_load(tokenizers, name):
    tok = tokenizers(name)
    assert tok.model == VOCABS_WITHOUT_TESTS[name] and tok.encode("Hello world", False, False)


# the oracle: llama-cpp-python loads the vocab (argv[1]) and reads json cases from stdin
_ORACLE_VOCAB = r"""
import json, sys, llama_cpp
path, cases = sys.argv[1], json.load(sys.stdin)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(path.encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
"""
_DETOKENIZE = _ORACLE_VOCAB + r"""
out = []
for ids in cases:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = llama_cpp.ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, False)
    out.append(buf.raw[:n].hex())
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", sorted(VOCABS_WITH_TESTS) + sorted(VOCABS_WITHOUT_TESTS))
def test_llama_cpp_vocab_decode_matches_oracle(vocab_dir, tokenizers, oracle_python, name):
    """``decode`` of each case's ids gives the bytes of llama.cpp's ``llama_detokenize`` (for a
    vocab without cases: the ids of the :data:`VOCABS_FOR_TEXTS` texts, with BOS/EOS)."""
    tok = tokenizers(name)
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    if name in VOCABS_WITH_TESTS:
        ids = list(read_cases(path).values())
    else:
        ids = [tok.encode(t, True, True) for v in VOCABS_FOR_TEXTS for t in read_cases(vocab_dir / f"ggml-vocab-{v}.gguf")]
    proc = subprocess.run([str(oracle_python), "-c", _DETOKENIZE, str(path)], input=json.dumps(ids),
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = [bytes.fromhex(h) for h in json.loads(proc.stdout)]
    got = [tok.decode(i) for i in ids]
    bad = [(i, w, g) for i, w, g in zip(ids, want, got) if w != g]
    assert not bad, f"{len(bad)}/{len(ids)} decodes differ, first: {bad[0]!r}"


# ---------------------------------------------------------------- the pre-tokenizer table vs llama-vocab.cpp
def _c_string(body: str) -> str:
    """The value of a C string literal's body (the escapes llama-vocab.cpp's regexes use)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _llama_cpp_pre_types(source: str) -> dict[str, dict]:
    """``tokenizer.ggml.pre`` name -> {pre_type, flags set beside it} from ``llama_vocab::impl::load``."""
    chain = source[source.index("if (tokenizer_pre.empty())"):source.index('"unknown pre-tokenizer type')]
    out = {}
    for branch in chain.split("} else if (")[1:]:
        pre_type = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", branch).group(1)
        flags = dict(re.findall(r"\b(clean_spaces|ignore_merges|add_bos|escape_whitespaces) = (true|false);", branch))
        facts = {"pre_type": pre_type, "no_bos": "special_bos_id = LLAMA_TOKEN_NULL" in branch,
                 **{k: v == "true" for k, v in flags.items()}}
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', branch):
            out[name] = facts
    return out


def _llama_cpp_regexes(source: str) -> dict[str, tuple[tuple[str, ...], bool]]:
    """pre_type -> (regex_exprs, byte_encode) from ``llm_tokenizer_bpe``'s constructor."""
    start = source.index("struct llm_tokenizer_bpe : llm_tokenizer {")
    body = source[start:source.index("std::vector<std::string> regex_exprs;", start)]
    out = {}
    for block in re.split(r"\n\s*break;", body):
        code = "\n".join(line for line in block.split("\n") if not line.strip().startswith("//"))
        exprs = tuple(_c_string(e) for e in re.findall(r'^\s*"((?:[^"\\]|\\.)*)",?\s*(?://.*)?$', code, re.MULTILINE))
        for pre_type in re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", block) + ["DEFAULT"] * ("default:" in block):
            out[pre_type] = (exprs, "byte_encode = false" not in block)
    return out


def test_pre_tokenizer_table_is_llama_cpps(vocab_dir):
    """Every ``tokenizer.ggml.pre`` name of llama.cpp 0.3.36 is in PRE_TOKENIZERS (or refused on
    purpose), with the regexes, byte encoding and flags that llama.cpp gives its pre_type."""
    source = (vocab_dir / "llama-vocab.cpp").read_text()
    names, regexes = _llama_cpp_pre_types(source), _llama_cpp_regexes(source)
    assert len(names) > 90
    assert set(names) == (set(PRE_TOKENIZERS) - {"gpt2"}) | set(UNSUPPORTED_PRE_TOKENIZERS)
    for name, facts in names.items():
        if name in UNSUPPORTED_PRE_TOKENIZERS:
            continue
        spec, gemma4 = PRE_TOKENIZERS[name], facts["pre_type"] == "GEMMA4"
        assert (spec.regexes, spec.byte_encode) == regexes[facts["pre_type"]], name
        assert spec.clean_spaces == facts.get("clean_spaces", True), name
        assert spec.ignore_merges == facts.get("ignore_merges", False), name
        assert spec.add_bos == facts.get("add_bos", False), name
        assert spec.escape_whitespaces == facts.get("escape_whitespaces", False), name
        assert spec.default_bos == (not facts["no_bos"]), name
        assert (spec.force_add_bos, spec.newline_tokens) == (gemma4, gemma4), name
    assert PRE_TOKENIZERS["gpt2"] == PRE_TOKENIZERS["gpt-2"]


def test_unicode_categories_are_llama_cpps(vocab_dir):
    """For all 1,114,112 code points, the ``regex`` module's category of
    ``llama_cpp_categories(text)`` is llama.cpp's (``unicode_ranges_flags``), and ``\\s`` is
    llama.cpp's ``unicode_set_whitespace``: the pre-tokenizer's categories are llama.cpp's."""
    source = (vocab_dir / "unicode-data.cpp").read_text()

    def table(name: str) -> str:
        start = source.index(name)
        return source[start:source.index("};", start)]

    starts = [(int(a, 16), int(f, 16)) for a, f in re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}",
                                                              table("unicode_ranges_flags = {"))]
    flags = np.zeros(0x110000, dtype=np.int64)
    for (a, f), (b, _) in itertools.pairwise(starts):
        flags[a:b] = f
    whitespace = {int(c, 16) for c in re.findall(r"0x([0-9A-F]+)", table("unicode_set_whitespace = {"))}
    text = llama_cpp_categories("".join(map(chr, range(0x110000))))

    def where(pattern: str) -> np.ndarray:
        hit = np.zeros(0x110000, dtype=bool)
        hit[[m.start() for m in regex.finditer(pattern, text)]] = True
        return hit

    for bit, pattern in ((0x01, r"\p{Cn}"), (0x02, r"\p{N}"), (0x04, r"\p{L}"), (0x08, r"\p{Z}"), (0x10, r"\p{M}"),
                         (0x20, r"\p{P}"), (0x40, r"\p{S}"), (0x80, r"[\p{Cc}\p{Cf}\p{Co}\p{Cs}]")):
        differ = np.flatnonzero(where(pattern) != ((flags & bit) != 0))
        assert not differ.size, f"{pattern}: {differ.size} code points differ, first U+{differ[0]:04X}"
    assert set(np.flatnonzero(where(r"\s")).tolist()) == whitespace


_TOKENIZE = _ORACLE_VOCAB + r"""
buf = (llama_cpp.llama_token * 4096)()
out = []
for text in cases:
    raw = text.encode()
    for add_special in (False, True):
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, True)
        out.append(list(buf[:n]))
print(json.dumps(out))
"""


# tokens llama.cpp's load() treats by their text
_NAMED_BY_LLAMA_CPP = {"</s>", "<|end|>", "<|channel|>", "<|start|>", "<mask>", "[MASK]", "<|endoftext|>", "<unk>"}


def _special_texts(tok: Tokenizer) -> list[str]:
    """Texts around a vocab's special tokens (by GGUF token type: control, user-defined,
    unknown; the first few, BOS/EOS and those llama.cpp names), with the whitespace LSTRIP/RSTRIP
    would eat."""
    special = [i for i in range(tok.n_vocab) if tok.token_types[i] in (2, 3, 4)]
    named = [i for i in range(tok.n_vocab) if tok.token_text(i) in _NAMED_BY_LLAMA_CPP]
    picks = [t for t in dict.fromkeys(special[:3] + [tok.bos_id, tok.eos_id] + special[-2:] + named) if t is not None]
    texts = []
    for a, b in zip(picks, picks[1:] + picks[:1]):
        sa, sb = tok.token_text(a), tok.token_text(b)
        texts += [f"{sa}hello{sb}", f" {sa} \n {sb}\n\nworld  {sa}", f"x{sa}{sa}  y", f"\t{sb} ", sa]
    return texts


@pytest.mark.parametrize("name", sorted(VOCABS_WITH_TESTS) + sorted(VOCABS_WITHOUT_TESTS))
def test_llama_cpp_vocab_special_tokens_match_oracle(vocab_dir, tokenizers, oracle_python, name):
    """``encode(parse_special=True)``, with and without BOS/EOS, gives llama_tokenize's ids on
    texts around the vocab's special tokens (their matching, LSTRIP/RSTRIP, BOS/EOS rules);
    a vocab without test texts gets all those of :data:`VOCABS_FOR_TEXTS` too."""
    tok = tokenizers(name)
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    if name in VOCABS_WITH_TESTS:
        texts = _special_texts(tok) + list(read_cases(path))[:12]
    else:
        texts = _special_texts(tok) + [t for v in VOCABS_FOR_TEXTS for t in read_cases(vocab_dir / f"ggml-vocab-{v}.gguf")]
    proc = subprocess.run([str(oracle_python), "-c", _TOKENIZE, str(path)], input=json.dumps(texts),
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = iter(json.loads(proc.stdout))
    bad = [(text, add, w, got) for text in texts for add in (False, True)
           if (w := next(want)) != (got := tok.encode(text, add_special=add, parse_special=True))]
    assert not bad, f"{len(bad)}/{2 * len(texts)} differ, first: {bad[0]!r}"


def _with_string(source: bytes, name: str, key: str = "tokenizer.ggml.pre") -> bytes:
    """A tensor-less GGUF with the string value of ``key`` replaced by ``name``."""
    key = key.encode()
    at = source.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    vtype, n = struct.unpack_from("<IQ", source, at)
    assert vtype == 8  # GGUF string
    value = name.encode()
    return source[:at] + struct.pack("<IQ", 8, len(value)) + value + source[at + 12 + n:]


_TOKENIZE_MANY = r"""
import json, sys, llama_cpp
paths, texts = sys.argv[1:], json.load(sys.stdin)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
buf = (llama_cpp.llama_token * 4096)()
out = []
for path in paths:
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    for text in texts:
        raw = text.encode()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
        out.append(list(buf[:n]))
    llama_cpp.llama_model_free(model)
print(json.dumps(out))
"""
_EXTRA_TEXTS = ["1234567 89 1,234,567.0", "naïve café\u0301 Ünïcödé", "我想在apple工作1314151天～ 한국어 テスト",
                "x\u00a0y\u2003z  \t\n \r\n  end ", "I'M you'LL we'Re it's", "<sentinel:12> IMGIMGABZ", "a//b\\\\c",
                "HeLLo WORLDs camelCaseWord ÀÉÎõü", " iPhone iPad eBay McDonald"]


def test_every_pre_tokenizer_matches_oracle(vocab_dir, tokenizers, oracle_python, tmp_path):
    """Each distinct pre-tokenizer of the table, put on the gpt-2 vocab in place of "gpt-2"
    (and the "whitespace" tokenizer model), splits and merges as llama.cpp does: the ids (with
    BOS/EOS) equal llama_tokenize's on the gpt-2 and qwen35 case texts and a few more (digits,
    marks, CJK, odd spaces, mixed case)."""
    source = (vocab_dir / "ggml-vocab-gpt-2.gguf").read_bytes()
    # "whitespace" leaves whitespace pieces that llama.cpp's BPE asserts against (find_bpe_rank):
    # it is meant for the "whitespace" model only, checked below
    names = list({spec: name for name, spec in reversed(PRE_TOKENIZERS.items())
                  if name not in ("gpt2", "whitespace")}.values())
    texts = [t for v in VOCABS_FOR_TEXTS for t in read_cases(vocab_dir / f"ggml-vocab-{v}.gguf")] + _EXTRA_TEXTS
    paths = []
    for name in names:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(_with_string(source, name))
        paths.append(path)
    # the "whitespace" tokenizer model (its own session), on the "whitespace" pre-tokenizer
    names.append("model whitespace")
    paths.append(tmp_path / "model-whitespace.gguf")
    paths[-1].write_bytes(_with_string(_with_string(source, "whitespace"), "whitespace", "tokenizer.ggml.model"))
    proc = subprocess.run([str(oracle_python), "-c", _TOKENIZE_MANY, *map(str, paths)], input=json.dumps(texts),
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = iter(json.loads(proc.stdout))
    bad = []
    for name, path in zip(names, paths):
        tok = Tokenizer.from_gguf(GGUFFile(path))
        bad += [(name, text) for text in texts if next(want) != tok.encode(text, add_special=True, parse_special=False)]
    assert len(names) > 35 and not bad, f"{len(bad)} differ: {bad[:5]!r}"
