"""Block-quantised weights, as DeepSeek-V3's Hugging Face checkpoints store them: a float8 weight atom W of shape
[rows, cols] and a float32 scale atom S of shape [ceil(rows / b0), ceil(cols / b1)] for the block size [b0, b1];
the weight's value is W[i, j] * S[i // b0, j // b1] (the last block of a dimension may be partial). The scale atom
is named as Hugging Face names it, the weight's name with `_scale_inv` appended (`....weight_scale_inv`: it is the
inverse of the scale the quantiser divided by). docs/FORMAT.md section 2.1 specifies it.

A TP split of such a weight must cut along block boundaries, so that each rank's part of the scales is exactly the
scales of its part of the weight (`ucp.partition.tp_shard` refuses another split); then a local weight and its
local scales dequantise with the same formula as the atoms (`dequantize`).
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"

# What a quantised weight's atom may be stored as (HF's `fmt` "e4m3"): the one DeepSeek-V3's checkpoints use.
WEIGHT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32


def scale_name(weight: str) -> str:
    """The name of a quantised weight's scales: `X.weight` -> `X.weight_scale_inv`."""
    return weight + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The scales' shape of a weight of `shape` in blocks of `block` (a partial block at the end of a dim counts)."""
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=True))


def dequantize(
    weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, ...] | list[int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight` [..., rows, cols] times the scale of its block, computed in float32 and rounded once to `dtype`:
    DeepSeek's reference `weight_dequant` (its inference kernel: fp8 and scale in fp32, the product stored in the
    default dtype) and transformers' `Fp8Dequantize` compute the same. Only the scales are expanded, over rows;
    columns broadcast through a view, so memory holds one float32 copy of the weight."""
    b0, b1 = block
    rows, cols = weight.shape[-2:]
    out = weight.to(torch.float32)
    per_row = scales.to(torch.float32).repeat_interleave(b0, dim=-2)[..., :rows, :]
    full, rest = divmod(cols, b1)
    out[..., : full * b1].unflatten(-1, (full, b1)).mul_(per_row[..., :full, None])
    if rest:
        out[..., full * b1 :].mul_(per_row[..., full:])
    return out.to(dtype)
