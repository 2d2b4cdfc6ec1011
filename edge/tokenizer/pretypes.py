"""The BPE pre-tokenizer types of llama.cpp: ``tokenizer.ggml.pre`` value -> what it selects.

Mirrors two places of llama.cpp's src/llama-vocab.cpp: the ``tokenizer_pre`` -> ``pre_type``
chain of ``llama_vocab::impl::load`` (with the flags each name sets: ``clean_spaces``,
``ignore_merges``, ``add_bos``, ``escape_whitespaces``, no default BOS id) and the
``regex_exprs`` per ``pre_type`` in ``llm_tokenizer_bpe``'s constructor (with its
``byte_encode``). The regexes are written as llama.cpp writes them; :class:`PreTokenizer`
(edge/tokenizer/pretokenize.py) runs them with llama.cpp's semantics.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What a ``tokenizer.ggml.pre`` value selects in llama.cpp.

    ``regexes``: applied in order, each splitting the pieces the previous one left.
    ``clean_spaces``: detokenizing removes spaces before ``?!.,`` and some contractions.
    ``ignore_merges``: a pre-token that is itself a vocab token is emitted whole.
    ``add_bos``: default for ``add_bos`` when ``tokenizer.ggml.add_bos_token`` is absent.
    ``byte_encode``: pre-tokens are mapped to the GPT-2 byte-level alphabet (False: raw
    UTF-8 text, byte fallback through ``<0xXX>`` tokens).
    ``escape_whitespaces``: spaces become U+2581 before BPE (SentencePiece-style BPE).
    ``default_bos``: False where llama.cpp unsets the default BOS id (ChatGLM).
    ``force_add_bos``: ``add_bos`` is on even if the metadata says false (Gemma 4).
    ``newline_tokens``: a pre-token of newlines only that is a vocab token is emitted
    whole (llama.cpp's Gemma 4 fix).
    ``lowercase``: default of ``tokenizer.ggml.normalizer.lowercase`` (used by the
    "whitespace" tokenizer model).
    """

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    byte_encode: bool = True
    escape_whitespaces: bool = False
    default_bos: bool = True
    force_add_bos: bool = False
    newline_tokens: bool = False
    lowercase: bool = True


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
REGEX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
REGEX_LLAMA3 = (_CONTRACTIONS
                + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_QWEN2 = (_CONTRACTIONS
               + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_NEWLINES = r"[^\n]+|[\n]+"
_ASCII_PUNCT_WORD = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
_CJK_KANA = "[一-龥\u3040-ゟ゠-ヿ]+"
_CJK_HANGUL = "[一-龥ࠀ-一가-\ud7ff]+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# [^\r\n\p{L}\p{N}]?  upper/title/modifier/other letters or marks, then lower ones (GPT-4o style)
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
          + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?")


def _lookahead_cased(letter: str) -> str:
    """llama.cpp's rewrite of the GPT-4o word alternatives with lookaheads over ``letter``."""
    upper, lower = rf"((?=[{letter}])([^a-z]))", rf"((?=[{letter}])([^A-Z]))"
    return (rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{_CONTRACTIONS}?")


_TAIL_GPT4O = r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# pre_type -> regex_exprs (llm_tokenizer_bpe)
_DEFAULT = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", REGEX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = PreTokenizerSpec((REGEX_GPT2,))
_LLAMA3 = PreTokenizerSpec((REGEX_LLAMA3,))
_QWEN2 = PreTokenizerSpec((REGEX_QWEN2,))
_STARCODER = PreTokenizerSpec((r"\p{N}", REGEX_GPT2))
_JAIS2 = PreTokenizerSpec((
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}",))
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
    "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2"
    "\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-"
    "\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM = PreTokenizerSpec((
    "[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
))
_DEEPSEEK3 = PreTokenizerSpec((
    r"\p{N}{1,3}", _CJK_KANA,
    _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
))
_SPARK2_5 = PreTokenizerSpec((
    r"\p{N}{1,3}", _CJK_KANA,
    _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
    r"\p{N}",
))
_YOUTU = PreTokenizerSpec((
    "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _CJK_KANA,
    _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_DEEPSEEK_CODER = PreTokenizerSpec(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))
_FALCON = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", REGEX_GPT2, r"[0-9][0-9][0-9]"))
_QWEN35 = PreTokenizerSpec((
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",))
_BLOOM_SPEC = PreTokenizerSpec((_BLOOM,))
_CHATGLM4 = PreTokenizerSpec((REGEX_LLAMA3,), default_bos=False)
_VIKING = PreTokenizerSpec((_BLOOM, r"\p{N}"))
_TEKKEN = PreTokenizerSpec((
    (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
     r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
     r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),))
_CHAMELEON = PreTokenizerSpec((
    r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]", REGEX_GPT2,
))
_GPT4O = PreTokenizerSpec((_lookahead_cased(r"\p{L}") + _TAIL_GPT4O,))
_GRANITE_EMB_MULTI = PreTokenizerSpec((_lookahead_cased(r"\p{L}\p{M}") + _TAIL_GPT4O,))
_TINY_AYA = PreTokenizerSpec((r"\d{1,3}(?=(?:\d{3})*\b)", _CASED + _TAIL_GPT4O))
_SUPERBPE = PreTokenizerSpec((r"\p{N}+", r"(?=(\d{3})+(?!\d))"))
_BAILINGMOE = PreTokenizerSpec((
    (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
     r"|\s*[\r\n]|\s+(?!\S)|\s+"),))
_SEED_CODER = PreTokenizerSpec((
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))
_UFAKZEKA = PreTokenizerSpec((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",))
_AFMOE = PreTokenizerSpec((
    r"\p{AFMoE_digits}",
    "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_LAGUNA = PreTokenizerSpec((REGEX_NEWLINES, REGEX_QWEN2))
_EXAONE_MOE = PreTokenizerSpec((
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+",))
_SPM_STYLE = PreTokenizerSpec((REGEX_NEWLINES,), byte_encode=False, escape_whitespaces=True)
_MINICPM5 = PreTokenizerSpec((
    r"\p{N}{1,3}",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
), ignore_merges=True)


def _names(spec: PreTokenizerSpec, *names: str, **flags) -> dict[str, PreTokenizerSpec]:
    spec = replace(spec, **flags) if flags else spec
    return dict.fromkeys(names, spec)


_OFF = {"clean_spaces": False}

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    **_names(_DEFAULT, "default"),
    **_names(_MINICPM5, "minicpm5"),
    **_names(_LLAMA3, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             "jina-v5-nano", ignore_merges=True, add_bos=True),
    **_names(_DEEPSEEK_LLM, "deepseek-llm", **_OFF),
    **_names(_DEEPSEEK_CODER, "deepseek-coder", **_OFF),
    **_names(_DEEPSEEK3, "deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm", **_OFF),
    **_names(_SPARK2_5, "spark2_5", **_OFF),
    **_names(_YOUTU, "youtu", clean_spaces=False, ignore_merges=True),
    **_names(_FALCON, "falcon"),
    **_names(_GPT2, "mpt", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
             "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "jais", "olmo", "exaone4"),
    # "gpt2" is not a value llama.cpp knows (it writes "gpt-2"), but it names the same thing
    **_names(_GPT2, "gpt2"),
    **_names(_STARCODER, "starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"),
    **_names(_STARCODER, "command-r", "smollm", **_OFF),
    **_names(_JAIS2, "jais-2"),
    **_names(_SPM_STYLE, "gemma4", "granite-embed-multi-311m", force_add_bos=True, newline_tokens=True),
    **_names(_SPM_STYLE, "sarvam-moe", **_OFF),
    **_names(_QWEN2, "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2", **_OFF),
    **_names(_QWEN2, "stablelm2", "megrez"),
    **_names(_QWEN35, "qwen35", **_OFF),
    **_names(_LLAMA3, "dbrx", "smaug-bpe"),
    **_names(_BLOOM_SPEC, "poro-chat", **_OFF),
    **_names(_BLOOM_SPEC, "bloom", "gpt3-finnish"),
    **_names(_CHATGLM4, "chatglm-bpe"),
    **_names(_CHATGLM4, "glm4", "glm5", ignore_merges=True),
    **_names(_VIKING, "viking", **_OFF),
    **_names(_TEKKEN, "tekken", clean_spaces=False, ignore_merges=True, add_bos=True),
    **_names(_EXAONE_MOE, "exaone-moe"),
    **_names(_CHAMELEON, "chameleon", clean_spaces=False, add_bos=True),
    **_names(_GPT4O, "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2", **_OFF),
    **_names(_GRANITE_EMB_MULTI, "granite-embed-multi-97m", clean_spaces=False, ignore_merges=True),
    **_names(_TINY_AYA, "tiny_aya", "cohere2moe", **_OFF),
    **_names(_SUPERBPE, "superbpe", **_OFF),
    **_names(_GPT2, "trillion", "granite-docling", **_OFF),
    **_names(_BAILINGMOE, "bailingmoe", "bailingmoe2", "llada-moe", **_OFF),
    **_names(_SEED_CODER, "seed-coder", **_OFF),
    **_names(_UFAKZEKA, "ufakzeka", **_OFF),
    **_names(_AFMOE, "afmoe", **_OFF),
    **_names(_LAGUNA, "laguna", **_OFF),
    # llama.cpp's hand-written Kimi K2 splitter (a vocabulary converted from tiktoken; merges optional)
    **_names(PreTokenizerSpec((r"\p{Han}+",)), "kimi-k2", **_OFF),
    # for the "whitespace" tokenizer model (which drops whitespace first); under another model
    # llama.cpp aborts on text with whitespace (find_bpe_rank's assert), edge tokenizes it
    **_names(PreTokenizerSpec((r"\S+",), byte_encode=False), "whitespace", lowercase=False),
}
"""``tokenizer.ggml.pre`` value -> spec, for every BPE pre-tokenizer of llama.cpp (0.3.36's)
but :data:`UNSUPPORTED_PRE_TOKENIZERS`."""

UNSUPPORTED_PRE_TOKENIZERS: dict[str, str] = {}
"""llama.cpp pre-tokenizers edge refuses, and why."""
