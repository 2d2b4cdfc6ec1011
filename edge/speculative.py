"""Speculative decoding: drafters that guess a sequence's next tokens, and the policy that says
how many to guess.

A step of the generation loop (edge.generate) verifies a sequence's drafts in one forward pass
of k+1 rows (its last token and k drafts) and keeps the accepted prefix plus one token of the
target's own (Sampler.verify: the rejection rule of Leviathan et al. / Chen et al., so the text
is distributed exactly as without speculation; at temperature 0 it is the same text, token for
token, because the model runs batch-invariant: a row's logits do not depend on the rows beside
it). The rows past the accepted prefix are taken back from the KV cache (PagedKVCache.truncate).

Drafters (one interface, :class:`Drafter`):
    ngram   prompt lookup (llama.cpp's ngram-simple; Saxena's prompt lookup decoding): the most
            recent earlier occurrence of the sequence's last n tokens (n from ``ngram_max`` down
            to ``ngram_min``) in its prompt and output drafts the tokens that followed it. Free,
            and right whenever the answer repeats the prompt (editing code, quoting, JSON).
    draft   a smaller model with the same vocabulary (``-md/--model-draft``): it decodes the
            draft greedily (temperature 0) or by sampling its own distribution after the
            request's sampler chain (which then goes with each token to the rejection rule),
            and stops early when its best token's probability falls below ``draft_p_min``. Its
            own paged KV cache follows each sequence (truncated to what the target kept); the
            draft steps of several sequences share forward passes.

Policy (:class:`Speculator`, per sequence): drafts at most ``draft_max`` tokens and none when
fewer than ``draft_min`` are on offer; the length limit doubles after a fully accepted draft
and falls to one more than the accepted count otherwise; after a draft with nothing accepted
(and, for a draft model, a proposal that came back empty: its forward passes were paid for)
the sequence pauses drafting for 1, 3, 7, ... tokens (at most 63), so text that does not repeat
(free prose) costs little more than the lookups. Drafts never pass n_ctx or max_tokens.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

SPEC_TYPES = {"none": "none", "ngram": "ngram", "ngram-simple": "ngram", "draft": "draft",
              "draft-simple": "draft"}
"""--spec-type names (llama.cpp's ngram-simple and draft-simple are accepted as aliases)."""

MAX_PAUSE = 63     # most tokens a sequence goes without drafting after failed drafts


class SpeculativeError(ValueError):
    """A speculative-decoding setting that cannot work (bad option, incompatible draft model)."""


@dataclass(frozen=True)
class SpecParams:
    """Speculative decoding options; names and defaults as llama.cpp's (common_params_speculative).

    Fields:
        spec_type: "none", "ngram" or "draft" (or llama.cpp's "ngram-simple", "draft-simple").
        draft_max: most drafted tokens per step (>= 1; --draft-max, default 16).
        draft_min: fewer drafted tokens than this are not verified (>= 0; --draft-min).
        draft_p_min: a draft model stops drafting when its best token's probability is below
            this (in [0, 1]; --draft-p-min, default 0.75).
        ngram_min, ngram_max: the n-gram lengths prompt lookup matches, longest first.
    Raises:
        SpeculativeError naming the option.
    """

    spec_type: str = "none"
    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.75
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self):
        kind = SPEC_TYPES.get(self.spec_type)
        if kind is None:
            raise SpeculativeError(f"--spec-type must be one of {', '.join(SPEC_TYPES)}, got {self.spec_type!r}")
        object.__setattr__(self, "spec_type", kind)
        for name, low in (("draft_max", 1), ("draft_min", 0), ("ngram_min", 1)):
            value = getattr(self, name)
            if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low):
                raise SpeculativeError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if not (isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min):
            raise SpeculativeError(f"ngram_max must be an integer >= ngram_min ({self.ngram_min}), got {self.ngram_max!r}")
        if self.draft_min > self.draft_max:
            raise SpeculativeError(f"--draft-min ({self.draft_min}) is larger than --draft-max ({self.draft_max})")
        p = self.draft_p_min
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0):
            raise SpeculativeError(f"--draft-p-min must be a number in [0, 1], got {p!r}")

    @property
    def enabled(self) -> bool:
        return self.spec_type != "none"


@dataclass
class Draft:
    """Drafted tokens for one sequence: ``tokens`` (ids), and ``q``: per token the drafter's
    distribution it was drawn from (token ids int64[m], probs float64[m]), or None when every
    token was chosen deterministically from the history (Sampler.verify)."""

    tokens: list[int]
    q: list[tuple[np.ndarray, np.ndarray]] | None = None


@dataclass
class SpecState:
    """One sequence's speculation: the policy's state and its counters (drafted: tokens sent
    to verification; accepted: those the target kept; steps: verifications)."""

    limit: int
    n_max: int = 1 << 30    # this request's most drafted tokens per step (0: no drafts)
    n_min: int = 0          # and fewest
    p_min: float | None = None   # its --draft-p-min (None: the server's)
    pause: int = 0          # tokens to go before the next draft
    failures: int = 0       # drafts in a row with nothing accepted
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    index: object = None    # the drafter's per-sequence data (n-gram index, draft slot)

    def limits(self, n_max: int | None = None, n_min: int | None = None, p_min: float | None = None) -> None:
        """A request's own limits (llama-server's speculative.n_max / n_min / p_min)."""
        if n_max is not None:
            self.n_max = int(n_max)
        if n_min is not None:
            self.n_min = int(n_min)
        self.n_min = min(self.n_min, self.n_max)     # llama-server clamps n_min to n_max
        if p_min is not None:
            self.p_min = float(p_min)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Drafter:
    """What a drafter does (module docstring). ``propose`` gets sequences (edge.generate.Sequence,
    each with its SpecState as seq.spec) and the most tokens each may draft; returns a Draft
    (possibly empty) per sequence. ``release`` forgets a sequence. ``costly``: a proposal costs
    forward passes even when it comes back empty (a draft model), so the policy pauses after
    empty ones too."""

    costly = False

    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[Draft]:
        raise NotImplementedError

    def prefill(self, seqs) -> None:
        """Take in the sequences' prompts now (a draft model computes them in its own cache), so
        that the first draft does not pay for them: the prompt's time, not the answer's."""

    def release(self, seq) -> None:
        pass

    def close(self) -> None:
        pass


class _NgramIndex:
    """For each n in [n_min, n_max], the latest position at which each n-gram of the history
    ended, over the history except its last token (so a lookup of the current suffix finds an
    earlier occurrence). Grows with the history; dict of tuple -> end index."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.done = 0           # n-grams ending before this index are in the maps

    def update(self, tokens: list[int]) -> None:
        for end in range(self.done, len(tokens) - 1):
            for n, m in self.maps.items():
                if end + 1 >= n:
                    m[tuple(tokens[end + 1 - n : end + 1])] = end
        self.done = max(self.done, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The up to k tokens that followed the latest earlier occurrence of the longest
        matching suffix of ``tokens``."""
        if len(tokens) < self.done + 1:        # the history was taken back: rebuild
            self.maps = {n: {} for n in self.maps}
            self.done = 0
        self.update(tokens)
        L = len(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if L < n:
                continue
            end = self.maps[n].get(tuple(tokens[L - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class NgramDrafter(Drafter):
    """Prompt lookup (module docstring)."""

    def __init__(self, params: SpecParams):
        self.params = params

    def propose(self, seqs, budgets):
        out = []
        for seq, k in zip(seqs, budgets):
            st = seq.spec
            if st.index is None:
                st.index = _NgramIndex(self.params.ngram_min, self.params.ngram_max)
            out.append(Draft(st.index.lookup(seq.tokens, k) if k > 0 else []))
        return out


def check_compatible(target_tokenizer, draft_tokenizer, target_name: str = "target",
                     draft_name: str = "draft") -> None:
    """Refuse a draft model whose tokens do not mean the target's: the same vocabulary type,
    the same BOS / EOS use, sizes within 128 and the same text for every token id they share
    (llama.cpp's common_speculative_are_compatible checks the same).

    Raises:
        SpeculativeError naming the first difference.
    """
    t, d = target_tokenizer, draft_tokenizer
    if t.model != d.model:
        raise SpeculativeError(f"the draft model {draft_name} has a {d.model} vocabulary, "
                               f"{target_name} a {t.model} one: they cannot share drafts")
    if t.add_bos != d.add_bos or (t.add_bos and t.bos_id != d.bos_id):
        raise SpeculativeError(f"the draft model {draft_name} and {target_name} differ in BOS "
                               f"(add_bos {d.add_bos} / {t.add_bos}, id {d.bos_id} / {t.bos_id})")
    nt, nd = t.n_vocab, d.n_vocab
    if abs(nt - nd) > 128:
        raise SpeculativeError(f"the draft model {draft_name} has {nd} tokens, {target_name} {nt}: "
                               "more than 128 apart, not the same vocabulary")
    for i in range(min(nt, nd)):
        if t.token_text(i) != d.token_text(i):
            raise SpeculativeError(f"the draft model {draft_name} and {target_name} differ at token {i} "
                                   f"({d.token_text(i)!r} vs {t.token_text(i)!r}): not the same vocabulary")


class DraftModelDrafter(Drafter):
    """A draft model (module docstring).

    Args:
        engine: the draft model's edge.engine.Engine (batch-invariant, its n_seq at least the
            target's sequences at once, its n_ctx the target's).
        params: the SpecParams (draft_p_min).
        n_vocab: the target's vocabulary size (drafts never name a token past it).
    """

    costly = True

    def __init__(self, engine, params: SpecParams, n_vocab: int):
        self.engine, self.params, self.n_vocab = engine, params, n_vocab
        self.loop = engine.loop()
        self.kv = engine.kv

    def _sync(self, seq, whole: bool = False) -> list[int]:
        """Give seq a draft slot whose known tokens are seq's but the last (all of them with
        ``whole``; what the target took back is taken back here too); returns those tokens."""
        st = seq.spec
        toks = seq.tokens if whole else seq.tokens[:-1]
        if st.index is None:
            slot, _ = self.kv.new_sequence(toks, lookahead=self.params.draft_max + 1)
            st.index = (slot, list(toks))
        slot, known = st.index
        common, n = 0, min(len(known), len(toks))
        while common < n and known[common] == toks[common]:
            common += 1
        if common < len(known):
            self.kv.truncate(slot, common)
            del known[common:]
        if len(known) < len(toks):
            self.kv.append(slot, toks[len(known):])
            known.extend(toks[len(known):])
        return toks

    def propose(self, seqs, budgets):
        from edge.generate import Rows

        drafts = [Draft([], [] if seq.sampler.params.temperature > 0 else None) for seq in seqs]
        active = [i for i, k in enumerate(budgets) if k > 0]
        self._catch_up([seqs[i] for i in active])
        last = {i: seqs[i].tokens[-1] for i in active}
        while active:          # draft: a row per sequence a step, while each goes on
            rows = []
            for i in active:
                slot, known = seqs[i].spec.index
                rows.append(Rows(slot, [last[i]], 1))
                known.append(last[i])
            logits = self._step(rows)
            still = []
            for row, i in enumerate(active):
                seq, d = seqs[i], drafts[i]
                tok, q, p_best = self._choose(seq, logits[row], seq.tokens + d.tokens)
                p_min = self.params.draft_p_min if seq.spec.p_min is None else seq.spec.p_min
                if tok is None or p_best < p_min:
                    continue
                d.tokens.append(tok)
                if d.q is not None:
                    d.q.append(q)
                last[i] = tok
                if len(d.tokens) < budgets[i]:
                    still.append(i)
            active = still
        return drafts

    def prefill(self, seqs) -> None:
        self._catch_up(seqs, whole=True)

    def _catch_up(self, seqs, whole: bool = False) -> None:
        """Sync each sequence's draft slot (_sync) and compute its tokens but the last (all of
        them with ``whole``: a prompt, whose last token the first draft step would compute
        anyway), n_batch rows a step over all the sequences."""
        from edge.generate import Rows

        for seq in seqs:
            self._sync(seq, whole)
        while True:
            rows, budget = [], self.loop.n_batch
            for seq in seqs:
                slot, known = seq.spec.index
                done = int(self.kv.pos[slot])
                if done < len(known) and budget > 0:
                    chunk = known[done : done + budget]
                    rows.append(Rows(slot, chunk, 0))
                    budget -= len(chunk)
            if not rows:
                return
            self._step(rows)

    def _step(self, rows):
        for r in rows:
            self.loop.reserve(r)
        return self.loop.step(rows)

    def _choose(self, seq, logits, history):
        """(token, q, p): the draft's token (its argmax at temperature 0, else drawn from its
        distribution after the request's sampler chain, q), and the probability the draft
        model gives its best token (softmax of its logits after bias, penalties and the mask
        stage), which --draft-p-min judges. Token None: the draft's pick is not a token of the
        target's vocabulary."""
        sampler = seq.spec_sampler
        x = sampler._processed(logits, history)
        peak = float(x.max())
        p_best = 1.0 / float(np.exp(x.astype(np.float64) - peak).sum())
        if seq.sampler.params.temperature <= 0:
            tok = int(np.argmax(x))
            return (tok if tok < self.n_vocab else None), None, p_best
        ids, p = sampler.distribution(logits, history)
        keep = ids < self.n_vocab
        if not keep.all():
            ids, p = ids[keep], p[keep]
            if not ids.size:
                return None, None, 0.0
            p = p / p.sum()
        return sampler.draw(ids, p), (ids, p), p_best

    def release(self, seq) -> None:
        st = getattr(seq, "spec", None)
        if st is not None and st.index is not None:
            self.kv.free(st.index[0])
            st.index = None


class Speculator:
    """The policy and the drafter of speculative decoding (module docstring).

    Args:
        params: SpecParams (spec_type "ngram" or "draft").
        drafter: the Drafter (``make_drafter``).
    """

    def __init__(self, params: SpecParams, drafter: Drafter):
        self.params, self.drafter = params, drafter
        self.drafted = 0
        self.accepted = 0

    def start(self, seq) -> None:
        """Give ``seq`` its SpecState (and, for a draft model, a sampler of its own stream)."""
        from dataclasses import replace

        from edge.sampling import Sampler

        seq.spec = SpecState(limit=min(self.params.draft_max, 8))
        seq.spec_sampler = Sampler(replace(seq.sampler.params, seed=(seq.sampler.seed + 0x9E3779B9) % (1 << 32)),
                                   seq.sampler.processors, seq.sampler.infill_vocab)

    def propose(self, seqs, budgets: Seq[int]) -> None:
        """Set seq.draft for each sequence that should draft now (budgets: the most tokens each
        may draft: n_ctx, max_tokens and the step's rows left)."""
        want, caps = [], []
        for seq, budget in zip(seqs, budgets):
            seq.draft = None
            st = seq.spec
            if st.pause > 0:
                st.pause -= 1
                continue
            cap = min(st.limit, st.n_max, self.params.draft_max, budget)
            floor = max(1, min(max(self.params.draft_min, st.n_min), st.n_max))
            if cap >= floor:
                want.append(seq)
                caps.append(cap)
        if not want:
            return
        for seq, draft in zip(want, self.drafter.propose(want, caps)):
            st = seq.spec
            if len(draft.tokens) >= max(1, min(max(self.params.draft_min, st.n_min), st.n_max)):
                seq.draft = draft
            elif self.drafter.costly:    # paid for nothing: back off as after a refused draft
                self._back_off(seq.spec)

    def update(self, seq, n_drafted: int, n_accepted: int) -> None:
        """The policy's step after a verification of n_drafted tokens, n_accepted kept."""
        st = seq.spec
        st.drafted += n_drafted
        st.accepted += n_accepted
        st.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        if n_accepted == n_drafted:
            st.limit = min(self.params.draft_max, 2 * st.limit)
        else:
            st.limit = max(1, n_accepted + 1)
        if n_accepted == 0:
            self._back_off(st)
        else:
            st.failures = 0

    @staticmethod
    def _back_off(st: SpecState) -> None:
        st.failures += 1
        st.pause = min(MAX_PAUSE, (1 << st.failures) - 1)

    def release(self, seq) -> None:
        self.drafter.release(seq)

    def close(self) -> None:
        self.drafter.close()


def make_speculator(params: SpecParams, engine, draft_engine=None) -> Speculator | None:
    """The Speculator for ``params`` on the target ``engine``; None when spec_type is "none".
    "draft" needs ``draft_engine`` (refused when its vocabulary is not the target's).

    Raises:
        SpeculativeError: "draft" without a draft model, or an incompatible one.
    """
    if not params.enabled:
        return None
    if params.spec_type == "ngram":
        return Speculator(params, NgramDrafter(params))
    if draft_engine is None:
        raise SpeculativeError("--spec-type draft needs a draft model: -md/--model-draft MODEL")
    from pathlib import Path

    check_compatible(engine.tokenizer, draft_engine.tokenizer, Path(engine.path).stem, Path(draft_engine.path).stem)
    return Speculator(params, DraftModelDrafter(draft_engine, params, engine.tokenizer.n_vocab))
