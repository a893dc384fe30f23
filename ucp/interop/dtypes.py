"""Short dtype names accepted on the command line and in the interop APIs, and the parameters' dtypes an import keeps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ucp.interop.errors import InteropError

_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """bf16 / fp16 / fp32 (and their long names) to a torch dtype; None stays None (keep the stored dtype)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise InteropError(f"unknown dtype {name!r}; expected one of bf16, fp16, fp32") from None


def most_common(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype most tensors have (the first seen of a tie; fp32 for none): what a model is said to be in."""
    seen = list(dtypes)
    return max(dict.fromkeys(seen), key=seen.count) if seen else torch.float32


def kept_param_dtypes(
    of_atom: Mapping[str, torch.dtype], cast: torch.dtype | None = None
) -> dict[str | None, torch.dtype]:
    """`streaming.save_atoms`' dtype_of for parameters: all `cast` when given; else kept as stored, the most common
    dtype (key None) and each atom's own where it differs (a bf16 model's fp32 router bias stays fp32)."""
    if cast is not None:
        return {None: cast}
    common = most_common(of_atom.values())
    return {None: common, **{a: d for a, d in of_atom.items() if d != common}}


def short_name(dtype: torch.dtype) -> str:
    """The name transformers writes in config.json ("bfloat16", "float32", ...)."""
    return str(dtype).removeprefix("torch.")
