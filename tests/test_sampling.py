"""Sampling: llama.cpp's chain on hand-computed examples, degenerate inputs (BUGS.md P1), seeds (P2)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge.sampling import Sampler, SamplingError, SamplingParams, TokenMask

P4 = np.array([0.4, 0.3, 0.2, 0.1])
LOGITS4 = np.log(P4).astype(np.float32)  # softmax(LOGITS4) == P4
N_DRAWS = 20_000
V_BIG = 262_144


def params(**kw) -> SamplingParams:
    """Every sampler off except those given (temperature 1, seed 1234 unless given)."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    return SamplingParams(**{**base, **kw})


def dense(sampler: Sampler, logits, history=()) -> np.ndarray:
    """The sampler's final distribution as float64[V]."""
    ids, probs = sampler.distribution(logits, history)
    out = np.zeros(len(logits))
    out[ids] = probs
    return out


def frequencies(sampler: Sampler, logits, n: int = N_DRAWS, history=()) -> np.ndarray:
    draws = [sampler.sample(logits, history) for _ in range(n)]
    return np.bincount(draws, minlength=len(logits)) / n


def check_chain(p: SamplingParams, expected, logits=LOGITS4):
    """distribution() equals the hand-computed one, and draws follow it (4.5 sigma at most)."""
    expected = np.asarray(expected, dtype=np.float64)
    expected = expected / expected.sum()
    np.testing.assert_allclose(dense(Sampler(p), logits), expected, rtol=1e-6, atol=1e-7)
    observed = frequencies(Sampler(p), logits)
    sigma = np.sqrt(expected * (1 - expected) / N_DRAWS)
    assert np.all(np.abs(observed - expected) <= 4.5 * sigma + 1e-12), (observed, expected)


# --- parameters ------------------------------------------------------------------------------

def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert p.seed is None and dict(p.logit_bias) == {}


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", 2.5), ("top_k", True),
    ("top_p", -0.01), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.5), ("min_p", 2.0),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", math.inf),
    ("repeat_last_n", -2), ("repeat_last_n", 1.0),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("seed", -1), ("seed", 1.5), ("seed", "7"),
    ("logit_bias", [(1, 2.0)]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: math.nan}), ("logit_bias", {5: math.inf}), ("logit_bias", {5: "x"}),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_edges_accepted():
    SamplingParams(temperature=0, top_k=0, top_p=0, min_p=1, repeat_last_n=-1, seed=0,
                   presence_penalty=-2, frequency_penalty=2, logit_bias={3: -math.inf, np.int64(4): 1})


def test_logit_bias_is_copied_read_only():
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = -5.0
    assert dict(p.logit_bias) == {1: 2.0}
    with pytest.raises(TypeError):
        p.logit_bias[1] = 3.0


# --- greedy, bias, penalties -----------------------------------------------------------------

def test_greedy_is_argmax_ties_to_lowest_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: -0.5})).sample(logits) == 3
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: -math.inf, 3: -math.inf})).sample(logits) == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: 2.5})).sample(logits) == 0


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    greedy = dict(temperature=0, repeat_penalty=1.1)
    positive = np.array([2.0, 1.9, 0.5], np.float32)  # 2.0 / 1.1 = 1.82 < 1.9
    assert Sampler(SamplingParams(temperature=0)).sample(positive, [0]) == 0
    assert Sampler(SamplingParams(**greedy)).sample(positive, [0]) == 1
    negative = np.array([-1.0, -1.05, -3.0], np.float32)  # -1.0 * 1.1 = -1.1 < -1.05
    assert Sampler(SamplingParams(**greedy)).sample(negative, [0]) == 1


def test_repeat_last_n_window():
    logits = np.array([2.0, 1.9, 0.5], np.float32)
    history = [0, 2, 2]
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=2)).sample(logits, history) == 0
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=3)).sample(logits, history) == 1
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=-1)).sample(logits, history) == 1
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=0)).sample(logits, history) == 0
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1)).sample(logits, np.array(history)) == 1


def test_penalized_logits_values():
    logits = np.array([2.0, -1.0, 0.5, 1.0], np.float32)
    history = [3, 0, 1, 0, 0, 1]  # counts: 0 -> 3, 1 -> 2, 3 -> 1
    p = params(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, repeat_last_n=5)
    # window = last 5 = [0, 1, 0, 0, 1]: token 0 x3, token 1 x2, token 3 unpenalized
    expected = np.array([2.0 / 2 - 3 * 0.25 - 0.5, -1.0 * 2 - 2 * 0.25 - 0.5, 0.5, 1.0])
    np.testing.assert_allclose(dense(Sampler(p), logits, history), np.exp(expected) / np.exp(expected).sum(),
                               rtol=1e-6)


def test_bias_then_penalty_order():
    # bias first: 0.5 + 1.5 = 2.0 > 0 is divided by 2 -> 1.0; the other order would give 0.25 + 1.5
    logits = np.array([0.5, 0.0], np.float32)
    p = params(logit_bias={0: 1.5}, repeat_penalty=2.0)
    expected = np.array([1.0, 0.0])
    np.testing.assert_allclose(dense(Sampler(p), logits, [0]), np.exp(expected) / np.exp(expected).sum(), rtol=1e-6)


def test_caller_logits_untouched():
    logits = np.array([2.0, -1.0, 0.5, 1.0], np.float32)
    before = logits.copy()
    logits.setflags(write=False)
    sampler = Sampler(SamplingParams(seed=3, logit_bias={1: 5.0}, repeat_penalty=1.3, frequency_penalty=0.5,
                                     presence_penalty=0.2))
    for _ in range(20):
        sampler.sample(logits, [0, 1, 3])
        sampler.sample_with_logprobs(logits, [0, 1, 3], 3)
    np.testing.assert_array_equal(logits, before)


# --- the chain on a hand-computed example (P = 0.4 0.3 0.2 0.1) ------------------------------

def test_plain_softmax():
    check_chain(params(), P4)


def test_top_k():
    check_chain(params(top_k=2), [0.4, 0.3, 0, 0])
    check_chain(params(top_k=4), P4)
    check_chain(params(top_k=100), P4)


def test_top_p():
    check_chain(params(top_p=0.75), [0.4, 0.3, 0.2, 0])  # cumulative 0.4 0.7 0.9
    check_chain(params(top_p=0.35), [1, 0, 0, 0])
    # llama.cpp stops at cumulative >= top_p: exact ties of 0.25 each, 0.5 keeps two tokens
    check_chain(params(top_p=0.5), [1, 1, 0, 0], np.zeros(4, np.float32))
    check_chain(params(top_p=0.25), [1, 0, 0, 0], np.zeros(4, np.float32))


def test_min_p():
    check_chain(params(min_p=0.6), [0.4, 0.3, 0, 0])  # keep p >= 0.6 * 0.4 = 0.24
    check_chain(params(min_p=0.2), [0.4, 0.3, 0.2, 0.1])


def test_top_k_renormalizes_before_top_p():
    # after top_k=3: 0.444 0.333 0.222 -> cumulative 0.444 0.778 >= 0.75 keeps 2 (on all 4 it keeps 3)
    check_chain(params(top_k=3, top_p=0.75), [0.4, 0.3, 0, 0])


def test_top_p_before_min_p():
    # llama.cpp order keeps 3; min_p first would renormalize to 0.444 0.333 0.222 and top_p keep 2
    check_chain(params(top_p=0.75, min_p=0.3), [0.4, 0.3, 0.2, 0])


def test_temperature_last():
    check_chain(params(temperature=2.0), np.sqrt(P4))
    check_chain(params(temperature=0.5, top_k=2), [0.16, 0.09, 0, 0])
    # min_p sees the untempered logits: keeps {0, 1}; with temperature 2 first it would keep {0, 1, 2}
    check_chain(params(temperature=2.0, min_p=0.6), [math.sqrt(0.4), math.sqrt(0.3), 0, 0])


def test_default_chain():
    # defaults: top_k 40, top_p 0.95 (cumulative 0.4 0.7 0.9 1.0 keeps all), min_p 0.05, temperature 0.8
    check_chain(SamplingParams(seed=99), P4 ** (1 / 0.8))
    logits = np.log(np.array([0.5, 0.3, 0.17, 0.02, 0.01])).astype(np.float32)
    # top_p: 0.5 0.8 0.97 >= 0.95 keeps 3; min_p 0.05 * 0.5 = 0.025 keeps them
    check_chain(SamplingParams(seed=5), np.array([0.5, 0.3, 0.17, 0, 0]) ** 1.25, logits)


# --- P1: degenerate parameters and logits ----------------------------------------------------

@pytest.fixture
def no_nan():
    with np.errstate(invalid="raise", divide="raise"):
        yield


def test_top_p_zero_keeps_best(no_nan):
    logits = np.array([0.1, 2.0, 2.0, -1.0], np.float32)
    for seed in range(20):
        sampler = Sampler(params(top_p=0.0, seed=seed, temperature=1.5))
        assert [sampler.sample(logits) for _ in range(10)] == [1] * 10


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-300, 5e-324])
def test_tiny_temperature(no_nan, temperature):
    logits = np.array([0.1, 2.0, 1.999, -1.0], np.float32)
    sampler = Sampler(params(temperature=temperature))
    assert {sampler.sample(logits) for _ in range(50)} == {1}
    ids, probs = sampler.distribution(logits)
    assert np.all(np.isfinite(probs))
    # exact ties share the mass
    check_chain(params(temperature=temperature), [0, 1, 1, 0], np.array([0.1, 2.0, 2.0, -1.0], np.float32))


def test_minus_inf_logits(no_nan):
    logits = np.array([-np.inf, 0.0, -np.inf, math.log(3)], np.float32)
    check_chain(params(), [0, 0.25, 0, 0.75], logits)
    check_chain(params(top_k=3, top_p=0.9, min_p=0.01), [0, 0.25, 0, 0.75], logits)
    ids, _ = Sampler(params()).distribution(logits)
    assert sorted(ids.tolist()) == [1, 3]


@pytest.mark.parametrize("p", [params(), SamplingParams(seed=1), params(top_k=3), params(top_p=0.5),
                               params(min_p=0.9), params(temperature=1e-6), SamplingParams(temperature=0),
                               params(repeat_penalty=1.5, frequency_penalty=1, presence_penalty=1)])
def test_all_minus_inf_but_one(no_nan, p):
    logits = np.full(1000, -np.inf, np.float32)
    logits[777] = -5.0
    sampler = Sampler(p)
    assert [sampler.sample(logits, [777, 3]) for _ in range(5)] == [777] * 5


def test_unsampleable_logits_are_errors():
    sampler = Sampler(params())
    with pytest.raises(SamplingError, match="every token has logit -inf"):
        sampler.sample(np.full(5, -np.inf, np.float32))
    with pytest.raises(SamplingError, match="every token has logit -inf"):
        Sampler(params(logit_bias={0: -math.inf})).sample(np.array([1.0, -np.inf], np.float32))
    with pytest.raises(SamplingError, match="NaN or \\+inf"):
        sampler.sample(np.array([0.0, np.nan], np.float32))
    with pytest.raises(SamplingError, match="NaN or \\+inf"):
        sampler.sample(np.array([0.0, np.inf], np.float32))
    for bad in (np.zeros(0, np.float32), np.zeros((2, 3), np.float32), np.arange(3), ["a"]):
        with pytest.raises(SamplingError, match="non-empty 1-D float array"):
            sampler.sample(bad)


def test_token_ids_out_of_vocabulary():
    logits = np.zeros(4, np.float32)
    with pytest.raises(SamplingError, match="logit_bias token 9 is not in the vocabulary of 4"):
        Sampler(params(logit_bias={9: 1.0})).sample(logits)
    with pytest.raises(SamplingError, match="history token 4 is not in the vocabulary of 4"):
        Sampler(params(repeat_penalty=1.1)).sample(logits, [1, 4])
    with pytest.raises(SamplingError, match="history token -1"):
        Sampler(params(repeat_penalty=1.1)).sample(logits, [-1])


# --- P2: seeds -------------------------------------------------------------------------------

def _draws(p: SamplingParams, logits, n=200) -> list[int]:
    sampler = Sampler(p)
    return [sampler.sample(logits) for _ in range(n)]


def test_same_seed_same_sequence_different_seeds_differ():
    logits = np.zeros(50, np.float32)
    first = _draws(SamplingParams(seed=42, top_k=0), logits)
    assert _draws(SamplingParams(seed=42, top_k=0), logits) == first
    assert len(set(first)) > 30
    assert _draws(SamplingParams(seed=43, top_k=0), logits) != first
    assert _draws(SamplingParams(seed=0, top_k=0), logits) != first


def test_random_seed_is_reported_and_reproducible():
    logits = np.zeros(50, np.float32)
    a, b = Sampler(SamplingParams(top_k=0)), Sampler(SamplingParams(top_k=0))
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**32
    draws = [a.sample(logits) for _ in range(100)]
    assert [b.sample(logits) for _ in range(100)] != draws
    assert _draws(SamplingParams(top_k=0, seed=a.seed), logits, 100) == draws


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31, 2**40])
def test_seed_never_turns_samplers_off(seed):
    logits = np.random.default_rng(seed % 1000).standard_normal(300).astype(np.float32)
    best = int(np.argmax(logits))
    assert set(_draws(SamplingParams(seed=seed, top_k=1, temperature=5.0), logits, 30)) == {best}
    assert set(_draws(SamplingParams(seed=seed, top_p=0.0, temperature=5.0), logits, 30)) == {best}
    assert set(_draws(SamplingParams(seed=seed, min_p=1.0, temperature=5.0), logits, 30)) == {best}
    assert set(_draws(SamplingParams(seed=seed, temperature=0), logits, 30)) == {best}


# --- full vocabulary ---------------------------------------------------------------------------

def _reference(x: np.ndarray, p: SamplingParams):
    """Straightforward chain with a full sort: (ids, probs)."""
    order = np.argsort(-x.astype(np.float64), kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    v = x[order].astype(np.float64)
    if p.top_p < 1:
        probs = np.exp(v - v[0]) / np.exp(v - v[0]).sum()
        cut = int(np.argmax(np.cumsum(probs) >= p.top_p))
        order, v = order[:cut + 1], v[:cut + 1]
    if p.min_p > 0:
        keep = v >= v[0] + math.log(p.min_p) - 1e-6
        order, v = order[keep], v[keep]
    w = np.exp((v - v[0]) / p.temperature)
    return order, w / w.sum()


@pytest.mark.parametrize("p", [SamplingParams(seed=1), SamplingParams(seed=1, top_k=0),
                               SamplingParams(seed=1, top_k=0, min_p=0.0),
                               SamplingParams(seed=1, top_k=0, top_p=0.5, min_p=0.0),
                               SamplingParams(seed=1, top_k=1000, top_p=0.99, min_p=0.001)])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_big_vocab_matches_full_sort(p, scale):
    x = (np.random.default_rng(7).standard_normal(V_BIG) * scale).astype(np.float32)
    ids, probs = Sampler(p).distribution(x)
    ref_ids, ref_probs = _reference(x, p)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-9)


def test_top_k_ties_go_to_lowest_ids():
    x = np.zeros(V_BIG, np.float32)
    x[[5, 100_000, 7]] = 1.0
    ids, _ = Sampler(SamplingParams(top_k=6, top_p=1.0, min_p=0.0, seed=0)).distribution(x)
    assert ids.tolist() == [5, 7, 100_000, 0, 1, 2]


def test_top_k_does_not_sort_the_vocabulary(monkeypatch):
    sizes = []
    for name in ("argsort", "sort", "lexsort"):
        original = getattr(np, name)

        def spy(a, *args, _original=original, **kwargs):
            sizes.append(np.shape(a)[-1])
            return _original(a, *args, **kwargs)
        monkeypatch.setattr(np, name, spy)
    x = np.random.default_rng(3).standard_normal(V_BIG).astype(np.float32)
    sampler = Sampler(SamplingParams(seed=2, repeat_penalty=1.1))
    for _ in range(3):
        sampler.sample(x, [1, 2, 3])
    assert sizes and max(sizes) <= 40


# --- logprobs ----------------------------------------------------------------------------------

def test_logprobs_from_raw_logits():
    logits = np.array([0.0, math.log(3), -np.inf, math.log(3)], np.float32)  # softmax 1/7 3/7 0 3/7
    sampler = Sampler(SamplingParams(temperature=0))
    token, logprob, top = sampler.sample_with_logprobs(logits, [], 2)
    assert token == 1
    assert logprob == pytest.approx(math.log(3 / 7), abs=1e-6)
    assert [t for t, _ in top] == [1, 3]
    assert [lp for _, lp in top] == pytest.approx([math.log(3 / 7)] * 2, abs=1e-6)
    _, _, top = sampler.sample_with_logprobs(logits, [], 10)
    assert [t for t, _ in top] == [1, 3, 0]  # -inf tokens are not alternatives
    assert top[2][1] == pytest.approx(-math.log(7), abs=1e-6)
    assert sampler.sample_with_logprobs(logits, [], 0)[2] == []
    biased = Sampler(SamplingParams(temperature=0, logit_bias={2: 0.0, 0: 100.0}))
    token, logprob, _ = biased.sample_with_logprobs(logits, [], 1)
    assert token == 0 and logprob == pytest.approx(-math.log(7), abs=1e-6)
    with pytest.raises(ValueError, match="n_top"):
        sampler.sample_with_logprobs(logits, [], -1)


def test_logprobs_big_vocab_and_same_stream_as_sample():
    x = (np.random.default_rng(11).standard_normal(V_BIG) * 3).astype(np.float32)
    ref = x.astype(np.float64) - x.max()
    ref -= math.log(np.exp(ref).sum())
    a, b = Sampler(SamplingParams(seed=9)), Sampler(SamplingParams(seed=9))
    for _ in range(5):
        token, logprob, top = a.sample_with_logprobs(x, [], 5)
        assert token == b.sample(x)
        assert logprob == pytest.approx(ref[token], abs=1e-9)
        assert [t for t, _ in top] == np.argsort(-ref, kind="stable")[:5].tolist()
        assert [lp for _, lp in top] == pytest.approx(np.sort(ref)[::-1][:5].tolist(), abs=1e-9)


def test_negative_top_k_is_off():
    """As llama.cpp: top_k <= 0 keeps every token."""
    logits = np.random.default_rng(4).standard_normal(500).astype(np.float32)
    draws = {k: [Sampler(SamplingParams(top_k=k, top_p=1.0, min_p=0.0, seed=s)).sample(logits, [])
                 for s in range(40)] for k in (0, -1)}
    assert draws[0] == draws[-1]


# --- the mask stage (logits processors after bias and penalties, before top_k) --------------

def test_mask_stage_bans_and_forces_tokens():
    allowed = Sampler(params(), [TokenMask([1, 3])])
    np.testing.assert_allclose(dense(allowed, LOGITS4), [0.0, 0.75, 0.0, 0.25], rtol=1e-6)
    assert set(frequencies(allowed, LOGITS4, n=500).nonzero()[0]) == {1, 3}
    mask = np.array([False, False, True, False])
    forced = Sampler(params(), [TokenMask(mask)])
    assert [forced.sample(LOGITS4) for _ in range(50)] == [2] * 50
    assert Sampler(params(temperature=0.0), [TokenMask([1, 3])]).sample(LOGITS4) == 1   # greedy too
    assert Sampler(params(temperature=0.0), [TokenMask([3])]).sample(LOGITS4) == 3


def test_mask_stage_sits_after_bias_and_penalties_and_before_top_k():
    seen = []

    def record(history, logits):
        seen.append((list(history), logits.copy()))
        logits[0] = -np.inf                              # ban the best token
        return logits

    s = Sampler(params(top_k=1, logit_bias={3: 10.0}, repeat_penalty=2.0), [record, TokenMask([0, 1, 2])])
    assert s.sample(LOGITS4, [1]) == 2    # 3 was biased to the top, then masked; top_k picks 2 of 1, 2
    history, x = seen[0]
    assert history == [1]
    expected = LOGITS4.copy()
    expected[3] += np.float32(10.0)
    expected[1] *= np.float32(2.0)                      # log(0.3) < 0: multiplied
    np.testing.assert_array_equal(x, expected)
    logits = LOGITS4.copy()
    logits.setflags(write=False)                         # the processors get the sampler's copy
    Sampler(params(), [record]).sample(logits)
    np.testing.assert_array_equal(logits, LOGITS4)


def test_mask_stage_follows_the_history():
    script = [3, 0, 2]

    def next_in_script(history, logits):
        logits[np.arange(len(logits)) != script[len(history) % 3]] = -np.inf
        return logits

    s = Sampler(params(seed=7), [next_in_script])
    history = []
    for _ in range(6):
        history.append(s.sample(LOGITS4, history))
    assert history == [3, 0, 2, 3, 0, 2]


def test_mask_stage_errors_are_clear():
    with pytest.raises(SamplingError, match="every token has logit -inf"):
        Sampler(params(), [TokenMask([])]).sample(LOGITS4)
    with pytest.raises(SamplingError, match="TokenMask: token 7 is not in the vocabulary of 4 tokens"):
        Sampler(params(), [TokenMask([1, 7])]).sample(LOGITS4)
    with pytest.raises(SamplingError, match="a mask of 3 tokens for a vocabulary of 4"):
        Sampler(params(), [TokenMask(np.ones(3, bool))]).sample(LOGITS4)
    with pytest.raises(SamplingError, match=r"returned shape \(2,\)"):
        Sampler(params(), [lambda h, x: x[:2]]).sample(LOGITS4)
    with pytest.raises(ValueError, match="token ids \\(integers >= 0\\) or a bool mask"):
        TokenMask([-1, 2])
