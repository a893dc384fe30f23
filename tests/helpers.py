"""Small helpers shared by the tests."""

from __future__ import annotations

import math
from typing import Any

import torch


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Bitwise equality of nested states: same keys, same tensor dtype/shape/bytes, equal JSON values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert b.is_contiguous(), f"{path}: loaded tensor is not contiguous"
        assert bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy()), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b) if isinstance(b, dict) else b}"
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: {b!r} is not nan"
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"
