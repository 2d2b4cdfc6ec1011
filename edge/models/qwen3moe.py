"""Qwen3-MoE (``general.architecture = qwen3moe``). Mirrors llama.cpp's qwen3moe graph
(llm_build_qwen3moe; in llama.cpp 0.3.36 ``llama_model_qwen3moe::graph``,
src/models/qwen3moe.cpp): Qwen3's attention (edge.models.qwen3: per-head q/k RMSNorm, NeoX
RoPE) and, after the pre-FFN RMSNorm, a mixture of experts instead of the dense FFN
(edge.models.moe, build_moe_ffn): the router ffn_gate_inp, softmax, the ``expert_used_count``
experts of highest probability, their probabilities normalised to sum 1 (llama.cpp always
normalises for qwen3moe, whatever the file says; it reads no ``expert_weights_scale`` for it),
SwiGLU experts ffn_gate_exps / ffn_up_exps / ffn_down_exps of ``expert_feed_forward_length``
(default feed_forward_length / expert_used_count, as llama.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
from gguf import Keys

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs, read_int
from edge.models.layers import ATTENTION_TENSORS, Batch
from edge.models.moe import ffn_moe
from edge.models.qwen3 import QK_NORM_TENSORS, Qwen3, Qwen3Block
from edge.models.transformer import EMBEDDING_AND_OUTPUT
from edge.models.weights import tensor

ARCH = "qwen3moe"
MAX_EXPERTS = 1024   # llama.cpp's LLAMA_MAX_EXPERTS


@dataclass
class Qwen3MoeArgs(ModelArgs):
    """ModelArgs plus the experts: ``n_expert`` (expert_count), ``n_expert_used``
    (expert_used_count) and ``n_ff_exp`` (expert_feed_forward_length)."""

    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0

    KEYS: ClassVar[dict[str, str]] = {**ModelArgs.KEYS, "n_expert": Keys.LLM.EXPERT_COUNT,
                                      "n_expert_used": Keys.LLM.EXPERT_USED_COUNT,
                                      "n_ff_exp": Keys.LLM.EXPERT_FEED_FORWARD_LENGTH}


def read_args(gf: GGUFFile) -> Qwen3MoeArgs:
    """The hyperparameters (edge.models.hparams: every key checked). Raises GGUFError naming the
    key for an expert count outside 1..1024 or a used count outside 1..expert_count."""
    args = Qwen3MoeArgs.common_from_gguf(gf, ARCH, rope_neox=True)
    n_expert = read_int(gf, args.key(Keys.LLM.EXPERT_COUNT), hi=MAX_EXPERTS)
    used_key = args.key(Keys.LLM.EXPERT_USED_COUNT)
    n_used = read_int(gf, used_key)
    if n_used > n_expert:
        raise GGUFError(f"{gf.path}: {used_key} = {n_used} is more than {args.key(Keys.LLM.EXPERT_COUNT)} = {n_expert}")
    n_ff_exp = read_int(gf, args.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), default=args.n_ff // n_used)
    return replace(args, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


class Qwen3MoeBlock(Qwen3Block):
    """One layer of llm_build_qwen3moe: Qwen3's (edge.models.qwen3.Qwen3Block.__call__) with the
    mixture of experts as its FFN."""

    def ffn(self, h: np.ndarray, b: Batch) -> np.ndarray:
        a = self.args
        return ffn_moe(h, self.ffn_gate_inp, self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps,
                       a.n_expert_used, True, b)


class Qwen3Moe(Qwen3):
    TENSORS = EMBEDDING_AND_OUTPUT
    LAYER_TENSORS = [
        *ATTENTION_TENSORS,
        *QK_NORM_TENSORS,
        tensor("ffn_norm.weight", "n_embd"),
        tensor("ffn_gate_inp.weight", "n_embd", "n_expert"),
        tensor("ffn_gate_exps.weight", "n_embd", "n_ff_exp", "n_expert"),
        tensor("ffn_up_exps.weight", "n_embd", "n_ff_exp", "n_expert"),
        tensor("ffn_down_exps.weight", "n_ff_exp", "n_embd", "n_expert"),
    ]
    BLOCK = Qwen3MoeBlock


def load(gf: GGUFFile) -> Qwen3Moe:
    """The model of a qwen3moe file. Raises GGUFError naming a bad key or tensor."""
    return Qwen3Moe(gf, read_args(gf))
