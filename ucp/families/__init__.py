"""Model families: each is a config dataclass plus a declarative rules table (see ``table.py``)."""

from __future__ import annotations

from typing import Any

from ucp.errors import UcpError
from ucp.families import table
from ucp.families.llama import FAMILY as LLAMA
from ucp.families.llama import LlamaConfig
from ucp.families.mixtral import FAMILY as MIXTRAL
from ucp.families.mixtral import MixtralConfig
from ucp.families.table import Family, Rule
from ucp.partition import PartitionSpec

FAMILIES: dict[str, Family] = {MIXTRAL.name: MIXTRAL, LLAMA.name: LLAMA}

__all__ = ["FAMILIES", "Family", "LlamaConfig", "MixtralConfig", "Rule", "canonical_atoms", "family_for"]


def family_for(config: Any) -> Family:
    for family in FAMILIES.values():
        if isinstance(config, family.config_cls):
            return family
    raise UcpError(f"no model family for config of type {type(config).__name__}; known: {sorted(FAMILIES)}")


def canonical_atoms(config: Any) -> dict[str, tuple[tuple[int, ...], PartitionSpec]]:
    """Every canonical atom of the model: name -> (full shape, partition spec), in the family's fixed order."""
    return table.canonical_atoms(family_for(config), config)
