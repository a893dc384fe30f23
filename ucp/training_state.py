"""Turn a module, an optimizer and the RNGs into a savable state (and back).

The state is plain: parameters and buffers by name under "model"; every per-parameter optimizer state
tensor under "optimizer/state/<parameter name>/<state name>", whatever the optimizer keeps; param_groups as
JSON with parameter names instead of indices; RNG states under "rng" (torch generators as uint8 atoms,
Python's and NumPy's as JSON).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import StateError


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own index order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in name_of:
                raise StateError("the optimizer holds a parameter that is not in the model")
            names.append(name_of[id(p)])
    return names


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _param_names(model, optimizer)
    sd = optimizer.state_dict()
    state = {names[i]: dict(s) for i, s in sd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    names = _param_names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    missing = set(saved["state"]) - set(index)
    if missing:
        raise StateError(f"the checkpoint has optimizer state for parameters the model lacks: {sorted(missing)[:5]}")
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(saved["param_groups"]):
        raise StateError(f"the optimizer has {len(current)} param groups, the checkpoint {len(saved['param_groups'])}")
    groups = []
    for now, old in zip(current, saved["param_groups"]):
        group = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in old.items() if k != "params"}
        group["params"] = [index[n] for n in old["params"]]
        groups.append(group)
    state = {index[n]: _host_steps(s) for n, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _host_steps(state: Any) -> Any:
    """A parameter's optimizer state with its step counter in host memory, where torch's optimizers keep it (a
    state loaded onto a GPU would otherwise keep it there: `load_state_dict` moves it to the parameter's device only
    for a capturable or fused optimizer, which wants it there)."""
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
        return {**state, "step": step.cpu()}
    return state


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    np_state: Any = np.random.get_state(legacy=True)  # (the legacy tuple: name, keys, pos, has_gauss, gauss)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt), "gauss_next": gauss},
        "numpy": {
            "name": np_name,
            "keys": np_keys.tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # (a process that never used CUDA: asking would
        # initialise it, and a CPU job on a GPU machine would then page-lock its staging memory on a GPU's context)
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the RNGs from `rng_state()`'s state, as loaded (its generator states on any device)."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        # (the devices of this machine that the saving one had too: a job saved on 8 GPUs resumes on fewer)
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([state["cuda"][str(i)].cpu() for i in range(devices)])


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state to save for a training job: model, optimizer, RNGs, and any extra JSON/tensors."""
    state: dict[str, Any] = {"model": dict(model.state_dict())}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(model, optimizer)
    if rng:
        state["rng"] = rng_state()
    state.update(extra or {})
    return state


def restore_training_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
) -> None:
    """Fill `model` (and `optimizer`, RNGs) from a state that `training_state` produced and ucp loaded, in host
    memory or on any device (`ucp.load(url, device="cuda")`), into a model on any device."""
    model.load_state_dict(state["model"])
    if optimizer is not None:
        load_optimizer_state(model, optimizer, state["optimizer"])
    if rng and "rng" in state:
        set_rng_state(state["rng"])
