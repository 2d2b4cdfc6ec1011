"""llama.cpp's infill sampler (edge.sampling.infill_apply, SamplingParams.infill): hand-made
candidates that take each branch (only EOG, prefix merges, the 0.2 and 1/(n+1) cuts, EOT alone,
a merged-away EOG token), its place after temperature, and an oracle test against
llama_sampler_init_infill itself (llama-cpp-python 0.3.36) on the default model's vocabulary:
top_k 40 -> top_p 0.99 -> infill on real FIM logits and on crafted ones."""
from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from edge.gguf_file import GGUFFile
from edge.sampling import InfillVocab, Sampler, SamplingParams, infill_apply
from edge.tokenizer import Tokenizer

EOT, EOS = 10, 11
# token id -> piece; 8 and 9 end generation (9 renders empty, 8 is text-like, as a user-defined EOG token)
PIECES = {0: b"re", 1: b"ret", 2: b"return", 3: b"x", 4: b"y", 5: b"z", 6: b"w", 7: b"<", 8: b"<|end|>",
          9: b"", EOT: b"", EOS: b""}
VOCAB = InfillVocab(PIECES.__getitem__, {8, 9, EOT, EOS}, EOT)
V = 12


def logits_of(probs: dict[int, float]) -> np.ndarray:
    """float32[V]: log p at the given ids, -inf elsewhere (their softmax is ``probs``)."""
    x = np.full(V, -np.inf, np.float32)
    x[list(probs)] = np.log(list(probs.values()))
    return x


def infill(probs: dict[int, float]):
    """infill_apply on the given candidates (their probabilities are ``probs``)."""
    x = logits_of(probs)
    ids = np.array(list(probs), np.int64)
    return infill_apply(ids, x[ids], VOCAB)


def sampler(**kw) -> Sampler:
    """Every other sampler off, infill on, temperature 1, seed 1234 unless given."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, infill=True)
    return Sampler(SamplingParams(**{**base, **kw}), infill_vocab=VOCAB)


# ---- the branches, by hand -----------------------------------------------------------------------

def test_eog_majority_keeps_only_the_eog_tokens():
    # p_eog 0.2, n 4: 3 * 0.2 * 4 = 2.4 > p_txt 0.8
    ids, p, x = infill({3: 0.5, 4: 0.3, 9: 0.15, 8: 0.05})
    assert ids.tolist() == [9, 8]
    np.testing.assert_allclose(p, [0.75, 0.25], rtol=1e-6)
    np.testing.assert_allclose(x, np.log([0.15, 0.05]), rtol=1e-6)
    got_ids, got_p = sampler().distribution(logits_of({3: 0.5, 4: 0.3, 9: 0.15, 8: 0.05}))
    assert got_ids.tolist() == [9, 8]
    np.testing.assert_allclose(got_p, [0.75, 0.25], rtol=1e-6)


def assert_draws(probs, ids, p):
    """The sampler's draw distribution of ``probs``' logits: ``ids`` with probabilities ``p``."""
    got_ids, got_p = sampler().distribution(logits_of(probs))
    assert got_ids.tolist() == ids
    np.testing.assert_allclose(got_p, p, rtol=1e-6)


def test_eog_at_the_ratio_limit_is_not_a_majority():
    # p_eog 0.05, n 3: 3 * 0.05 * 3 = 0.45 <= p_txt 0.95: the text tokens stay
    ids, p, _ = infill({3: 0.6, 4: 0.35, 9: 0.05})
    assert ids.tolist() == [3, 4, 9]
    np.testing.assert_allclose(p, [0.6, 0.35, 0.05], rtol=1e-6)


def test_prefix_merge_follows_llama_cpps_loop_order():
    """ret .35, re .25, return .2, x .18, EOG .02: "ret" takes "return" (i0 ret, i1 return),
    then "re" (i0 re, i1 ret: ret's .55 is larger) -> ret .8; x .18 < 0.2 is dropped; the EOG
    token stays: [ret .8/.82, EOG .02/.82]. The draw (dist) uses their logits: .35 : .02."""
    probs = {0: 0.25, 1: 0.35, 2: 0.2, 3: 0.18, 9: 0.02}
    ids, p, x = infill(probs)
    assert ids.tolist() == [1, 9]
    np.testing.assert_allclose(p, [0.8 / 0.82, 0.02 / 0.82], rtol=1e-6)
    np.testing.assert_allclose(x, np.log([0.35, 0.02]), rtol=1e-6)
    assert_draws(probs, [1, 9], [0.35 / 0.37, 0.02 / 0.37])


def test_prefix_merge_into_the_larger_and_a_tie_keeps_i0():
    # "re" .33 and "ret" .33 tie: i0 "re" is the destination (first by id at equal logits)
    ids, p, _ = infill({0: 0.33, 1: 0.33, 3: 0.34})
    assert ids.tolist() == [3, 0]
    np.testing.assert_allclose(p, [0.34, 0.66], rtol=1e-6)
    # "return" .4 is larger than its prefix "re" .25: "re" is merged into it (i0 re, i1 return)
    ids, p, _ = infill({0: 0.25, 2: 0.4, 4: 0.35})
    assert ids.tolist() == [2, 4]
    np.testing.assert_allclose(p, [0.65, 0.35], rtol=1e-6)


def test_a_merged_away_eog_token_stays_with_p_0_and_is_never_drawn():
    # "<" .6 is a prefix of the EOG token "<|end|>" .05, which it takes: the EOG token stays in
    # llama.cpp's array with p 0 and logit -inf, and the draw leaves it out
    probs = {7: 0.6, 4: 0.35, 8: 0.05}
    ids, p, x = infill(probs)
    assert ids.tolist() == [7, 4, 8]
    np.testing.assert_allclose(p, [0.65, 0.35, 0.0], rtol=1e-6)
    assert x[2] == -np.inf and np.isfinite(x[:2]).all()
    assert_draws(probs, [7, 4], [0.6 / 0.95, 0.35 / 0.95])


def test_second_cut_below_one_over_n_plus_one():
    # all >= 0.2, n_text 3: 1/4 = 0.25 drops z .22; [x, y] renormalised
    ids, p, _ = infill({3: 0.5, 4: 0.28, 5: 0.22})
    assert ids.tolist() == [3, 4]
    np.testing.assert_allclose(p, [0.5 / 0.78, 0.28 / 0.78], rtol=1e-6)
    # with an EOG token: x .52, y .4, EOG .08 (3 * .08 * 3 = .72 <= .92): 1/3 keeps both texts
    ids, p, _ = infill({3: 0.52, 4: 0.4, 9: 0.08})
    assert ids.tolist() == [3, 4, 9]
    np.testing.assert_allclose(p, [0.52, 0.4, 0.08], rtol=1e-6)
    # x .45, y .3, EOG .04, w .21: 0.2 keeps all; then 1/4 keeps x and y (w .21 < .25), EOG stays
    ids, p, _ = infill({3: 0.45, 4: 0.3, 6: 0.21, 9: 0.04})
    assert ids.tolist() == [3, 4, 9]
    np.testing.assert_allclose(p, np.array([0.45, 0.3, 0.04]) / 0.79, rtol=1e-6)


def test_all_text_below_0_2_gives_eot_alone():
    probs = {3: 0.165, 4: 0.165, 5: 0.165, 6: 0.165, 0: 0.165, 7: 0.165, 9: 0.01}
    ids, p, x = infill(probs)
    assert (ids.tolist(), p.tolist(), x.tolist()) == ([EOT], [1.0], [1.0])
    s = sampler()
    assert [s.sample(logits_of(probs)) for _ in range(5)] == [EOT] * 5
    ids, p = s.distribution(logits_of(probs))
    assert (ids.tolist(), p.tolist()) == ([EOT], [1.0])


def test_eot_falls_back_to_eos():
    class Tok:                                        # a vocabulary without EOT
        special_ids = {"eot": None}
        eos_id = EOS
        eog_ids = frozenset({EOS})

        def token_to_piece(self, t, special=False):
            return b"" if special else PIECES[t]

    tok = Tok()
    vocab = InfillVocab.of(tok)
    assert InfillVocab.of(tok) is vocab and vocab.eot_id == EOS and vocab.piece(2) == b"return"
    ids = np.array([3, 4, 5, 6, 7, 0], np.int64)
    assert infill_apply(ids, np.zeros(6, np.float32), vocab)[0].tolist() == [EOS]


def test_temperature_comes_before_infill():
    """x .5, y .28, z .22 keep x and y at temperature 1; at 0.5 (p squared, renormalised:
    .664, .208, .128) z is cut at 0.2 and y at 1/3: x alone."""
    probs = {3: 0.5, 4: 0.28, 5: 0.22}
    ids, p = sampler().distribution(logits_of(probs))
    assert ids.tolist() == [3, 4]
    np.testing.assert_allclose(p, [0.5 / 0.78, 0.28 / 0.78], rtol=1e-6)
    ids, p = sampler(temperature=0.5).distribution(logits_of(probs))
    assert (ids.tolist(), p.tolist()) == ([3], [1.0])
    # greedy stays greedy, on the argmax even where infill alone would give EOT
    flat = {3: 0.18, 4: 0.163, 5: 0.163, 6: 0.163, 7: 0.163, 0: 0.163, 9: 0.005}
    assert sampler().distribution(logits_of(flat))[0].tolist() == [EOT]
    assert sampler(temperature=0).distribution(logits_of(flat))[0].tolist() == [3]


def test_infill_after_top_k_and_top_p():
    """top_k 3 keeps ret, re, return (x .18 and the EOG token go); top_p .9 keeps all three
    (cumulative .4375, .75, 1); all merged into ret: ret alone."""
    probs = {0: 0.25, 1: 0.35, 2: 0.2, 3: 0.18, 9: 0.02}
    ids, p = sampler(top_k=3, top_p=0.9).distribution(logits_of(probs))
    assert (ids.tolist(), p.tolist()) == ([1], [1.0])


def test_infill_needs_the_vocabulary():
    with pytest.raises(ValueError, match="infill_vocab"):
        Sampler(SamplingParams(infill=True))
    with pytest.raises(ValueError, match="infill"):
        SamplingParams(infill=1)
    assert SamplingParams().infill is False


def test_pieces_are_looked_up_once():
    calls = []
    vocab = InfillVocab(lambda t: calls.append(t) or PIECES[t], {9}, EOT)
    ids = np.array([0, 1, 2, 3], np.int64)
    x = np.log(np.array([0.25, 0.35, 0.2, 0.2], np.float32))
    for _ in range(3):
        infill_apply(ids, x, vocab)
    assert sorted(calls) == [0, 1, 2, 3]


# ---- against llama.cpp ----------------------------------------------------------------------------

_ORACLE = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp as L
from llama_cpp import Llama
path, given_path, real_path, n_steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.load(sys.stdin)
llm = Llama(model_path=path, n_ctx=1024, n_batch=512, verbose=False, n_threads=2)
vocab = L.llama_model_get_vocab(llm.model)
n_vocab = L.llama_vocab_n_tokens(vocab)
real = []
for text in prompts:                      # the logits of greedy steps after FIM prompts
    llm.reset()
    llm.eval(llm.tokenize(text.encode(), add_bos=False, special=True))
    for _ in range(n_steps):
        row = np.ctypeslib.as_array(L.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
        real.append(row)
        tok = int(np.argmax(row))
        if L.llama_vocab_is_eog(vocab, tok):
            break
        llm.eval([tok])
np.save(real_path, np.stack(real))
data = (L.llama_token_data * n_vocab)()
view = np.frombuffer(data, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
out = []
for row in np.concatenate([np.stack(real), np.load(given_path)]):
    per = []
    for with_dist in (False, True):       # the array after infill, and after dist (the draw's p)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(40))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(0.99, 0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_infill(vocab))
        if with_dist:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(1234))
        view["id"] = np.arange(n_vocab)
        view["logit"] = row
        view["p"] = 0
        arr = L.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        kept = view[: arr.size]
        per.append({"ids": kept["id"].tolist(), "p": kept["p"].tolist(), "logit": kept["logit"].tolist()})
        L.llama_sampler_free(chain)
    out.append(per)
print(json.dumps({"eot": L.llama_vocab_eot(vocab), "rows": out}))
"""

FIM_PROMPTS = [
    "<|fim_prefix|>def add(a, b):\n    return a<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>",
    "<|fim_prefix|>import math\n\n\ndef mean(xs):\n<|fim_suffix|>\n\n\ndef stdev(xs):\n    m = mean(xs)\n"
    "    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))\n<|fim_middle|>",
    "<|fim_prefix|>class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.<|fim_suffix|>\n\n    def pop(self):\n        return self.items.pop()\n<|fim_middle|>",
    "<|fim_prefix|>for i in range(10):\n    if i % 2 == 0:\n        <|fim_suffix|>\n    else:\n"
    "        print('odd', i)\n<|fim_middle|>",
    "<|fim_prefix|>const sum = (xs) => xs.<|fim_suffix|>;\nconsole.log(sum([1, 2, 3]));\n<|fim_middle|>",
    "<|fim_prefix|># TODO: <|fim_suffix|>\n<|fim_middle|>",
]
WORDS = ["return", "print", "self.items", "append", "import", "range(", " values", "lambda", "\n\n\n", "    "]


def _crafted(tok: Tokenizer, n_rows: int, seed: int = 7) -> np.ndarray:
    """float32[n_rows, V]: noise, with a family of tokens whose pieces are prefixes of one word
    (and a few of their extensions) lifted to the top, or (every fourth row) a flat top of
    unrelated tokens, and EOG tokens at a random height: the branches of the sampler, its
    merges and cuts."""
    rng = np.random.default_rng(seed)
    by_piece = {}
    for t in range(tok.n_vocab):
        by_piece.setdefault(tok.token_to_piece(t), t)
    eog = sorted(tok.eog_ids)
    rows = []
    for r in range(n_rows):
        word = WORDS[r % len(WORDS)].encode()
        family = [by_piece[word[:i]] for i in range(1, len(word) + 1) if word[:i] in by_piece]
        family += [t for p, t in by_piece.items() if p.startswith(word) and p != word][:3]
        row = rng.normal(0, 1, tok.n_vocab).astype(np.float32)
        if r % 4 == 3:                  # a flat top of unrelated tokens: below 0.2 each, EOT alone
            others = rng.integers(0, tok.n_vocab, int(rng.integers(6, 16)))
            row[others] = 9 + rng.normal(0, 0.3, len(others))
        else:
            row[family] = 9 + rng.normal(0, rng.uniform(0.2, 2.5), len(family))
            others = rng.integers(0, tok.n_vocab, int(rng.integers(0, 6)))
            row[others] = 9 + rng.normal(-1, 1, len(others))
        lifted = rng.choice(eog, int(rng.integers(0, 3)), replace=False)
        row[lifted] = 9 + rng.normal(rng.uniform(-4, 2), 1, len(lifted))
        rows.append(row)
    return np.stack(rows)


def test_infill_matches_llama_cpp(qwen_path, oracle_python, tmp_path):
    """top_k 40 -> top_p 0.99 -> infill (and -> dist) in llama.cpp on real FIM logits of the
    default model and on crafted ones: edge gives the same candidates in the same order, the
    same logits and probabilities within 1e-6, and draws with dist's probabilities. The lone
    EOT token differs only by which EOT: llama.cpp's auto-detected one follows its hash-map
    order (<|im_end|> here), edge's tokenizer takes the lowest id (edge.tokenizer.vocab); both
    end generation."""
    tok = Tokenizer.from_gguf(GGUFFile(qwen_path))
    vocab = InfillVocab.of(tok)
    crafted = _crafted(tok, 48)
    np.save(tmp_path / "given.npy", crafted)
    proc = subprocess.run([str(oracle_python), "-c", _ORACLE, str(qwen_path), str(tmp_path / "given.npy"),
                           str(tmp_path / "real.npy"), "8"], input=json.dumps(FIM_PROMPTS),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    oracle = json.loads(proc.stdout)
    rows = np.concatenate([np.load(tmp_path / "real.npy"), crafted])
    assert len(oracle["rows"]) == rows.shape[0] and rows.shape[0] >= len(FIM_PROMPTS) + 48
    before = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=0.99, min_p=0.0, seed=1))
    full = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=0.99, min_p=0.0, seed=1, infill=True),
                   infill_vocab=vocab)
    branches = {"eot": 0, "eog": 0, "merged": 0, "other": 0}
    max_diff = 0.0
    for i, (row, (after, drawn)) in enumerate(zip(rows, oracle["rows"])):
        cand = before.distribution(row)[0]
        ids, p, x = infill_apply(cand, row[cand], vocab)
        if after["logit"] == [1.0] and after["ids"] == [oracle["eot"]]:      # EOT alone
            assert ids.tolist() == [vocab.eot_id] and x.tolist() == [1.0], i
            assert oracle["eot"] in tok.eog_ids and vocab.eot_id in tok.eog_ids
            assert full.distribution(row)[0].tolist() == [vocab.eot_id]
            branches["eot"] += 1
            continue
        assert ids.tolist() == after["ids"], i
        assert x.tolist() == after["logit"], i                                   # -inf included
        max_diff = max(max_diff, float(np.abs(p - np.array(after["p"])).max()))
        np.testing.assert_allclose(p, after["p"], rtol=0, atol=1e-6, err_msg=f"row {i}")
        d_ids, d_p = full.distribution(row)
        want = [(t, q) for t, q in zip(drawn["ids"], drawn["p"]) if q > 0]
        assert d_ids.tolist() == [t for t, _ in want], i
        max_diff = max(max_diff, float(np.abs(d_p - [q for _, q in want]).max()))
        np.testing.assert_allclose(d_p, [q for _, q in want], rtol=0, atol=1e-6, err_msg=f"row {i}")
        if all(t in tok.eog_ids for t in ids.tolist()):
            branches["eog"] += 1
        elif np.abs(np.array(after["p"]) - np.array(drawn["p"])).max() > 1e-3:  # merges moved p
            branches["merged"] += 1
        else:
            branches["other"] += 1
    print(f"infill vs llama.cpp: {rows.shape[0]} logit vectors, branches {branches}, max |dp| {max_diff:.2e}")
    assert min(branches.values()) >= 2, branches
    assert math.isfinite(max_diff) and max_diff <= 1e-6
