"""Every atom ucp writes is read exactly by other Zarr v3 readers: tensorstore's zarr3 driver and zarr-python."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import ucp

from .helpers import step_path
from .test_format import SMALL_CHUNKS, every_dtype_state

# the extension data types, which numpy knows through ml_dtypes only
_ML_DTYPES = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


def _expected(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    if t.dtype in _ML_DTYPES:
        bits, ml = _ML_DTYPES[t.dtype]
        return t.view(bits).numpy().view(ml)
    return t.numpy()


def _same(actual: np.ndarray, t: torch.Tensor) -> bool:
    expected = _expected(t)
    return actual.dtype == expected.dtype and actual.shape == expected.shape and actual.tobytes() == expected.tobytes()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    state = every_dtype_state()
    ucp.save(state, str(root), options=SMALL_CHUNKS)
    _, tensors = ucp.format.tree.flatten(state)
    return step_path(root, 0), tensors


def test_tensorstore_reads_every_atom_exactly(written):
    ts = pytest.importorskip("tensorstore")
    step_dir, tensors = written
    assert {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2} <= {t.dtype for t in tensors.values()}
    for path, t in tensors.items():
        array = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step_dir / path)}}, open=True
        ).result()
        assert _same(array.read().result(), t), path


def test_zarr_python_reads_every_atom_exactly(written):
    zarr = pytest.importorskip("zarr")
    ucp.register_bfloat16_with_zarr()
    step_dir, tensors = written
    for path, t in tensors.items():
        array = zarr.open_array(str(step_dir / path), mode="r")
        assert _same(np.asarray(array[...]), t), path


def test_zarr_python_sees_the_step_as_a_group_with_the_manifest(written):
    zarr = pytest.importorskip("zarr")
    step_dir, _ = written
    group = zarr.open_group(str(step_dir), mode="r")
    assert group.attrs["ucp"]["format_version"] == "3.1" and group.attrs["ucp"]["index"]["atoms"] > 0
    assert "floats" in group and "float32" in group["floats"]
