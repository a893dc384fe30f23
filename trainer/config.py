"""Training configuration: YAML files loaded into dataclasses, with dotted command-line overrides.

A config file has five sections (model, optim, data, train, checkpoint) whose keys are the fields below. Any key can be
overridden from the command line with ``--set section.key=value`` (the value is parsed as YAML, so
``--set model.tie_word_embeddings=true`` gives a bool and ``--set optim.lr=1e-3`` a float).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

FAMILIES = ("mixtral", "llama")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.precision: the parameters' dtype
DEVICES = ("auto", "cpu", "cuda")  # train.device
BACKENDS = ("auto", "nccl", "gloo")  # train.backend


@dataclass
class ModelConfig:
    """Model hyper-parameters, with the meaning (and defaults) of transformers' MixtralConfig. `family` picks the
    MLP: "mixtral", a routed mixture of experts, or "llama", one dense SwiGLU MLP (the expert fields unused)."""

    family: str = "mixtral"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # hidden_size // num_heads when None
    ffn_hidden_size: int = 128  # per expert (Mixtral's intermediate_size), or the dense MLP's (Llama's)
    num_experts: int = 8
    top_k: int = 2
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.01
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # vocab padding, see docs/LOCAL_STATE.md

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            _at_least(getattr(self, name), 1, f"model.{name}")
        _at_least(self.make_vocab_size_divisible_by, 1, "model.make_vocab_size_divisible_by")
        if self.head_dim is not None:
            _at_least(self.head_dim, 1, "model.head_dim")
        elif self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}: "
                "give model.head_dim"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.is_moe:
            _at_least(self.num_experts, 1, "model.num_experts")
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"model.top_k must be 1 to model.num_experts={self.num_experts}, got {self.top_k}")
        if not self.rms_norm_eps > 0 or not self.init_std > 0 or not self.rope_theta > 0:
            raise ValueError("model.rms_norm_eps, model.init_std and model.rope_theta must be above 0")

    @property
    def is_moe(self) -> bool:
        return self.family == "mixtral"

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr at decay_steps (independent of where a run stops)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    decay_steps: int = 100
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only, not to norm weights
    grad_clip: float = 1.0  # global gradient-norm clipping; 0 disables

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:  # (NaN too)
                raise ValueError(f"optim.{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        _at_least(self.warmup_steps, 0, "optim.warmup_steps")
        _at_least(self.decay_steps, 1, "optim.decay_steps")


@dataclass
class DataConfig:
    # "pretrain": dataloaders.PretrainLoader over `path` (a prepared dataset URL; None: the built-in corpus of
    # trainer/corpus.py, prepared on first use); "synthetic": the stream of trainer/data.py (no files).
    source: str = "pretrain"
    path: str | None = None
    seq_len: int = 32
    global_batch_size: int = 8  # samples per optimizer step, over all DP ranks
    micro_batch_size: int = 1  # samples per forward/backward pass
    # the pretrain loader's order (dataloaders.PretrainLoader's `shuffle`): "windows" reads each rank's samples
    # from a few neighbouring byte ranges; "global" is the exact uniform shuffle (what runs saved before the
    # windowed order existed resume in); "none" the corpus's own order
    shuffle: str = "windows"

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch_size", "micro_batch_size"):
            _at_least(getattr(self, name), 1, f"data.{name}")


@dataclass
class TrainConfig:
    # One layout, or a comma-separated list: the run takes the first whose world size is the number of processes
    # it was started with (under torchrun's elastic agent, a job that shrinks or grows restarts in another one).
    layout: str = "tp1pp1"
    # "fp32", or "bf16": bf16 parameters and activations, with fp32 master weights, Adam states, gradient
    # accumulation, loss and gradient norm (as Megatron's --bf16 with its distributed optimizer).
    precision: str = "fp32"
    steps: int = 10  # the step to stop at (steps are numbered from 1)
    seed: int = 1234
    # Layers per model chunk (per pipeline stage, or P*V counts with virtual stages, chunk v*P + p being stage p's
    # v-th), e.g. [1, 3]; None splits evenly (an error when the split is uneven).
    stage_layers: list[int] | None = None
    metrics_file: str | None = None
    log_every: int = 1
    # Collectives that wait longer than this fail (torch's default is 30 minutes): a hung peer ends the run in
    # seconds, so an elastic agent can restart it. A dead peer (its connections reset) fails them at once.
    collective_timeout_s: float = 60.0
    # HOST:PORT of a store that outlives any node the job can lose (torchrun's --rdzv-endpoint): after a lost peer
    # the survivors re-form the job in place instead of exiting for a restart (trainer/regroup.py). None: exit.
    regroup_store: str | None = None
    # Where each rank trains and what carries its collectives (trainer/train.py `placement`). "auto": a GPU of its own
    # (LOCAL_RANK's) with NCCL where the node has one per local rank, else the CPU with gloo. backend "gloo" on a GPU
    # machine: CUDA tensors whose collectives go through host memory, so that several ranks can share one GPU (any
    # TP/PP/EP layout on a one-GPU machine); device "cpu": train on the CPU even where there are GPUs.
    device: str = "auto"
    backend: str = "auto"
    # torch.use_deterministic_algorithms: GPU runs repeat bit for bit (CPU runs do anyway), at some cost in speed
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"train.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        _at_least(self.steps, 1, "train.steps")
        _at_least(self.log_every, 1, "train.log_every")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"train.collective_timeout_s must be above 0, got {self.collective_timeout_s}")
        if self.stage_layers is not None:
            for count in self.stage_layers:
                _at_least(count, 1, "each of train.stage_layers")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]


@dataclass
class CheckpointConfig:
    url: str | None = None  # any fsspec URL (a local directory, s3://...); None: no checkpoints, no resume
    interval: int = 0  # save every `interval` steps (0: only the last step); the last step is always saved
    mode: str = "async"  # ucp.CheckpointManager mode: "sync", "async" (snapshot, then write behind) or "lazy"
    keep_last: int | None = None  # committed steps to keep at the URL (None: all)
    # A hot tier in node-local storage (e.g. a directory in /dev/shm; every node passes its own): saves commit there
    # first, with a replica on the next node, and every `durable_every`-th is drained to `url`; a restart reads
    # from the surviving nodes' memory. `local_keep`: hot steps each node keeps.
    local: str | None = None
    local_keep: int = 2
    durable_every: int = 1

    def __post_init__(self) -> None:
        _at_least(self.interval, 0, "checkpoint.interval")
        _at_least(self.local_keep, 1, "checkpoint.local_keep")
        _at_least(self.durable_every, 1, "checkpoint.durable_every")
        if self.keep_last is not None:
            _at_least(self.keep_last, 1, "checkpoint.keep_last")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _at_least(value: int, low: int, where: str) -> None:
    if value < low:
        raise ValueError(f"{where} must be at least {low}, got {value}")


# What each annotation (a string: `from __future__ import annotations`) accepts, checked before a dataclass is built,
# so that `--set model.hidden_size=abc` is refused by name rather than failing deep in torch.
_KINDS: dict[str, tuple[str, Any]] = {
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[int]": (
        "a list of whole numbers",
        lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    ),
}


def _check_kind(value: Any, annotation: str, where: str) -> None:
    kind, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    if kind not in _KINDS or (optional and value is None):
        return
    description, accepts = _KINDS[kind]
    if not accepts(value):
        raise ValueError(f"{where} must be {description}{' (or null)' if optional else ''}, got {value!r}")


def _number(value: Any, where: str) -> Any:
    """A float field's value given as a string, as the number it spells: PyYAML reads YAML 1.1, whose floats need a
    dot, so `1e-3` (in a file or `--set optim.lr=1e-3`) comes as the string "1e-3"."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"unknown config key(s) in {where}: {sorted(unknown)}; known: {sorted(fields)}")
    # annotations are strings here (`from __future__ import annotations`)
    floats = {name for name, f in fields.items() if f.type in ("float", "float | None")}
    values = {k: _number(v, f"{where}.{k}") if k in floats else v for k, v in values.items()}
    for k, v in values.items():
        _check_kind(v, str(fields[k].type), f"{where}.{k}")
    return cls(**values)


def config_from_dict(raw: dict[str, Any]) -> Config:
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = set(raw) - set(sections)
    if unknown:
        raise ValueError(f"unknown config section(s): {sorted(unknown)}; known: {sorted(sections)}")
    classes = {
        "model": ModelConfig,
        "optim": OptimConfig,
        "data": DataConfig,
        "train": TrainConfig,
        "checkpoint": CheckpointConfig,
    }
    return Config(**{name: _build(cls, raw.get(name) or {}, name) for name, cls in classes.items()})


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.key=value`` override to a raw config dict; the value is parsed as YAML."""
    key, sep, value = assignment.partition("=")
    if not sep or "." not in key:
        raise ValueError(f"override must look like section.key=value, got {assignment!r}")
    section, name = key.split(".", 1)
    raw.setdefault(section, {})
    if raw[section] is None:
        raw[section] = {}
    raw[section][name] = yaml.safe_load(value)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read the config {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"the config {path} is not YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"the config {path} must map sections to settings, not hold a {type(raw).__name__}")
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw)
