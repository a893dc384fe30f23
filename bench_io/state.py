"""Synthetic checkpoint states: random (incompressible) bits in the shapes and dtypes of real training state.

Three kinds:
- `transformer_specs`: what a dense transformer trained with mixed-precision Adam holds: bf16 parameters,
  and per parameter fp32 master weights, exp_avg and exp_avg_sq (14 bytes per parameter). A few big
  embedding-like matrices, many mid-size layer matrices, many small bias / norm vectors.
- `small_specs`: many tiny tensors (1-64 KiB, log-uniform), the case where per-object overheads dominate.
- `large_specs`: the same bytes in a few large tensors, the baseline that `small_specs` is compared to.

A state is a nested dict (what `ucp.save` and `torch.save` take) plus its flat view ('a/b/c' -> tensor, what
safetensors and the raw baseline take). Every tensor has its own storage: `torch.save` writes a view's whole
storage, so shared buffers would inflate its files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
BYTES_PER_PARAM = 2 + 3 * 4  # bf16 param + fp32 master, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class TensorSpec:
    path: str  # '/'-separated: the key path in the nested state
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _layer_params(h: int) -> list[tuple[str, tuple[int, ...]]]:
    """One transformer block, Megatron-style canonical (unfused-by-TP) shapes."""
    return [
        ("ln1/weight", (h,)),
        ("ln1/bias", (h,)),
        ("attn/qkv/weight", (3 * h, h)),
        ("attn/qkv/bias", (3 * h,)),
        ("attn/proj/weight", (h, h)),
        ("attn/proj/bias", (h,)),
        ("ln2/weight", (h,)),
        ("ln2/bias", (h,)),
        ("mlp/fc1/weight", (4 * h, h)),
        ("mlp/fc1/bias", (4 * h,)),
        ("mlp/fc2/weight", (h, 4 * h)),
        ("mlp/fc2/bias", (h,)),
    ]


def transformer_specs(target_bytes: int, *, layer_share: float = 0.6) -> list[TensorSpec]:
    """Parameters and Adam state of a transformer whose total is at most `target_bytes` and short of it by
    less than one embedding row pair (28 * hidden bytes). About `layer_share` of the bytes sit in the
    blocks, the rest in the input embedding and the (untied) output layer, as in small-to-mid LLMs."""
    n_params = max(target_bytes // BYTES_PER_PARAM, 1)
    h = max(64, 64 * round(math.sqrt(layer_share * n_params / (12 * 8)) / 64))  # ~8 blocks
    per_layer = sum(math.prod(s) for _, s in _layer_params(h))
    layers = max(1, int(layer_share * n_params // per_layer))
    vocab = max(1, (n_params - layers * per_layer - 2 * h) // (2 * h))
    params: list[tuple[str, tuple[int, ...]]] = [("embed/weight", (vocab, h))]
    for i in range(layers):
        params += [(f"layers/{i}/{name}", shape) for name, shape in _layer_params(h)]
    params += [("final_ln/weight", (h,)), ("final_ln/bias", (h,)), ("lm_head/weight", (vocab, h))]
    specs = [TensorSpec(f"model/{p}", s, torch.bfloat16) for p, s in params]
    for state in ("master", "exp_avg", "exp_avg_sq"):
        specs += [TensorSpec(f"optimizer/{state}/{p}", s, torch.float32) for p, s in params]
    return specs


def small_specs(count: int, *, seed: int = 0, lo: int = 1 * KiB, hi: int = 64 * KiB) -> list[TensorSpec]:
    """`count` fp32 vectors of lo..hi bytes, log-uniform (most are small, as norms and biases are)."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(math.log(lo), math.log(hi), size=count)).astype(np.int64) // 4
    # grouped 256 to a dict, as a model's modules group their tensors
    return [TensorSpec(f"small/g{i // 256}/t{i % 256}", (int(n),), torch.float32) for i, n in enumerate(sizes)]


def large_specs(total_bytes: int, *, count: int = 4) -> list[TensorSpec]:
    """`total_bytes` (a multiple of 4) as `count` fp32 vectors; the last takes the remainder."""
    elems = total_bytes // 4
    each = elems // count
    sizes = [each] * (count - 1) + [elems - each * (count - 1)]
    return [TensorSpec(f"large/t{i}", (n,), torch.float32) for i, n in enumerate(sizes) if n]


def random_tensor(spec: TensorSpec, rng: np.random.Generator) -> torch.Tensor:
    """Uniform random bits (so no layer below can compress or deduplicate them); NaNs and infs included."""
    n = spec.nbytes
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64, endpoint=True)
    raw = words.view(np.uint8)[:n]
    if n % 8:
        raw = raw.copy()  # its own storage, exactly n bytes
    return torch.from_numpy(raw).view(spec.dtype).reshape(spec.shape)


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dict -> {'a/b/c': tensor}; non-tensor leaves are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "/"))
        elif isinstance(value, torch.Tensor):
            out[path] = value
    return out


@dataclass
class SyntheticState:
    name: str
    tree: dict[str, Any]  # nested, as a training loop hands it to a checkpointer
    flat: dict[str, torch.Tensor]
    nbytes: int  # tensor payload: the bytes every method must move

    @property
    def count(self) -> int:
        return len(self.flat)

    def verify(self, loaded: dict[str, torch.Tensor], *, sample: int = 8, seed: int = 0) -> str | None:
        """None if `loaded` (flat) holds this state; else what is wrong. Every tensor's name, dtype, shape and
        first, middle and last 64 bytes are checked; a sample (the largest, the smallest and random ones) bit for bit."""
        if loaded.keys() != self.flat.keys():
            missing, extra = sorted(self.flat.keys() - loaded.keys()), sorted(loaded.keys() - self.flat.keys())
            return f"tensor names differ: missing {missing[:3]}, unexpected {extra[:3]}"
        for path, want in self.flat.items():
            got = loaded[path]
            if got.dtype != want.dtype or got.shape != want.shape:
                return f"{path}: got {got.dtype}{tuple(got.shape)}, saved {want.dtype}{tuple(want.shape)}"
            a, b = _bytes(got), _bytes(want)
            mid = max(0, a.numel() // 2 - 32)
            if not all(torch.equal(a[s], b[s]) for s in (slice(0, 64), slice(mid, mid + 64), slice(-64, None))):
                return f"{path}: bytes differ"
        by_size = sorted(self.flat, key=lambda p: self.flat[p].nbytes)
        rng = np.random.default_rng(seed)
        picks = {by_size[-1], by_size[0], *rng.choice(by_size, size=min(sample, len(by_size)), replace=False)}
        for path in picks:
            if not torch.equal(_bytes(loaded[path]), _bytes(self.flat[path])):
                return f"{path}: bytes differ"
        return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def make_state(
    name: str, specs: list[TensorSpec], *, seed: int = 0, extra: dict[str, Any] | None = None
) -> SyntheticState:
    """Materialize `specs` as random bits; `extra` adds JSON leaves (step counters and such) to the tree."""
    rng = np.random.default_rng(seed)
    tree: dict[str, Any] = {}
    flat: dict[str, torch.Tensor] = {}
    for spec in specs:
        flat[spec.path] = t = random_tensor(spec, rng)
        set_path(tree, spec.path, t)
    tree.update(extra or {})
    return SyntheticState(name, tree, flat, sum(s.nbytes for s in specs))


def transformer_state(target_bytes: int, *, seed: int = 0) -> SyntheticState:
    return make_state(
        "mixed", transformer_specs(target_bytes), seed=seed, extra={"step": 1000, "config": {"kind": "synthetic"}}
    )


def even_layers(size_gib: float, per_layer: int, fixed: int, minimum: int) -> int:
    """The number of layers (at least `minimum`, even: the benchmarks' source layouts have pp2) that brings a model of
    `per_layer` parameters a layer and `fixed` outside them to about `size_gib` in bf16."""
    layers = max(minimum, round((size_gib * 2**30 / 2 - fixed) / per_layer))
    return layers + layers % 2
