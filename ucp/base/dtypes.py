"""Data types: torch <-> Zarr v3 names, and the extension data types (`bfloat16`, the float8s) for zarr-python.

Zarr v3 names the core types (bool, int8..int64, uint8, float16/32/64). bfloat16, float8_e4m3fn, float8_e5m2 and
float8_e8m0fnu are the extension data types of those names, which tensorstore reads natively; for zarr-python see
`ucp.zarr_bfloat16`. The float8s hold block-quantised weights (DeepSeek-V3's), whose scales are atoms of their own
(`ucp.sharding.quantization`): float32, or float8_e8m0fnu (a power of two per byte, as DeepSeek-V3.1's `scale_fmt: ue8m0`).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from ..errors import FormatError, StateError


class DTypeFacts(NamedTuple):
    """What ucp needs to know of one data type, worked out once (a load of many small atoms asks per atom)."""

    name: str  # the Zarr v3 data type name
    torch: torch.dtype
    itemsize: int
    fill_value: bool | int | float  # written in array metadata (never used for data: every chunk is written)


def _facts(name: str, dtype: torch.dtype) -> DTypeFacts:
    fill = False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
    return DTypeFacts(name, dtype, dtype.itemsize, fill)


# Zarr v3 data type name -> its facts
_BY_NAME: dict[str, DTypeFacts] = {
    name: _facts(name, dtype)
    for name, dtype in (
        ("bool", torch.bool),
        ("int8", torch.int8),
        ("int16", torch.int16),
        ("int32", torch.int32),
        ("int64", torch.int64),
        ("uint8", torch.uint8),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("float64", torch.float64),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
        ("float8_e8m0fnu", torch.float8_e8m0fnu),
    )
}
_BY_TORCH: dict[torch.dtype, str] = {f.torch: name for name, f in _BY_NAME.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_BY_NAME)


def zarr_name(dtype: torch.dtype) -> str:
    """The Zarr v3 data type name of a torch dtype."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise StateError(
            f"tensors of dtype {dtype} cannot be stored; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def facts(name: str) -> DTypeFacts:
    """The facts of a Zarr v3 data type name; a FormatError for a name ucp does not read."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown data type {name!r:.80}; ucp reads {', '.join(SUPPORTED_DTYPES)}") from None


def check_dense(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """`tensor` if its values are laid out in memory, as ucp stores and loads them (strided, with data); otherwise a
    StateError naming `where` and what to do instead."""
    if tensor.layout != torch.strided:
        raise StateError(
            f"{where} is a {str(tensor.layout).removeprefix('torch.')} tensor: ucp stores dense tensors "
            "(save tensor.to_dense(), or its parts as tensors of their own)"
        )
    if tensor.device.type == "meta":
        raise StateError(f"{where} is on the meta device: it has no values to save")
    return tensor


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a Zarr v3 data type name."""
    return facts(name).torch


def itemsize(name: str) -> int:
    return facts(name).itemsize


def fill_value(name: str) -> bool | int | float:
    """The fill value written in array metadata (never used for data: every chunk is written)."""
    return facts(name).fill_value


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The little-endian bytes of a CPU tensor, without a copy when it is contiguous (else of a contiguous copy), as a
    writable view of its memory that keeps the tensor alive.

    Taken from the tensor's address, not through `tensor.numpy()`: numpy's view marks the tensor's storage as not
    resizable for good, and a tensor ucp loaded (or saved) must stay the caller's to free, resize or save as any
    other; it is also a third of the cost."""
    if tensor.device.type != "cpu":
        raise ValueError(f"the bytes of a tensor on {tensor.device} are not in host memory")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor)


def memory_at(address: int, nbytes: int, owner: object) -> memoryview:
    """A writable view of `nbytes` of host memory at `address`, which `owner` (a tensor) holds: the view keeps it
    alive."""
    if not nbytes:
        return memoryview(bytearray(0))
    memory = _ADDRESSED.from_address(address)  # (one array type: a type per size costs ~15 us to make)
    memory._owner = owner  # type: ignore[attr-defined]  # (the memory stays alive while the view is used)
    return memoryview(memory).cast("B")[:nbytes]


def copy_strided(dest: torch.Tensor, src: torch.Tensor) -> None:
    """`dest.copy_(src)` for CPU tensors of one dtype and shape, any strides, done by numpy in the calling thread:
    torch spreads a large copy over its OpenMP threads, which then spin on the cores that a load's read threads need
    (a 1 GiB load of column blocks, on 2 cores: 0.4 CPU-s of spinning). Their memory is viewed from its address,
    not through `tensor.numpy()` (which would mark the storage unresizable)."""
    if dest.device.type != "cpu" or src.device.type != "cpu":
        dest.copy_(src)
        return
    import numpy as np

    def view(t: torch.Tensor) -> np.ndarray:
        size = t.element_size()
        span = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size if t.numel() else 0
        flat = np.frombuffer(memory_at(t.data_ptr(), span, t), dtype=np.uint8)
        shape, strides = (*t.shape, size), (*(st * size for st in t.stride()), 1)
        return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)

    np.copyto(view(dest), view(src))


_ADDRESSED = ctypes.c_ubyte * (1 << 46)  # memory at an address (as_bytes views the first bytes of it; none is touched)


def register_bfloat16_with_zarr() -> None:
    """Teach zarr-python the extension data types `bfloat16`, `float8_e4m3fn`, `float8_e5m2` and `float8_e8m0fnu`
    (kept out of `import ucp`: zarr is slow to import)."""
    from .. import zarr_bfloat16  # noqa: F401  (registers on import)
