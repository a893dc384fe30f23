"""Model families: each is a config dataclass plus a declarative rules table (see ``table.py``)."""

from __future__ import annotations

from typing import Any

from ucp.errors import UcpError
from ucp.families import table
from ucp.families.deepseek import FAMILY as DEEPSEEK_V3
from ucp.families.deepseek import DeepseekV3Config
from ucp.families.llama import FAMILY as LLAMA
from ucp.families.llama import LlamaConfig
from ucp.families.mixtral import FAMILY as MIXTRAL
from ucp.families.mixtral import MixtralConfig
from ucp.families.qwen_moe import FAMILY as QWEN_MOE
from ucp.families.qwen_moe import QwenMoeConfig
from ucp.families.table import ExpertNames, Family, Rule, expert_names
from ucp.partition import PartitionSpec

FAMILIES: dict[str, Family] = {f.name: f for f in (MIXTRAL, LLAMA, QWEN_MOE, DEEPSEEK_V3)}

__all__ = [
    "FAMILIES",
    "DeepseekV3Config",
    "ExpertNames",
    "Family",
    "LlamaConfig",
    "MixtralConfig",
    "QwenMoeConfig",
    "Rule",
    "block_scales",
    "buffer_atoms",
    "canonical_atoms",
    "expert_names_of",
    "family_for",
]


def family_for(config: Any) -> Family:
    for family in FAMILIES.values():
        if isinstance(config, family.config_cls):
            return family
    raise UcpError(f"no model family for config of type {type(config).__name__}; known: {sorted(FAMILIES)}")


def canonical_atoms(config: Any) -> dict[str, tuple[tuple[int, ...], PartitionSpec]]:
    """Every canonical atom of the model: name -> (full shape, partition spec), in the family's fixed order."""
    return table.canonical_atoms(family_for(config), config)


def buffer_atoms(config: Any) -> frozenset[str]:
    """The atoms that are buffers, not parameters: no optimizer state, outside ZeRO's flat buffers."""
    return table.buffer_atoms(family_for(config), config)


def block_scales(config: Any) -> dict[str, str]:
    """The model's block-quantised weights (`ucp.quantization`): weight atom name -> its scale atom's name."""
    return table.block_scales(family_for(config), config)


def expert_names_of(config: Any) -> ExpertNames | None:
    """The atom names of the model's routers and experts (None for a dense model)."""
    return expert_names(family_for(config))
