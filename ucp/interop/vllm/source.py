"""What a vLLM engine reads from a ucp step: the weights by their Hugging Face names (which are the atom names), the
config.json that `ucp export --to hf` would write for the step, and the model directory vLLM is started from.

vLLM reads a model's config from a local directory before any loader runs (its `ModelConfig` parses `config.json`
there), and takes an `s3://` model for an object-storage repository that it pulls itself. So an engine starts from a
small directory that `model_dir` writes (`ucp export URL --to vllm DIR` on the command line): config.json, built from
the model config the checkpoint keeps exactly as an export builds it (`ucp.interop.hf.plan_export`), and `ucp-checkpoint.json`
naming the checkpoint and step. No weight is written there: the loader (`ucp.interop.vllm.loader`) reads them from the
checkpoint itself, through ucp's reader (every chunk checked against its CRC-32C and its commit's record), from any
URL ucp reads (a local path, `s3://...`, any fsspec URL).

Reads go in groups within a memory budget, the next group read while vLLM copies the current one into its
parameters. A worker that keeps only a region of a weight (tensor parallelism) reads only that region
(`StepWeights.tensors` with `regions`): the tensor it hands over has the weight's full shape, of which only the region
is filled, since vLLM's weight loaders take a full tensor and cut their share out of it themselves.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...base.boxes import Box, full_box, to_slices
from ...base.workpool import pack
from ...distributed.sharded_model import model_config_of
from ...engine.checkpoint import CheckpointReader, allocate, open_checkpoint
from ...sharding.families import FamilyConfig
from ..errors import InteropError, ModelMismatchError
from ..hf import FILE_KEYS, ExportPlan, plan_export, ucp_config_from_hf
from ..staging import check_apart, local_output, staged_dir
from ..streaming import DEFAULT_MEMORY_BUDGET, group_limit

POINTER = "ucp-checkpoint.json"  # in a model directory: {"url": the checkpoint, "step": the step it serves}
CONFIG = "config.json"


@dataclass(frozen=True)
class Pointer:
    """The checkpoint a model directory serves (its `ucp-checkpoint.json`)."""

    url: str
    step: int

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "step": self.step}

    @classmethod
    def read(cls, model_dir: str | Path) -> Pointer:
        """The pointer of `model_dir`; refuses a file that is not exactly {"url": a non-empty string, "step": an
        integer >= 0} (nothing coerced: a step 1.9 or true, a url null, is another file than `model_dir` writes)."""
        path = Path(model_dir) / POINTER
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise InteropError(
                f"{model_dir} is not a ucp model directory (no {POINTER}): make one with `ucp export URL --to vllm "
                "DIR` or ucp.interop.vllm.model_dir(url), or name the checkpoint in model_loader_extra_config "
                '{"url": ...}'
            ) from None
        except (OSError, ValueError) as e:  # (a directory, unreadable, not UTF-8, not JSON)
            raise InteropError(f"{path} is malformed ({type(e).__name__}: {e})") from None
        url = doc.get("url") if isinstance(doc, dict) else None
        step = doc.get("step") if isinstance(doc, dict) else None
        if not isinstance(url, str) or not url or type(step) is not int or step < 0:
            raise InteropError(
                f'{path} is malformed: expected {{"url": a checkpoint\'s URL, "step": an integer >= 0}}, found '
                f"{json.dumps(doc)[:200]}; write it again with `ucp export URL --to vllm DIR`"
            )
        return cls(url, step)


# vLLM's layer-by-layer reload (a refresh) puts each layer back into its kernels' formats as soon as its weights are in,
# and a group's weights are handed over once the whole group is read. From local storage, where reading is quick and
# vLLM's work is what takes the time, the reads go in groups of a quarter of the usual size, so that vLLM starts sooner
# and little of its work is left after the last read; from an object store, whose requests take milliseconds, a
# group's end leaves the pool with few in flight until the next group starts, and large groups do better.
# Measured (bench_io inference --refresh-budgets, one run each, medians): locally 1.10 s against 1.52 at 1 GiB, 3.59
# against 4.44 at 3 GiB; from radosgw 3.35 s against 3.03 at 1 GiB (groups of 256 MiB against 1 GiB). Reading three
# groups ahead instead of one helped neither (the reads then take the cores vLLM's work needs).
LOCAL_GROUP_SPLIT = 4


@dataclass
class StepWeights:
    """A committed step opened for an inference engine: its model config, and its weights as an HF export of it
    holds them (names, dtypes as stored, config.json)."""

    reader: CheckpointReader
    url: str
    config: FamilyConfig
    plan: ExportPlan

    @property
    def step(self) -> int:
        return self.reader.step

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage so far through this step's reader (the manifest included)."""
        return int(self.reader.storage.stats.bytes_read)

    def tensors(
        self,
        regions: Mapping[str, Box] | None = None,
        *,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        names: list[str] | None = None,
        into: Mapping[str, list[tuple[Box, torch.Tensor]]] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for each weight (or each of `names`), in the stored dtype. A weight named in `regions`
        is read only in its region: its tensor has the full shape, the rest left unset. Reads go in groups of at most
        a quarter of `memory_budget` (smaller from local storage: LOCAL_GROUP_SPLIT), the next group read while the
        current one is consumed.

        `into`: weights read straight into the tensors given for them instead ({HF name: [(box, view shaped like it,
        in the stored dtype)]}: views of an engine's parameters, in host memory or on a device), not yielded; their
        reads go with the first group's (the chunks of one pack that both want are read in one request), before
        the first tensor is yielded."""
        wanted = self.plan.names if names is None else names
        regions = regions or {}
        sizes = {n: _region_bytes(self.plan, n, regions.get(n)) for n in wanted}
        limit = group_limit(memory_budget)
        if not self.reader.storage.capabilities.whole_object_reads:  # (local storage: LOCAL_GROUP_SPLIT)
            limit //= LOCAL_GROUP_SPLIT
        groups = pack(sizes, limit) or [[]]
        yield from _prefetched(
            [
                functools.partial(self._read_group, group, regions, (into or {}) if i == 0 else {})
                for i, group in enumerate(groups)
            ]
        )

    def _read_group(
        self, names: list[str], regions: Mapping[str, Box], into: Mapping[str, list[tuple[Box, torch.Tensor]]]
    ) -> dict[str, torch.Tensor]:
        """Each weight of `names` read (in its region, if named in `regions`) into a tensor of its full shape, and
        each of `into` into its places, every read at once (the chunks of one pack that several want: one request)."""
        items = [(self.plan.metas[name], box, view) for name, places in into.items() for box, view in places]
        out: dict[str, torch.Tensor] = {}
        for name in names:
            meta = self.plan.metas[name]
            box = regions.get(name, full_box(meta.shape))
            out[name] = allocate(meta)  # (pages never written are never touched: the unread part costs no memory)
            items.append((meta, box, out[name][to_slices(box)]))
        self.reader.read_regions(items)
        return out


def _region_bytes(plan: ExportPlan, name: str, box: Box | None) -> int:
    meta = plan.metas[name]
    if box is None:
        return meta.nbytes
    return math.prod(b - a for a, b in box) * meta.nbytes // max(1, math.prod(meta.shape))


def _prefetched(loads: list[Callable[[], dict[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The items of each load's result in order, the next load running in a background thread meanwhile (cancelled
    if the consumer stops before it has started)."""
    if not loads:
        return
    with cf.ThreadPoolExecutor(1, thread_name_prefix="ucp-vllm-prefetch") as pool:
        pending: cf.Future | None = pool.submit(loads[0])
        try:
            for i in range(len(loads)):
                assert pending is not None
                current = pending.result()
                pending = pool.submit(loads[i + 1]) if i + 1 < len(loads) else None
                while current:
                    yield _pop_first(current)
                del current
        finally:
            if pending is not None:
                pending.cancel()


def _pop_first(tensors: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """The first item, removed (so that a tensor handed over is held by its consumer alone)."""
    name = next(iter(tensors))
    return name, tensors.pop(name)


def open_weights(
    url: str, step: int | str | None = "latest", *, storage_options: dict[str, Any] | None = None
) -> StepWeights:
    """A committed step of `url` (a checkpoint root, or a step directory) opened for an engine: its manifest read and
    checked, its model mapped to HF names; no weight is read. Refuses a model with no HF architecture."""
    reader = open_checkpoint(url, "latest" if step is None else step, storage_options=storage_options)
    return StepWeights(reader, url, model_config_of(reader), plan_export(reader))


def served_config(hf_config: Mapping[str, Any], where: str) -> FamilyConfig:
    """ucp's model config of the HF config an engine serves (vLLM's `model_config.hf_config`, as a dict)."""
    return ucp_config_from_hf(dict(hf_config), where)[0]


def check_same_model(serving: FamilyConfig, step: StepWeights, engine: str) -> None:
    """Refuse a step of another model than the one `engine` serves (another family, shape or set of weights)."""
    if serving != step.config:
        fields = [
            f"{f.name} {getattr(serving, f.name)!r} -> {getattr(step.config, f.name)!r}"
            for f in dataclasses.fields(serving)
            if getattr(serving, f.name) != getattr(step.config, f.name)
        ]
        kind = (
            f"a {type(step.config).__name__} where it serves a {type(serving).__name__}"
            if type(serving) is not type(step.config)
            else ", ".join(fields)
        )
        raise ModelMismatchError(
            f"step {step.step} of {step.url} is another model than {engine} serves ({kind}); nothing was changed"
        )


def check_same_settings(hf_config: Any, model: str, step: StepWeights, engine: str) -> None:
    """Refuse a step whose config.json says another computation than the engine's beyond ucp's model config: the
    norms' epsilon, RoPE's settings, a router's scaling. The engine's is the config.json it started from (`model`'s,
    a local directory; else its config `hf_config`, which vLLM may have adjusted, a sliding window say). Each key the
    step's config.json names is compared as transformers reads both (by the engine config's own class, so that
    spellings such as rope_theta and rope_parameters agree), and so is a key either file names that only one reading
    has (one the class does not define)."""
    read = getattr(type(hf_config), "from_dict", None)  # (a transformers config's; without it, compared as written)
    started = Path(model) / CONFIG
    try:
        served = json.loads(started.read_text()) if started.is_file() else None
    except (OSError, ValueError):
        served = None
    try:
        theirs = read(dict(step.plan.config_json)).to_dict() if read is not None else dict(step.plan.config_json)
        ours = read(served).to_dict() if read is not None and served is not None else hf_config.to_dict()
    except Exception as e:  # noqa: BLE001 -- a config the engine's class cannot read is another model's
        raise ModelMismatchError(
            f"step {step.step} of {step.url}: its config.json does not read as {engine}'s config "
            f"({type(e).__name__}: {e}); nothing was changed"
        ) from None

    def differs(k: str) -> bool:
        if k.startswith("_") or k in FILE_KEYS:
            return False
        if k in ours and k in theirs:  # (the class's defaults fill in what one file leaves out)
            return k in step.plan.config_json and ours[k] != theirs[k]
        # a key the engine's config class does not define, which one config.json says and the other does not (a
        # Llama's `layer_types` with a sliding window, which vLLM's Llama computes with): absent is None
        return ours.get(k) != theirs.get(k)

    absent = _Absent()
    named = set(step.plan.config_json) | (set(served) if isinstance(served, dict) else set())
    differ = [f"{k} {ours.get(k, absent)!r} -> {theirs.get(k, absent)!r}" for k in sorted(named) if differs(k)]
    if differ:
        raise ModelMismatchError(
            f"step {step.step} of {step.url} is another model than {engine} serves ({', '.join(differ)[:300]}); "
            "nothing was changed"
        )


class _Absent:
    def __repr__(self) -> str:
        return "absent"


def model_dir(
    url: str,
    step: int | str | None = "latest",
    *,
    dir: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """The directory vLLM starts from (`model=` / `vllm serve DIR`) to serve step `step` of checkpoint `url` with
    `load_format="ucp"`: config.json as `ucp export --to hf` writes it, and `ucp-checkpoint.json` naming the checkpoint and the
    step (resolved now: "latest" is the newest committed step at this call). No weights are written. `dir`: where
    (must not exist, or be empty; default a new temporary directory). Returns the directory.

    Storage options (credentials) are not written down: pass them to the engine in
    `model_loader_extra_config={"storage_options": {...}}`, or through the standard AWS variables."""
    weights = open_weights(url, step, storage_options=storage_options)
    if dir is not None:
        check_apart(url, str(dir))
    target = Path(tempfile.mkdtemp(prefix="ucp-vllm-")) if dir is None else local_output(dir)
    where = url if "://" in url else os.path.abspath(url)  # (the engine may run from another directory)
    with staged_dir(target) as tmp:
        (tmp / CONFIG).write_text(json.dumps(weights.plan.config_json, indent=2) + "\n")
        (tmp / POINTER).write_text(json.dumps(Pointer(where, weights.step).to_json(), indent=2) + "\n")
    return target
