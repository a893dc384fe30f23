"""Short dtype names accepted on the command line and in the interop APIs, the parameters' dtypes an import keeps,
and a checkpoint's tensors' dtypes (`Dtypes`)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..sharding.reshard import LocalTensor
from .errors import InteropError

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


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a checkpoint's tensors: each optimizer state's (and the parameters' most common, key None), and
    each parameter atom's own (a bf16 model's fp32 router bias stays fp32 through every conversion)."""

    of_state: dict[str | None, torch.dtype]
    of_atom: dict[str, torch.dtype]

    def of(self, lt: LocalTensor) -> torch.dtype:
        """A local tensor's dtype: for a parameter its atoms' (one that holds them all exactly, where a fused
        tensor's atoms are stored in several: bf16 and fp16 make fp32), for an optimizer state its state's."""
        if lt.state is None and lt.pieces:
            return functools.reduce(torch.promote_types, (self.atom(p.atom, None) for p in lt.pieces))
        return self.of_state[lt.state]

    def atom(self, atom: str, state: str | None) -> torch.dtype:
        return self.of_atom.get(atom, self.of_state[None]) if state is None else self.of_state[state]

    def save_dtypes(self) -> dict[str | None, torch.dtype]:
        """`streaming.save_atoms`' dtype_of: the states', and the parameter atoms' kept as they are."""
        return {**self.of_state, **kept_param_dtypes(self.of_atom)}
