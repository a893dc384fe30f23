"""Short dtype names accepted on the command line and in the interop APIs."""

from __future__ import annotations

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


def short_name(dtype: torch.dtype) -> str:
    """The name transformers writes in config.json ("bfloat16", "float32", ...)."""
    return str(dtype).removeprefix("torch.")
