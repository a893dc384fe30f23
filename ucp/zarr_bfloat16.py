"""The `bfloat16` extension data type for zarr-python, which has none (tensorstore reads it natively).

Importing this module registers it (`ucp.register_bfloat16_with_zarr()` does that). ucp's distribution also
declares it as a `zarr.data_type` entry point, for zarr versions that load those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import BaseFloat

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


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


# zarr-python 3.1 lists entry-point data types but never loads them when matching metadata, so register here:
# `import ucp.zarr_bfloat16` (or ucp.register_bfloat16_with_zarr()) before opening bf16 arrays with zarr.
data_type_registry.register("bfloat16", BFloat16)
