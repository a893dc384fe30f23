"""Mixtral and Llama (the math of transformers' MixtralForCausalLM and LlamaForCausalLM), written as one pipeline
stage with TP and EP built in: the two differ only in the MLP (routed experts, or one dense SwiGLU).

A `DecoderStage` holds the layers of one pipeline stage; with one stage it is the whole model. Its parameter
names are the local Megatron-Core names of docs/LOCAL_STATE.md (`model.named_parameters()` is the rank's
local state), in the order of that table. Shapes are local: split over TP, experts split over EP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .parallel.expert import ExpertRouting
from .parallel.mesh import group_rank
from .parallel.tensor import (
    column_parallel,
    copy_to_tp,
    gather_from_tp,
    padded_vocab_size,
    reduce_from_tp,
    row_parallel,
    vocab_parallel_embedding,
)


@dataclass(frozen=True)
class StageSpec:
    """What one rank's stage holds: which global layers, which experts, which TP slice."""

    layers: list[int]  # global layer indices of this stage, in order
    first: bool
    last: bool
    tp_size: int = 1
    ep_size: int = 1
    ep_rank: int = 0


class Weight(nn.Module):
    """A bare weight (no bias, no init: every value comes from canonical tensors, see trainer/weights.py)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class RMSNorm(Weight):
    def __init__(self, hidden: int, eps: float):
        super().__init__(hidden)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(seq_len, dtype=torch.float, device=device)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with fused, TP-split QKV, laid out as megatron-core lays it out (docs/LOCAL_STATE.md):
    with TP dividing the KV heads each rank holds kv_heads/T whole query groups; with fewer KV heads than TP ranks
    (T a multiple of them) the T/kv_heads ranks of a group each hold a run of its rows, gather the group's QKV
    output and keep their heads/T query heads of it (megatron-core's attention.py, num_query_groups < tp)."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group):
        super().__init__()
        kv, heads = cfg.num_kv_heads, cfg.num_heads
        if kv % tp and tp % kv:
            raise ValueError(f"tp={tp} must divide num_kv_heads={kv} or be a multiple of it")
        if heads % tp:
            raise ValueError(f"num_heads={heads} must be divisible by tp={tp}")
        self.head_dim = cfg.kv_channels
        self.heads_per_group = heads // kv
        self.tp_group = tp_group
        self.shared = kv < tp  # ranks share a query group
        self.groups = 1 if self.shared else kv // tp  # query groups in this rank's QKV output (after the gather)
        self.local_heads = heads // tp
        if self.shared:
            tp_rank = group_rank(tp_group)
            self.group_of_rank = tp_rank // (tp // kv)  # its group among the gathered ones
            self.first_head = (tp_rank % (tp // kv)) * self.local_heads  # its query heads in that group
            self.gathered_groups = kv
        rows = kv * (self.heads_per_group + 2) * self.head_dim
        if rows % tp:
            raise ValueError(f"tp={tp} must divide the {rows} rows of the fused QKV")
        self.linear_qkv = Weight(rows // tp, cfg.hidden_size)
        self.linear_proj = Weight(cfg.hidden_size, self.local_heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = column_parallel(x, self.linear_qkv.weight, self.tp_group)
        if self.shared:
            qkv = gather_from_tp(qkv, self.tp_group).view(b, s, self.gathered_groups, -1)[:, :, self.group_of_rank]
        qkv = qkv.reshape(b, s, self.groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, -2].transpose(1, 2)
        v = qkv[:, :, :, -1].transpose(1, 2)
        if self.shared:  # this rank's query heads of the group, all of which attend to its one KV head
            q = q[:, self.first_head : self.first_head + self.local_heads]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return row_parallel(out, self.linear_proj.weight, self.tp_group)


class Expert(nn.Module):
    """SwiGLU expert; fc1 is the fused [gate; up] of this TP rank, fc2 its row-parallel down projection."""

    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        if cfg.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size={cfg.ffn_hidden_size} must be divisible by tp={tp}")
        self.linear_fc1 = Weight(2 * cfg.ffn_hidden_size // tp, cfg.hidden_size)
        self.linear_fc2 = Weight(cfg.hidden_size, cfg.ffn_hidden_size // tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.linear_fc1.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.linear_fc2.weight)  # partial sum over TP


class DenseMLP(Expert):
    """Llama's SwiGLU MLP: one expert's weights and math, seeing every token, with the TP copy before it and the
    TP reduction after (an expert's are in `MoE`). Returns the block's output and a zero load-balancing loss (there
    is no router), as `MoE` does."""

    def __init__(self, cfg: ModelConfig, tp: int, tp_group):
        super().__init__(cfg, tp)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return reduce_from_tp(super().forward(copy_to_tp(x, self.tp_group)), self.tp_group), x.new_zeros(())


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, count: int):
        super().__init__()
        self.local_experts = nn.ModuleList(Expert(cfg, tp) for _ in range(count))


class MoE(nn.Module):
    """Softmax top-k router (renormalized top-k weights), experts split over EP, each expert split over TP.

    Returns the block's output and its load-balancing loss (Switch Transformer, as transformers computes it,
    but over this layer's tokens of one microbatch).
    """

    def __init__(self, cfg: ModelConfig, tp: int, ep: int, tp_group, ep_group):
        super().__init__()
        if cfg.num_experts % ep:
            raise ValueError(f"num_experts={cfg.num_experts} must be divisible by ep={ep}")
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.tp_group, self.ep_group = tp_group, ep_group
        self.router = Weight(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg, tp, cfg.num_experts // ep)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        # The router is replicated over TP and sees the same tokens on every TP rank: its gradient needs no
        # TP reduction, so it stays outside copy_to_tp.
        probs = F.softmax(F.linear(tokens, self.router.weight).float(), dim=-1)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        top_weights = (top_weights / top_weights.sum(dim=-1, keepdim=True)).to(x.dtype)

        assigned = torch.bincount(top_experts.flatten(), minlength=self.num_experts).float() / tokens.shape[0]
        aux_loss = self.num_experts * torch.sum(assigned * probs.mean(dim=0))

        routing = ExpertRouting(top_experts.flatten(), self.num_experts, self.ep_group)
        rows = copy_to_tp(routing.dispatch(tokens.repeat_interleave(self.top_k, dim=0)), self.tp_group)
        chunks = rows.split(routing.counts_per_local_expert)
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts.local_experts, chunks)])
        # Sum the TP partial outputs before weighting, so the routing weights' gradient is complete on every
        # TP rank.
        out = routing.combine(reduce_from_tp(out, self.tp_group)).view(-1, self.top_k, shape[-1])
        return (out * top_weights.unsqueeze(-1)).sum(dim=1).view(shape), aux_loss


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: StageSpec, tp_group, ep_group):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attention = Attention(cfg, spec.tp_size, tp_group)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if cfg.is_moe:
            self.mlp = MoE(cfg, spec.tp_size, spec.ep_size, tp_group, ep_group)
        else:
            self.mlp = DenseMLP(cfg, spec.tp_size, tp_group)

    def forward(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        mlp_out, aux_loss = self.mlp(self.pre_mlp_layernorm(x))
        return x + mlp_out, aux_loss


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: StageSpec, tp_group, ep_group):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, tp_group, ep_group) for _ in spec.layers)
        if spec.last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class VocabEmbedding(nn.Module):
    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.word_embeddings = Weight(rows, hidden)


class DecoderStage(nn.Module):
    """The layers of one pipeline stage. forward: tokens (first stage) or hidden states -> hidden states, or
    local logits [b, s, padded_vocab/T] on the last stage; plus the sum of this stage's load-balancing losses."""

    def __init__(self, cfg: ModelConfig, spec: StageSpec, tp_group=None, ep_group=None):
        super().__init__()
        self.cfg, self.spec, self.tp_group = cfg, spec, tp_group
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, spec.tp_size)
        rows = self.padded_vocab // spec.tp_size
        if spec.first:
            self.embedding = VocabEmbedding(rows, cfg.hidden_size)
        self.decoder = Decoder(cfg, spec, tp_group, ep_group)
        # With tied embeddings and a single stage the output layer is the embedding itself.
        if spec.last and not (cfg.tie_word_embeddings and spec.first):
            self.output_layer = Weight(rows, cfg.hidden_size)

    def output_weight(self) -> torch.Tensor:
        return self.output_layer.weight if hasattr(self, "output_layer") else self.embedding.word_embeddings.weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.first:
            x = vocab_parallel_embedding(x, self.embedding.word_embeddings.weight, self.tp_group)
        cos, sin = rope_cos_sin(x.shape[1], self.cfg.kv_channels, self.cfg.rope_theta, x.device)
        aux_total = x.new_zeros(())
        for layer in self.decoder.layers:
            x, aux_loss = layer(x, cos.to(x.dtype), sin.to(x.dtype))
            aux_total = aux_total + aux_loss
        if self.spec.last:
            x = column_parallel(self.decoder.final_layernorm(x), self.output_weight(), self.tp_group)
        return x, aux_total


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name
