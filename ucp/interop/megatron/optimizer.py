"""Megatron-LM's non-distributed optimizer state <-> ucp's local optimizer state (the distributed optimizer's
flat buffers: distrib_optim.py, on top of the param groups and OptimizerMeta defined here).

A torch-format rank file stores under "optimizer" what Megatron-Core's optimizer `state_dict()` returns:
- Float16OptimizerWithFloat16Params (bf16/fp16 training): `{"optimizer": <torch state_dict>,
  "fp32_from_fp16_params": [[fp32 master weight of each parameter] per param group], ["grad_scaler": ...]}`;
- FP32Optimizer: the torch state_dict itself;
- with expert parallelism, Megatron builds one optimizer for the dense and one for the expert parameters
  (a ChainedOptimizer), and the entry is the list of their two state dicts.

A torch state_dict numbers parameters instead of naming them: group by group, in the order Megatron-Core's
`_get_param_groups` put them. That order is rebuilt here from the layout alone (`param_groups`): model chunk by
chunk, each chunk's `named_parameters()` order (its module registration order, which puts `linear_proj` before
`linear_qkv`), split into Megatron's standard groups (weight decay for matrices, none for 1-D tensors; expert
parameters in an optimizer of their own only when EP > 1). Every saved group is checked against it (Megatron's
group identifier, the number of parameters, every state tensor's shape), so a file built with other groups (a
decoupled LR, custom overrides) is refused rather than mis-mapped.

Per-element states (Adam's exp_avg, exp_avg_sq) and master weights (ucp state "master") have the shape of the
rank's local parameter and reshard like it; 0-d entries (Adam's step) and group hyperparameters are global and
travel as JSON (`OptimizerMeta`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...sharding.families import FamilyConfig
from ...sharding.layout import Layout
from ...sharding.reshard import LocalParam, local_params
from ..errors import InteropError

MASTER = "master"  # ucp's optimizer-state name for fp32 master weights (Megatron's fp32_from_fp16_params)
GROUP_IDENTIFIER = (
    "wd_mult",
    "lr_mult",
    "is_expert_parallel",
    "is_decoupled_lr",
)  # Megatron's param_group_identifier_keys
GroupKey = tuple[Any, ...]
Groups = list[tuple[GroupKey, list[LocalParam]]]  # one optimizer's param groups in order

# Megatron-Core's GPTModel registers its modules in this order (its named_parameters() order, local spec; checked
# against megatron-core's own models by tests/test_megatron_order.py):
_MODEL_ORDER = ("embedding.", "decoder.layers.", "decoder.final_layernorm.", "output_layer.")
_LAYER_ORDER = (
    "input_layernorm.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",  # (SelfAttention: linear_qkv, then the q/k norms)
    "self_attention.linear_q_proj.",  # (MLASelfAttention: the projections, then the q/kv norms)
    "self_attention.linear_q_down_proj.",
    "self_attention.linear_q_up_proj.",
    "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "self_attention.kv_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.linear_fc1.",  # (a dense MLP)
    "mlp.linear_fc2.",
    "mlp.router.",  # (a MoE layer: router, routed experts, shared experts with their gate first)
    "mlp.experts.local_experts.",
    "mlp.shared_experts.gate_weight",
    "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
)
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def _position(prefixes: tuple[str, ...], name: str) -> int:
    return next(i for i, prefix in enumerate(prefixes) if name.startswith(prefix))


def registration_key(p: LocalParam) -> tuple[int, ...]:
    """Sort key of Megatron's parameter order: model chunk by chunk, then module registration order."""
    chunk = int(p.chunk_key.removeprefix("model") or 0)
    top = _position(_MODEL_ORDER, p.name)
    if _MODEL_ORDER[top] != "decoder.layers.":
        return (chunk, top)
    layer, rest = p.name.removeprefix("decoder.layers.").split(".", 1)
    expert = _EXPERT.fullmatch(rest)
    return (
        chunk,
        top,
        int(layer),
        _position(_LAYER_ORDER, rest),
        *((int(expert[1]), int(expert[2])) if expert else ()),
    )


def group_key(p: LocalParam, layout: Layout) -> GroupKey:
    """Megatron's identifier of the param group `p` falls in with the standard config overrides."""
    return _group_key(p, layout.ep > 1)


def _group_key(p: LocalParam, expert_parallel: bool) -> GroupKey:
    expert = p.zero_group == "expert" and expert_parallel  # expert parameters are not all-reduced only under EP
    return (0.0 if len(p.shape) == 1 else 1.0, 1.0, expert, False)


def param_groups(config: FamilyConfig, layout: Layout, rank: int) -> list[Groups]:
    """Per Megatron optimizer (dense, then expert when EP > 1), its param groups in Megatron's order."""
    return _grouped(local_params(config, layout, layout.coords(rank)), layout.ep > 1)


def model_param_groups(config: FamilyConfig, expert_parallel: bool) -> list[Groups]:
    """The param groups of the whole model, per optimizer of a job with (EP > 1) or without expert parallelism:
    what a torch_dist checkpoint's optimizer entry lists (each loading rank takes the groups it has)."""
    return _grouped(local_params(config, Layout(), Layout().coords(0)), expert_parallel)


def _grouped(params: list[LocalParam], expert_parallel: bool) -> list[Groups]:
    optimizers: dict[bool, dict[GroupKey, list[LocalParam]]] = {False: {}, True: {}}
    for p in sorted(params, key=registration_key):
        if not p.parameter:
            continue  # (a buffer, e.g. the router's expert bias: no gradient, no optimizer state)
        key = _group_key(p, expert_parallel)
        optimizers[key[2]].setdefault(key, []).append(p)
    # _get_param_groups sorts groups without overrides (wd_mult 1) before the overridden ones (wd_mult 0)
    return [sorted(groups.items(), key=lambda kv: -kv[0][0]) for groups in optimizers.values() if groups]


@dataclass(frozen=True)
class DistributedBuffers:
    """What places a distributed optimizer's state in its flat buffers besides the layout
    (distrib_optim): the buffers' (param dtype, grad dtype) and DDP's bucket size (None: one bucket)."""

    dtypes: tuple[str, str]
    bucket_size: int | None


@dataclass
class OptimizerMeta:
    """The global part of an optimizer entry (the same on every rank): everything but per-element tensors."""

    mixed: bool  # Float16OptimizerWithFloat16Params: fp32 master weights (ucp state MASTER)
    keys: tuple[str, ...]  # each parameter's state entries, in Megatron's order (e.g. step, exp_avg, exp_avg_sq)
    scalars: dict[str, tuple[Any, str | None]] = field(
        default_factory=dict
    )  # 0-d entries: (value, tensor dtype), one for all
    groups: dict[GroupKey, dict[str, Any]] = field(default_factory=dict)  # hyperparameters by group identifier
    grad_scaler: Any = None
    distributed: DistributedBuffers | None = None  # a distributed optimizer's buffers; None: not one

    @property
    def states(self) -> tuple[str, ...]:
        """The per-element states, as ucp optimizer-state names."""
        return tuple(k for k in self.keys if k not in self.scalars) + ((MASTER,) if self.mixed else ())

    @property
    def step(self) -> int | None:
        """The optimizer's step counter (torch Adam keeps it per parameter, TE/Apex FusedAdam per group)."""
        if "step" in self.scalars:
            return int(self.scalars["step"][0])
        steps = {g["step"] for g in self.groups.values() if "step" in g}
        return int(steps.pop()) if len(steps) == 1 else None

    def group(self, key: GroupKey) -> dict[str, Any]:
        """A group's hyperparameters; an expert group borrows its dense twin's when the source had no EP."""
        twin = (*key[:2], not key[2], *key[3:])
        found = self.groups.get(key) or self.groups.get(twin)
        if found is None:
            raise InteropError(
                f"the source optimizer has no param group {dict(zip(GROUP_IDENTIFIER, key))} to copy "
                f"hyperparameters from (it has {[dict(zip(GROUP_IDENTIFIER, k)) for k in self.groups]})"
            )
        return {**found, "is_expert_parallel": key[2]}

    def merge(self, other: OptimizerMeta, where: str) -> OptimizerMeta:
        mine, theirs = self._kind(), other._kind()
        if mine != theirs:
            raise InteropError(
                f"{where}: its optimizer state differs in kind, entries or step from the first rank's "
                f"({theirs} vs {mine})"
            )
        return replace(self, groups={**other.groups, **self.groups})

    def _kind(self) -> tuple[Any, ...]:
        return (self.mixed, self.keys, self.scalars, self.distributed)

    def to_json(self) -> dict[str, Any]:
        kind = "distributed" if self.distributed is not None else "float16" if self.mixed else "fp32"
        return {
            "kind": kind,
            **({"buffers": vars(self.distributed)} if self.distributed is not None else {}),
            "keys": list(self.keys),
            "scalars": {k: {"value": v, "dtype": d} for k, (v, d) in self.scalars.items()},
            "param_groups": list(self.groups.values()),
            "grad_scaler": self.grad_scaler,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> OptimizerMeta:
        # JSON turned tuples (Adam's betas) into lists; torch's param groups hold tuples
        groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in doc["param_groups"]]
        return cls(
            doc["kind"] in ("float16", "distributed"),
            tuple(doc["keys"]),
            {k: (s["value"], s["dtype"]) for k, s in doc["scalars"].items()},
            {identifier(g): g for g in groups},
            doc.get("grad_scaler"),
            DistributedBuffers(tuple(buffers["dtypes"]), buffers["bucket_size"])
            if (buffers := doc.get("buffers")) is not None
            else None,
        )


def identifier(group: dict[str, Any]) -> GroupKey:
    return tuple(group.get(k) for k in GROUP_IDENTIFIER)


LocalOptimState = dict[str, dict[str, dict[str, torch.Tensor]]]  # chunk key -> local name -> state -> tensor


def _unwrap(sub: Any, where: str) -> tuple[dict[str, Any], list[list[torch.Tensor]] | None, Any]:
    """(torch state_dict, master weights per group or None, grad scaler state) of one Megatron optimizer."""
    if isinstance(sub, dict) and isinstance(sub.get("optimizer"), dict):
        masters = sub.get("fp32_from_fp16_params", sub.get("fp32_from_fp16"))
        if masters is None or "state" not in sub["optimizer"]:
            raise InteropError(
                f"{where}: its 'optimizer' entry has no per-parameter state (a distributed optimizer's, which "
                f"keeps it in distrib_optim.pt, but there is none beside it)"
            )
        return sub["optimizer"], masters, sub.get("grad_scaler")
    if isinstance(sub, dict) and "state" in sub and "param_groups" in sub:
        return sub, None, None
    raise InteropError(
        f"{where}: its 'optimizer' entry is not a Megatron-Core optimizer state dict "
        f"(keys: {sorted(sub) if isinstance(sub, dict) else type(sub).__name__})"
    )


def optimizer_entries(entry: Any, expected: list[Groups], where: str) -> list[Any]:
    """A rank file's "optimizer" entry split per Megatron optimizer (ChainedOptimizer.state_dict() is a list only
    for several), checked to hold as many as Megatron-Core builds for the rank (`expected`)."""
    subs = entry if isinstance(entry, list) else [entry]
    if len(subs) != len(expected):
        raise InteropError(
            f"{where}: 'optimizer' holds {len(subs)} optimizer state dict(s), but Megatron-Core builds "
            f"{len(expected)} for this layout (dense{' and expert' if len(expected) > 1 else ''})"
        )
    return subs


def read_optimizer(
    entry: Any, config: FamilyConfig, layout: Layout, rank: int, where: str
) -> tuple[LocalOptimState, OptimizerMeta]:
    """A rank file's "optimizer" entry as ucp's local optimizer state (what goes under "optimizer"/"state") and
    its global part."""
    expected = param_groups(config, layout, rank)
    state: LocalOptimState = {}
    meta: OptimizerMeta | None = None
    for sub, groups in zip(optimizer_entries(entry, expected, where), expected):
        sub_meta = _read_one(sub, groups, state, where)
        meta = sub_meta if meta is None else meta.merge(sub_meta, where)
    assert meta is not None  # a rank has parameters, so at least one optimizer
    return state, meta


def check_param_groups(saved: list[dict[str, Any]], groups: Groups, where: str, sized: bool = True) -> None:
    """The saved param groups are Megatron-Core's standard ones for the rank (`groups`), in order, and with `sized`
    each of its size (a DistributedOptimizer's state_dict() drops the groups' parameter lists)."""
    found = [(dict(zip(GROUP_IDENTIFIER, identifier(g))), len(g["params"]) if sized else None) for g in saved]
    wanted = [(dict(zip(GROUP_IDENTIFIER, k)), len(params) if sized else None) for k, params in groups]
    if found != wanted:
        raise InteropError(
            f"{where}: optimizer param groups {found} are not Megatron-Core's standard ones for this "
            f"rank {wanted}; ucp maps only those"
        )


def check_known_groups(saved: list[dict[str, Any]], groups: Groups, where: str) -> None:
    """The param groups of a whole-model optimizer entry (torch_dist's common.pt, written by one rank: every group
    of the model with megatron-core 0.16, which aligns them over the ranks; the saving rank's own before) are each
    one of Megatron-Core's standard groups for the model (`groups`), none twice. A group split off by a decoupled LR
    or another override is refused: megatron-core 0.16 gives it the identifier of the group it splits, older ones
    is_decoupled_lr or other multipliers."""
    found = [dict(zip(GROUP_IDENTIFIER, identifier(g))) for g in saved]
    known = [dict(zip(GROUP_IDENTIFIER, k)) for k, _ in groups]
    if any(f not in known for f in found) or len({identifier(g) for g in saved}) != len(saved):
        raise InteropError(
            f"{where}: optimizer param groups {found} are not Megatron-Core's standard ones for this model "
            f"{known} (a decoupled LR or other overrides); ucp maps only those"
        )


def _read_one(sub: Any, groups: Groups, state: LocalOptimState, where: str) -> OptimizerMeta:
    """One Megatron optimizer's state dict: its parameters' tensors into `state`; returns its global part."""
    inner, masters, scaler = _unwrap(sub, where)
    saved = inner["param_groups"]
    check_param_groups(saved, groups, where)
    if masters is not None and [len(m) for m in masters] != [len(params) for _, params in groups]:
        raise InteropError(
            f"{where}: not every parameter has an fp32 master weight (fp32 and 16-bit parameters "
            f"mixed in one group); ucp carries master weights only for all or none"
        )
    meta = OptimizerMeta(
        masters is not None,
        next((tuple(s) for s in inner["state"].values()), ()),
        groups={identifier(g): {k: v for k, v in g.items() if k != "params"} for g in saved},
        grad_scaler=scaler,
    )
    for gi, (g, (_, params)) in enumerate(zip(saved, groups)):
        for j, (index, p) in enumerate(zip(g["params"], params)):
            what = f"{where}: optimizer state of {p.chunk_key}/{p.name}"
            per = _param_state(inner["state"].get(index, {}), p, meta, what)
            if masters is not None:
                per[MASTER] = _checked(masters[gi][j], p, f"{what}, master weight")
            state.setdefault(p.chunk_key, {})[p.name] = per
    return meta


def _param_state(saved: dict[str, Any], p: LocalParam, meta: OptimizerMeta, where: str) -> dict[str, torch.Tensor]:
    """One parameter's per-element states; its 0-d entries go to (and must agree with) meta.scalars."""
    if tuple(saved) != meta.keys:
        raise InteropError(f"{where} has entries {list(saved)}, the rank's first parameter {list(meta.keys)}")
    out = {}
    for k, v in saved.items():
        if (isinstance(v, torch.Tensor) and v.dim() == 0) or isinstance(v, (int, float)):
            value = (v.item(), str(v.dtype).removeprefix("torch.")) if isinstance(v, torch.Tensor) else (v, None)
            if meta.scalars.setdefault(k, value) != value:
                raise InteropError(f"{where}: {k}={value[0]} differs from another parameter's {meta.scalars[k][0]}")
        else:
            out[k] = _checked(v, p, f"{where}[{k!r}]")
    return out


def _checked(t: Any, p: LocalParam, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != p.shape:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InteropError(f"{where} is {got}, but the parameter's local shape is {list(p.shape)}")
    return t


def _scalar(value: Any, dtype: str | None) -> Any:
    """A 0-d entry back as Megatron held it: a 0-d tensor of `dtype`, or the plain number when dtype is None."""
    return value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))


def write_optimizer(
    state: LocalOptimState, meta: OptimizerMeta, config: FamilyConfig, layout: Layout, rank: int
) -> Any:
    """The "optimizer" entry of a rank file, as Megatron-Core's optimizer state_dict() for this rank returns it."""
    subs = []
    for groups in param_groups(config, layout, rank):
        inner: dict[str, Any] = {"state": {}, "param_groups": []}
        masters: list[list[torch.Tensor]] = []
        index = 0
        for key, params in groups:
            ids = list(range(index, index + len(params)))
            index += len(params)
            inner["param_groups"].append({**meta.group(key), "params": ids})
            if meta.mixed:
                masters.append([state[p.chunk_key][p.name][MASTER] for p in params])
            for i, p in zip(ids, params):
                if meta.keys:  # torch keeps no entry for a parameter without state (before the first step)
                    per = state[p.chunk_key][p.name]
                    inner["state"][i] = {
                        k: _scalar(*meta.scalars[k]) if k in meta.scalars else per[k] for k in meta.keys
                    }
        if meta.mixed:
            scaler = {"grad_scaler": meta.grad_scaler} if meta.grad_scaler is not None else {}
            subs.append({"optimizer": inner, **scaler, "fp32_from_fp16_params": masters})
        else:
            subs.append(inner)
    return subs[0] if len(subs) == 1 else subs  # ChainedOptimizer.state_dict(): a list only for several
