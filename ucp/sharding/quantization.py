"""Block-quantised weights, as DeepSeek-V3's Hugging Face checkpoints store them: a float8 weight atom W of shape
[rows, cols] and a scale atom S of shape [ceil(rows / b0), ceil(cols / b1)] for the block size [b0, b1] (float32, or
float8_e8m0fnu: a power of two per byte, as DeepSeek-V3.1's `scale_fmt: ue8m0` has transformers hold them);
the weight's value is W[i, j] * S[i // b0, j // b1] (the last block of a dimension may be partial). The scale atom
is named as Hugging Face names it, the weight's name with `_scale_inv` appended (`....weight_scale_inv`: it is the
inverse of the scale the quantiser divided by). docs/FORMAT.md section 2.1 specifies it.

Held as stored, a TP split of such a weight must cut along block boundaries, so that each rank's part of the scales is
exactly the scales of its part of the weight (`ucp.sharding.partition.tp_shard` refuses another split); then a local weight
and its local scales dequantise with the same formula as the atoms (`dequantize`). Loaded dequantised, any split
will do: each region of a weight dequantises with the scales of the blocks it falls in (`scale_box`), which two
ranks may share (`ucp.distributed.read_plan`, `ucp.distributed.sharded_load`).
"""

from __future__ import annotations

import torch

from ..base import dtypes
from ..base.boxes import Box
from ..format.manifest import SCALE_DTYPE_NAMES

SCALE_SUFFIX = "_scale_inv"

# What a quantised weight's atom may be stored as (HF's `fmt` "e4m3"): the one DeepSeek-V3's checkpoints use.
WEIGHT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32  # the scales' dtype unless the model's config says another of SCALE_DTYPES
SCALE_DTYPES = tuple(dtypes.torch_dtype(name) for name in SCALE_DTYPE_NAMES)
# The dtypes a weight keeps quantised in (loaded into any other, it is dequantised).
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def scale_name(weight: str) -> str:
    """The name of a quantised weight's scales: `X.weight` -> `X.weight_scale_inv`."""
    return weight + SCALE_SUFFIX


def scale_box(box: Box, block: tuple[int, ...] | list[int]) -> Box:
    """The scale rows/cols of the blocks that a region `box` of a weight falls in (its first and last may be shared
    with the regions beside it: a split that is not on block edges)."""
    return tuple((lo // b, -(-hi // b)) for (lo, hi), b in zip(box, block, strict=True))


def dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """`weight` [..., rows, cols] times the scale of its block, computed in float32 and rounded once to `dtype`:
    DeepSeek's reference `weight_dequant` (its inference kernel: fp8 and scale in fp32, the product stored in the
    default dtype) and transformers' `Fp8Dequantize` compute the same (float8_e8m0fnu scales, too, are taken to
    float32 first, exactly: each is a power of two). Only the scales are expanded, over rows;
    columns broadcast through a view, so memory holds one float32 copy of the weight.

    `weight` may be a region of the atom: `start` is its first [row, col] in the atom and `scales` those of the blocks
    it falls in (`scale_box`); each element then gets the scale, and so the bits, it gets in the whole atom's."""
    b0, b1 = block
    rows, cols = weight.shape[-2:]
    r, c = start[0] % b0, start[1] % b1  # where the region starts in its first block
    out = weight.to(torch.float32)
    per_row = scales.to(torch.float32).repeat_interleave(b0, dim=-2)[..., r : r + rows, :]
    head = min(cols, -c % b1)  # columns before the first block edge (in the first scale column)
    if head:
        out[..., :head].mul_(per_row[..., :1])
    first = 1 if head else 0
    full, rest = divmod(cols - head, b1)
    out[..., head : head + full * b1].unflatten(-1, (full, b1)).mul_(per_row[..., first : first + full, None])
    if rest:
        out[..., head + full * b1 :].mul_(per_row[..., first + full :])
    return out.to(dtype)
