"""vLLM's model loader for ucp checkpoints: `load_format="ucp"` (`vllm serve DIR --load-format ucp`).

vLLM picks a loader by `load_format` from its registry (`vllm.model_executor.model_loader.register_model_loader`);
`register` adds this one. It runs in every vLLM process that builds a model, so it is not left to the user's script:
vLLM calls every `vllm.general_plugins` entry point of the installed packages in each of its processes at start, and
ucp's pyproject.toml names `register` there.

The loader reads the checkpoint that the model directory's `ucp-checkpoint.json` names (`ucp.interop.vllm.source.model_dir`), or
the one `model_loader_extra_config` names: `{"url": ..., "step": ..., "storage_options": {...}, "memory_budget":
bytes, "into_parameters": true}`. vLLM's own `model.load_weights` says where each weight goes (fusing q/k/v and
gate/up, stacking experts, cutting each tensor-parallel rank's share): the weights it copies unconverted into its
parameters are read straight into them (`into_parameters`, the default; false hands every weight to `load_weights`),
the others handed to it (`ucp.interop.vllm.engine`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..errors import InteropError
from .engine import EXTRA_KEYS, Request, load_step, open_for, request_of, tensors_for

LOAD_FORMAT = "ucp"


class UcpModelLoader(BaseModelLoader):
    """Loads a vLLM model from a step of a ucp checkpoint (see the module docstring)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra: dict[str, Any] = dict(load_config.model_loader_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise InteropError(
                f"model_loader_extra_config for load_format {LOAD_FORMAT!r} has unknown keys {unknown}; it takes "
                f"{list(EXTRA_KEYS)}"
            )
        self.extra = extra

    def request(self, model_config: ModelConfig) -> Request:
        return request_of(self.extra, model_config.model)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are read from the checkpoint where it is."""

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        load_step(model, model_config, self.request(model_config))

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights vLLM's own `reload_weights` takes when given no tensors: of the step `model_config.model` names
        (after `reload_weights(weights_path=DIR)`, the model directory DIR), each worker reading its share."""
        request = self.request(model_config)
        weights = open_for(model_config, request)
        return tensors_for(model, weights, request)


def register() -> None:
    """Add `load_format="ucp"` to vLLM's loaders (ucp's `vllm.general_plugins` entry point)."""
    register_model_loader(LOAD_FORMAT)(UcpModelLoader)
