"""The extension data types `bfloat16`, `float8_e4m3fn`, `float8_e5m2` and `float8_e8m0fnu` for zarr-python, which
has none of them (tensorstore reads all four natively).

Importing this module registers them (`ucp.register_bfloat16_with_zarr()` does that). ucp's distribution also
declares them as `zarr.data_type` entry points, for zarr versions that load those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import BaseFloat

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_FLOAT8_E8M0FNU = np.dtype(ml_dtypes.float8_e8m0fnu)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """bfloat16 for zarr-python, stored as 2 little-endian bytes per element (ml_dtypes)."""

    dtype_cls = type(_BFLOAT16)
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @property
    def item_size(self) -> int:
        return 2

    def to_native_dtype(self) -> np.dtype:
        return _BFLOAT16


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(BaseFloat):
    """float8_e4m3fn for zarr-python (1 byte per element: sign, 4 exponent bits, 3 mantissa bits; no infinities)."""

    dtype_cls = type(_FLOAT8_E4M3FN)
    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @property
    def item_size(self) -> int:
        return 1

    def to_native_dtype(self) -> np.dtype:
        return _FLOAT8_E4M3FN


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(BaseFloat):
    """float8_e5m2 for zarr-python (1 byte per element: sign, 5 exponent bits, 2 mantissa bits)."""

    dtype_cls = type(_FLOAT8_E5M2)
    _zarr_v3_name: ClassVar[str] = "float8_e5m2"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @property
    def item_size(self) -> int:
        return 1

    def to_native_dtype(self) -> np.dtype:
        return _FLOAT8_E5M2


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(BaseFloat):
    """float8_e8m0fnu for zarr-python (1 byte per element: an unsigned 8-bit exponent, 2**(byte - 127); 0xFF NaN)."""

    dtype_cls = type(_FLOAT8_E8M0FNU)
    _zarr_v3_name: ClassVar[str] = "float8_e8m0fnu"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @property
    def item_size(self) -> int:
        return 1

    def to_native_dtype(self) -> np.dtype:
        return _FLOAT8_E8M0FNU


# zarr-python 3.1 lists entry-point data types but never loads them when matching metadata, so register here:
# `import ucp.zarr_bfloat16` (or ucp.register_bfloat16_with_zarr()) before opening such arrays with zarr.
for _cls in (BFloat16, Float8E4M3FN, Float8E5M2, Float8E8M0FNU):
    data_type_registry.register(_cls._zarr_v3_name, _cls)
