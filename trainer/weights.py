"""Canonical atoms of the model's family (Mixtral or Llama) and how a rank's local parameters are cut from them.

Initialization is layout-independent: every canonical tensor (atom) is drawn in full from a generator seeded
by (seed, atom name), then sliced into the local shard (docs/LOCAL_STATE.md). Every layout therefore starts
from the same model. The same slicing loads any set of canonical tensors (e.g. a transformers state dict).
The atoms themselves (names and shapes) are ucp's family tables', through `ucp_config`, the one place where the
trainer's config and ucp's meet.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ucp.sharding.families import canonical_atoms
from ucp.sharding.families.llama import LlamaConfig
from ucp.sharding.families.mixtral import MixtralConfig

from .config import ModelConfig
from .model import DecoderStage
from .parallel.tensor import shard_gate_up, shard_qkv, shard_vocab, split_dim
from .seed import derive_seed

AtomSource = Callable[[str], torch.Tensor]


def ucp_config(m: ModelConfig, stage_layers: list[int] | None = None) -> MixtralConfig | LlamaConfig:
    """The trainer's model config as ucp's family config (what a checkpoint's atoms and layouts are cut by)."""
    common = {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.kv_channels,
        "tie_word_embeddings": m.tie_word_embeddings,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "stage_layers": stage_layers,
    }
    if m.is_moe:
        return MixtralConfig(**common, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k)
    return LlamaConfig(**common)


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every atom of the model, in canonical order, with its full shape (Hugging Face names)."""
    return {name: shape for name, (shape, _) in canonical_atoms(ucp_config(cfg)).items()}


def initial_atom(cfg: ModelConfig, seed: int, name: str) -> torch.Tensor:
    """The initial value of one full atom: norms are ones, every matrix N(0, init_std) from its own generator."""
    shape = canonical_shapes(cfg)[name]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(derive_seed(seed, name))
    return torch.empty(shape).normal_(0.0, cfg.init_std, generator=generator)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


def local_tensor(stage: DecoderStage, local_name: str, atom: AtomSource, tp_rank: int) -> torch.Tensor:
    """The value of one local parameter, cut from the canonical atoms it is made of."""
    cfg, spec = stage.cfg, stage.spec
    tp = spec.tp_size
    if local_name == "embedding.word_embeddings.weight":
        return shard_vocab(atom("model.embed_tokens.weight"), stage.padded_vocab, tp_rank, tp)
    if local_name == "output_layer.weight":
        source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return shard_vocab(atom(source), stage.padded_vocab, tp_rank, tp)
    if local_name == "decoder.final_layernorm.weight":
        return atom("model.norm.weight")
    match = _LAYER.fullmatch(local_name)
    if match is None:
        raise KeyError(f"no canonical source for local parameter {local_name!r}")
    p = f"model.layers.{spec.layers[int(match.group(1))]}."
    rest = match.group(2)
    if rest == "input_layernorm.weight":
        return atom(p + "input_layernorm.weight")
    if rest == "pre_mlp_layernorm.weight":
        return atom(p + "post_attention_layernorm.weight")
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (atom(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        return shard_qkv(q, k, v, cfg.num_heads, cfg.num_kv_heads, tp_rank, tp)
    if rest == "self_attention.linear_proj.weight":
        return split_dim(atom(p + "self_attn.o_proj.weight"), 1, tp_rank, tp)
    if rest == "mlp.linear_fc1.weight":  # the dense MLP
        return shard_gate_up(atom(p + "mlp.gate_proj.weight"), atom(p + "mlp.up_proj.weight"), tp_rank, tp)
    if rest == "mlp.linear_fc2.weight":
        return split_dim(atom(p + "mlp.down_proj.weight"), 1, tp_rank, tp)
    if rest == "mlp.router.weight":
        return atom(p + "block_sparse_moe.gate.weight")
    expert = _EXPERT.fullmatch(rest)
    if expert is None:
        raise KeyError(f"no canonical source for local parameter {local_name!r}")
    x = f"{p}block_sparse_moe.experts.{spec.ep_rank * (cfg.num_experts // spec.ep_size) + int(expert.group(1))}."
    if expert.group(2) == "linear_fc1":
        return shard_gate_up(atom(x + "w1.weight"), atom(x + "w3.weight"), tp_rank, tp)
    return split_dim(atom(x + "w2.weight"), 1, tp_rank, tp)


@torch.no_grad()
def load_canonical(stage: DecoderStage, atom: AtomSource, tp_rank: int) -> None:
    """Fill every local parameter of `stage` from canonical atoms."""
    for name, param in stage.named_parameters():
        value = local_tensor(stage, name, atom, tp_rank)
        if value.shape != param.shape:
            raise ValueError(f"{name}: canonical slice has shape {tuple(value.shape)}, local {tuple(param.shape)}")
        param.copy_(value)


def init_from_seed(stage: DecoderStage, seed: int, tp_rank: int) -> None:
    load_canonical(stage, lambda name: initial_atom(stage.cfg, seed, name), tp_rank)
