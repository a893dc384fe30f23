"""Layer 6, distributed: parallel save and load, where every rank writes the chunks it owns and reads only what its
layout needs. May import the layers below: base, format, storage, protocol, engine, sharding.

Planning is local: each rank derives what it writes and reads from (model config, layout, rank) alone
(`ucp.sharding.reshard`), so no rank gathers another's plan. Coordination is the attempt id (broadcast), one fragment
exchange (only where ZeRO ranges cut a chunk), and the end of the save attempt (`ucp.protocol.session`): the size and
checksum of every object written go to rank 0, which commits once every rank's data is durable.

Collectives go through a small `Comm` interface (`ucp.protocol.comm`): `TorchComm` runs over torch.distributed (gloo;
checkpoint traffic is host memory even when training runs on NCCL); `VirtualWorld` runs every rank of a layout
in one process (for tests, offline tools and benchmarks).

The parts live in modules of their own: `ucp.distributed.sharded_model` (the model and its atoms),
`ucp.distributed.sharded_save`, `ucp.distributed.read_plan` (what a rank's load reads, as data),
`ucp.distributed.sharded_load`, `ucp.distributed.shared_manifest` (a step's manifest read once for all ranks); this module names them together, as the README and callers import them. The hot
tier, `ucp.distributed.tiers`, is imported by its own name.
"""

from __future__ import annotations

from ..protocol.comm import Comm, LocalComm, TorchComm
from ..sharding.reshard import local_tensor, piece_view
from .read_plan import ReadPlan, plan_paths, plan_reads
from .sharded_load import LoadReport, load_sharded, needed_objects, piece_reads, run_plan
from .sharded_model import (
    AtomKey,
    ShardedModel,
    atom_metas,
    atom_path,
    check_atom,
    extra_state,
    model_config_of,
    with_layout,
)
from .sharded_save import RankSaver, VirtualWorld, manifest_for, plan_sharded_save, save_sharded
from .shared_manifest import open_shared

__all__ = [
    "AtomKey",
    "Comm",
    "LoadReport",
    "LocalComm",
    "RankSaver",
    "ReadPlan",
    "ShardedModel",
    "TorchComm",
    "VirtualWorld",
    "atom_metas",
    "atom_path",
    "check_atom",
    "extra_state",
    "load_sharded",
    "local_tensor",
    "manifest_for",
    "model_config_of",
    "needed_objects",
    "open_shared",
    "piece_reads",
    "piece_view",
    "plan_paths",
    "plan_reads",
    "plan_sharded_save",
    "run_plan",
    "save_sharded",
    "with_layout",
]
