"""Tokenizer vocabulary from GGUF metadata, as llama.cpp's ``llama_vocab::impl::load`` builds it.

Reads ``tokenizer.ggml.*``: the token list, scores, token types, merges, special token ids,
``add_bos_token``/``add_eos_token``/``add_space_prefix``, and the pre-tokenizer name. Then
applies llama.cpp's text-based fix-ups: end-of-turn, FIM and end-of-generation tokens found by
their text are made CONTROL, control tokens named "unused" are marked UNUSED, and the
end-of-generation set is eos + eot + eom + FIM pad/repo/sep + every token whose text is in
:data:`EOG_TEXTS`. Any metadata fault raises :class:`GGUFError` naming the key (BUGS.md G2).

Deliberate differences from llama.cpp: a special token id outside the vocab is an error (llama.cpp
warns and keeps its default); where llama.cpp's choice among several candidate tokens depends
on hash-map order (auto-detected eot/FIM ids) we take the lowest id; the name-based attribute
hacks are reproduced (gpt-oss' always-rendered tokens, "<|end|>" of o200k_harmony/solar-open
and "</s>" of gemma 4/plamo leaving the end-of-generation set, LSTRIP/RSTRIP for phi-3, jina,
nomic-bert-moe and modern-bert), except that a token they name which is missing is skipped
(llama.cpp throws for phi-3's "</s>").
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType, Keys, TokenType

from edge.gguf_file import GGUFError, GGUFFile
from edge.tokenizer.pretypes import PRE_TOKENIZERS, PreTokenizerSpec

K = Keys.Tokenizer


class TokenizerError(ValueError):
    """Bad input to the tokenizer, such as a token id outside the vocab."""


class TokenAttr(enum.IntFlag):
    """Token attributes, bit for bit llama.cpp's ``llama_token_attr``."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7        # a match eats the whitespace before it (tokenizer_st_partition)
    RSTRIP = 1 << 8        # ... and after it
    SINGLE_WORD = 1 << 9


# GGUF token type (gguf.TokenType; 0 = undefined) -> attribute; other values -> UNDEFINED
_TYPE_TO_ATTR = np.zeros(7, dtype=np.int64)
for _t, _a in ((TokenType.NORMAL, TokenAttr.NORMAL), (TokenType.UNKNOWN, TokenAttr.UNKNOWN),
               (TokenType.CONTROL, TokenAttr.CONTROL), (TokenType.USER_DEFINED, TokenAttr.USER_DEFINED),
               (TokenType.UNUSED, TokenAttr.UNUSED), (TokenType.BYTE, TokenAttr.BYTE)):
    _TYPE_TO_ATTR[_t] = _a

# texts llama.cpp recognises (llama-vocab.cpp, "auto-detect special tokens by text")
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                 "<|code_prefix|>", "<|prefix|>")
FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                 "<|code_suffix|>", "<|suffix|>")
FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                 "<|code_middle|>", "<|middle|>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# special id fields, the metadata keys that set them (later keys win), and the default per model
_ID_KEYS = {
    "bos": (K.BOS_ID,), "eos": (K.EOS_ID,), "eot": (K.EOT_ID,), "eom": (K.EOM_ID,), "unk": (K.UNK_ID,),
    "pad": (K.PAD_ID,), "fim_pre": (K.FIM_PRE_ID, K.PREFIX_ID), "fim_suf": (K.FIM_SUF_ID, K.SUFFIX_ID),
    "fim_mid": (K.FIM_MID_ID, K.MIDDLE_ID), "fim_pad": (K.FIM_PAD_ID,), "fim_rep": (K.FIM_REP_ID,),
    "fim_sep": (K.FIM_SEP_ID,), "sep": (K.SEP_ID,), "mask": (K.MASK_ID,),
}
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11},
                "whitespace": {"bos": 11, "eos": 11}, "gemma4": {},
                "bert": {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103},
                "t5": {"eos": 1, "unk": 2, "pad": 0}}
MODELS = {"llama": "SentencePiece (SPM)", "gpt2": "byte-level BPE", "gemma4": "SentencePiece-style BPE",
          "whitespace": "BPE per whitespace-separated word",
          "bert": "WordPiece (WPM)", "t5": "Unigram (UGM)"}
# tokenizer.ggml.model -> llama.cpp's vocab type
KINDS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "whitespace": "bpe", "bert": "wpm", "t5": "ugm"}
NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"


@dataclass
class Vocab:
    """Everything the tokenizer needs, read and checked from GGUF metadata.

    Attributes:
        model: ``tokenizer.ggml.model``: "llama", "gpt2", "gemma4", "whitespace", "bert" or "t5".
        kind: llama.cpp's vocab type: "spm" (llama), "bpe" (gpt2, gemma4), "wpm" (bert) or
            "ugm" (t5).
        texts: token texts as stored (str, utf-8 with surrogateescape); empty ones renamed
            ``[EMPTY_<id>]`` as llama.cpp does.
        token_to_id: text -> id.
        token_types: int32[n_vocab] GGUF token types (NORMAL where the key is absent).
        attrs: per-token :class:`TokenAttr` bits as ints, after llama.cpp's fix-ups.
        scores: per-token float score (0.0 where ``tokenizer.ggml.scores`` is absent).
        merges: BPE merges ("left right"), empty for SPM.
        pre: the BPE pre-tokenizer spec (None for SPM and WPM).
        ids: special token ids by field name (bos, eos, eot, eom, unk, pad, fim_*, sep, mask),
            None if unset.
        eog_ids: end-of-generation token ids.
        add_bos, add_eos, add_space_prefix, clean_spaces: llama.cpp tokenizer flags.
        lowercase, strip_accents: WPM's BertNormalizer options (``tokenizer.ggml.normalizer.*``).
        remove_extra_whitespaces, charsmap: UGM's normalizer options (the precompiled charsmap
            bytes, or None).
    """

    model: str
    kind: str
    texts: list[str]
    token_to_id: dict[str, int]
    token_types: np.ndarray
    attrs: list[int]
    scores: list[float]
    merges: list[str]
    pre: PreTokenizerSpec | None
    ids: dict[str, int | None]
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    lowercase: bool = True
    strip_accents: bool = True
    remove_extra_whitespaces: bool = False
    charsmap: bytes | None = None


def _fail(gf: GGUFFile, message: str) -> GGUFError:
    return GGUFError(f"{gf.path}: {message}")


def read_vocab(gf: GGUFFile) -> Vocab:
    """Read and validate the tokenizer metadata of ``gf``.

    Raises:
        GGUFError: naming the key, when ``tokenizer.ggml.model`` is missing or not one of :data:`MODELS`,
            ``tokenizer.ggml.tokens`` is missing, empty, not strings or has duplicates, scores or
            token types have the wrong type or length, merges are missing for "gpt2", the
            pre-tokenizer is unknown, a special token id is outside the vocab, or BOS/EOS is to
            be added but has no id.
    """
    model = gf.get_str(K.MODEL)
    if model not in MODELS:
        supported = ", ".join(f"{m!r} ({d})" for m, d in MODELS.items())
        raise _fail(gf, f"{K.MODEL} {model!r} is not supported (supported: {supported})")
    texts, token_to_id = _read_tokens(gf)
    n = len(texts)
    scores = gf.get_array(K.SCORES, (GGUFValueType.FLOAT32, GGUFValueType.INT32), required=False)
    types = gf.get_array(K.TOKEN_TYPE, (GGUFValueType.INT32,), required=False)
    for key, arr in ((K.SCORES, scores), (K.TOKEN_TYPE, types)):
        if arr is not None and len(arr) != n:
            raise _fail(gf, f"{key} has {len(arr)} entries but {K.LIST} has {n}")
    # copies, so the tokenizer does not pin the file's memory map
    types = np.full(n, TokenType.NORMAL, dtype=np.int32) if types is None else np.array(types, dtype=np.int32)
    scores_list = [0.0] * n if scores is None else scores.astype(np.float64).tolist()  # exact
    known = (types >= 0) & (types < len(_TYPE_TO_ATTR))
    attrs = np.where(known, _TYPE_TO_ATTR[np.where(known, types, 0)], 0)

    kind = KINDS[model]
    merges, pre = _read_bpe(gf, model) if kind == "bpe" else ([], None)
    ids = _special_ids(gf, model, n, default_bos=pre.default_bos if pre else True)
    # llama.cpp's defaults by tokenizer type, then the metadata flags
    add_space_prefix = gf.get_bool(K.ADD_PREFIX, kind == "spm")
    add_bos = gf.get_bool(K.ADD_BOS, pre.add_bos if pre else kind != "ugm") or bool(pre and pre.force_add_bos)
    add_eos = gf.get_bool(K.ADD_EOS, kind == "ugm")
    remove_extra_ws = gf.get_bool(K.REMOVE_EXTRA_WS, False)
    charsmap = None
    if kind == "ugm":
        blob = gf.get_array(K.PRECOMPILED_CHARSMAP, (GGUFValueType.UINT8, GGUFValueType.INT8), required=False)
        charsmap = None if blob is None or not len(blob) else np.asarray(blob).tobytes()
    lowercase = gf.get_bool(NORMALIZER_LOWERCASE, pre.lowercase if pre else True)
    strip_accents = gf.get_bool(NORMALIZER_STRIP_ACCENTS, lowercase)
    if kind == "wpm":  # llama.cpp adds BOS and SEP around WPM text whatever add_bos says
        for field, key in (("bos", K.BOS_ID), ("sep", K.SEP_ID)):
            if ids[field] is None:
                raise _fail(gf, f"{key} is not set (a WordPiece vocab needs it)")
    for flag, key, field, id_key in ((add_bos, K.ADD_BOS, "bos", K.BOS_ID), (add_eos, K.ADD_EOS, "eos", K.EOS_ID)):
        if flag and ids[field] is None:
            raise _fail(gf, f"{key} is true, but {id_key} is not set")

    eog_ids = _fix_attrs_by_text(token_to_id, texts, attrs, ids)
    _strip_attrs(gf, token_to_id, attrs)
    return Vocab(model, kind, texts, token_to_id, types, attrs.tolist(), scores_list, merges, pre, ids, eog_ids,
                 add_bos, add_eos, add_space_prefix, clean_spaces=kind == "wpm" or bool(pre and pre.clean_spaces),
                 lowercase=lowercase, strip_accents=strip_accents, remove_extra_whitespaces=remove_extra_ws,
                 charsmap=charsmap)


def _read_tokens(gf: GGUFFile) -> tuple[list[str], dict[str, int]]:
    tokens = gf.get_array(K.LIST, (GGUFValueType.STRING,))
    if not tokens:
        raise _fail(gf, f"{K.LIST} is empty")
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)] if "" in tokens else tokens
    token_to_id = dict(zip(texts, range(len(texts))))
    if len(token_to_id) != len(texts):
        first: dict[str, int] = {}
        for i, t in enumerate(texts):
            if t in first:
                raise _fail(gf, f"{K.LIST} has the token {t!r} twice, at ids {first[t]} and {i}")
            first[t] = i
    return texts, token_to_id


def _read_bpe(gf: GGUFFile, model: str) -> tuple[list[str], PreTokenizerSpec]:
    # llama.cpp: "missing pre-tokenizer type, using: 'default'"; the gemma4 model is always "gemma4"
    name = "gemma4" if model == "gemma4" else gf.get_str(K.PRE, "default")
    if name not in PRE_TOKENIZERS:
        raise _fail(gf, f"{K.PRE} {name!r} is not a supported pre-tokenizer "
                        f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    # Kimi K2 may come without merges (llama.cpp then merges nothing)
    merges = gf.get_array(K.MERGES, (GGUFValueType.STRING,), required=name != "kimi-k2")
    return [] if merges is None else merges, PRE_TOKENIZERS[name]


def _special_ids(gf: GGUFFile, model: str, n: int, default_bos: bool) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for field, keys in _ID_KEYS.items():
        tid = _DEFAULT_IDS[model].get(field) if field != "bos" or default_bos else None
        if tid is not None and tid >= n:
            tid = None  # default outside a small vocab: unset, as llama.cpp does
        for key in keys:
            value = gf.get_int(key, required=False)
            if value is None:
                continue
            if not 0 <= value < n:
                raise _fail(gf, f"{key} = {value} is outside the vocab of {n} tokens")
            tid = value
        ids[field] = tid
    return ids


def _fix_attrs_by_text(token_to_id: dict[str, int], texts: list[str], attrs: np.ndarray,
                       ids: dict[str, int | None]) -> frozenset[int]:
    """llama.cpp's text-based fix-ups; fills unset eot/eom/FIM ids in ``ids``, returns the EOG set."""
    control = int(TokenAttr.CONTROL)

    def found(candidates: tuple[str, ...]) -> list[int]:
        return sorted(token_to_id[t] for t in candidates if t in token_to_id)

    for field, candidates in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), ("fim_pre", FIM_PRE_TEXTS),
                              ("fim_suf", FIM_SUF_TEXTS), ("fim_mid", FIM_MID_TEXTS),
                              ("fim_pad", FIM_PAD_TEXTS), ("fim_rep", FIM_REP_TEXTS),
                              ("fim_sep", FIM_SEP_TEXTS)):
        hits = found(candidates)
        if ids[field] is None and hits:
            ids[field] = hits[0]
            attrs[hits[0]] |= control

    controls = np.flatnonzero(attrs & control)
    unused = np.array(["unused" in texts[i] for i in controls.tolist()], dtype=bool)
    attrs[controls[unused]] |= int(TokenAttr.UNUSED)

    eog = {ids[f] for f in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom") if ids[f] is not None}
    for tid in found(EOG_TEXTS):
        eog.add(tid)
        attrs[tid] |= control
    # gpt-oss: these are always rendered
    for tid in found(ALWAYS_RENDERED_TEXTS):
        attrs[tid] = int(TokenAttr.USER_DEFINED)
    eog_texts = {texts[i]: i for i in sorted(eog, reverse=True)}   # the lowest id per text
    # o200k_harmony and solar-open: "<|end|>" ends a message, not generation
    has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = int(TokenAttr.USER_DEFINED)
    # gemma4 and plamo: "</s>" is a normal token
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = int(TokenAttr.NORMAL)
    return frozenset(eog)


def _strip_attrs(gf: GGUFFile, token_to_id: dict[str, int], attrs: np.ndarray) -> None:
    """llama.cpp's per-model LSTRIP/RSTRIP attributes ("set attributes by model/tokenizer/
    architecture name" in ``llama_vocab::impl::load``), chosen by general.name (lowercased),
    tokenizer.ggml.pre and general.architecture as there."""
    name = (gf.get_str("general.name", "") or "").lower()
    pre = gf.get_str(K.PRE, "")
    arch = gf.get_str("general.architecture", "")

    def set_attr(text: str, attr: TokenAttr, on: bool) -> None:
        tid = token_to_id.get(text)
        if tid is not None:
            attrs[tid] = attrs[tid] | int(attr) if on else attrs[tid] & ~int(attr)

    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        set_attr("<mask>", TokenAttr.LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
        special = np.flatnonzero(attrs & int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN))
        attrs[special] |= int(TokenAttr.RSTRIP)
        set_attr("</s>", TokenAttr.RSTRIP, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            set_attr(text, TokenAttr.RSTRIP, False)
    elif "modern-bert" in name:
        set_attr("[MASK]", TokenAttr.LSTRIP, True)
