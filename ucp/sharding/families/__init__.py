"""Model families: each is a config dataclass (``config.py``), a declarative rules table (``table.py``) and the names
Megatron-LM's arguments give its models (``megatron_names.py``)."""

from __future__ import annotations

from typing import Any

from ...errors import UcpError
from ..partition import PartitionSpec
from . import table
from .config import FamilyConfig
from .deepseek import FAMILY as DEEPSEEK_V3
from .deepseek import DeepseekV3Config
from .llama import FAMILY as LLAMA
from .llama import LlamaConfig
from .megatron_names import MegatronNames
from .mixtral import FAMILY as MIXTRAL
from .mixtral import MixtralConfig
from .qwen_moe import FAMILY as QWEN_MOE
from .qwen_moe import QwenMoeConfig
from .table import ExpertNames, Family, Rule, expert_names

FAMILIES: dict[str, Family] = {f.name: f for f in (MIXTRAL, LLAMA, QWEN_MOE, DEEPSEEK_V3)}

__all__ = [
    "FAMILIES",
    "DeepseekV3Config",
    "ExpertNames",
    "Family",
    "FamilyConfig",
    "LlamaConfig",
    "MegatronNames",
    "MixtralConfig",
    "QwenMoeConfig",
    "Rule",
    "block_scales",
    "buffer_atoms",
    "canonical_atoms",
    "expert_names_of",
    "family_for",
    "megatron_family",
]


def family_for(config: Any) -> Family:
    for family in FAMILIES.values():
        if isinstance(config, family.config_cls):
            return family
    raise UcpError(f"no model family for config of type {type(config).__name__}; known: {sorted(FAMILIES)}")


def megatron_family(args: Any) -> Family:
    """The family whose Megatron names claim a Megatron-LM job's args (`MegatronNames.claims`; the families' claims
    exclude each other, and a dense or MoE GPT model is always one's)."""
    claimed = [f for f in FAMILIES.values() if f.megatron is not None and f.megatron.claims(args)]
    if len(claimed) != 1:
        raise UcpError(
            f"the args describe a model of {' and of '.join(f.name for f in claimed) or 'no family'} "
            f"(known: {sorted(FAMILIES)})"
        )
    return claimed[0]


def canonical_atoms(config: FamilyConfig) -> dict[str, tuple[tuple[int, ...], PartitionSpec]]:
    """Every canonical atom of the model: name -> (full shape, partition spec), in the family's fixed order."""
    return table.canonical_atoms(family_for(config), config)


def buffer_atoms(config: FamilyConfig) -> frozenset[str]:
    """The atoms that are buffers, not parameters: no optimizer state, outside ZeRO's flat buffers."""
    return table.buffer_atoms(family_for(config), config)


def block_scales(config: FamilyConfig) -> dict[str, str]:
    """The model's block-quantised weights (`ucp.sharding.quantization`): weight atom name -> its scale atom's name."""
    return table.block_scales(family_for(config), config)


def expert_names_of(config: FamilyConfig) -> ExpertNames | None:
    """The atom names of the model's routers and experts (None for a dense model)."""
    return expert_names(family_for(config))
