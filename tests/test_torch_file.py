"""ucp.interop.torch_file.save writes what torch.save writes; a Deferred made part by part (a distributed optimizer's
flat buffer) lands in the space the archive reserved for it, with its CRC-32 patched in (a valid zip), and only one
part is in memory at a time."""

from __future__ import annotations

import random
import subprocess
import sys
import zipfile

import pytest
import torch

from ucp.interop.torch_file import Deferred, TorchFile, save


def random_parts(rng: random.Random, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
    """Parts in increasing offsets with gaps between some of them (the gaps must read back as zeros)."""
    parts, at = [], rng.randrange(0, 3)
    while at < numel:
        n = min(rng.randrange(1, 5000), numel - at)
        parts.append((at, (torch.randn(n) * 10).to(dtype)))
        at += n + rng.choice([0, 0, rng.randrange(1, 100)])
    return parts


@pytest.mark.parametrize("trial", range(4))
def test_a_tensor_written_in_parts_loads_as_torch_save_wrote_it(tmp_path, trial):
    rng = random.Random(trial)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
    numel = rng.randrange(1, 200_000)
    parts = random_parts(rng, numel, dtype)
    expected = torch.zeros(numel, dtype=dtype)
    for offset, values in parts:
        expected[offset : offset + values.numel()] = values
    whole = torch.randn(7, 3)
    obj = {
        "flat": Deferred((numel,), dtype, parts=lambda: iter(parts)),
        "plain": whole,
        "made": Deferred((2, 5), torch.float32, lambda: torch.arange(10.0).view(2, 5)),
        "second": Deferred((3,), torch.int64, parts=lambda: iter([(1, torch.tensor([4, 5]))])),
    }
    path = tmp_path / "f.pt"
    save(obj, path)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 is right
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["flat"], expected) and loaded["flat"].dtype == dtype
    assert torch.equal(loaded["plain"], whole)
    assert torch.equal(loaded["made"], torch.arange(10.0).view(2, 5))
    assert torch.equal(loaded["second"], torch.tensor([0, 4, 5]))
    f = TorchFile(path)
    assert torch.equal(f.read(f.obj["flat"]), expected)


@pytest.mark.parametrize(
    "parts, problem",
    [
        ([(5, torch.ones(3)), (6, torch.ones(1))], "at 6"),  # overlapping the part before
        ([(8, torch.ones(3))], "at 8"),  # past the end
        ([(0, torch.ones(2, dtype=torch.float64))], "float64"),  # another dtype
    ],
)
def test_parts_that_do_not_fit_are_refused(tmp_path, parts, problem):
    path = tmp_path / "f.pt"
    with pytest.raises(ValueError, match=f"{path}: data/0: a part of .*{problem}"):
        save({"flat": Deferred((10,), torch.float32, parts=lambda: iter(parts))}, path)


def test_a_tensor_written_in_parts_holds_one_part_in_memory(tmp_path):
    """512 MiB written in 4 MiB parts, in a fresh process: its peak RSS grows by far less than the tensor."""
    script = f"""
import resource, torch
from ucp.interop.torch_file import Deferred, save
part = 1 << 20  # elements (4 MiB)
def parts():
    for i in range(128):
        yield i * part, torch.full((part,), float(i))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save({{"flat": Deferred((128 * part,), torch.float32, parts=parts)}}, {str(tmp_path / "big.pt")!r})
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    grown = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout)
    assert grown < 64 << 20, f"peak RSS grew by {grown / 2**20:.0f} MiB writing 512 MiB in 4 MiB parts"
    f = TorchFile(tmp_path / "big.pt")
    flat = f.read(f.obj["flat"])
    assert flat[0] == 0 and flat[(1 << 20) * 77] == 77 and flat[-1] == 127
