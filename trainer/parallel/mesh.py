"""Layouts and process groups.

Rank order and the EP carve-out follow docs/LOCAL_STATE.md:

    rank = tp_rank + T * (dp_rank + D * pp_rank)
    ep_rank = dp_rank % E,  expert_dp_rank = dp_rank // E

The parser is the trainer's own, so that training does not import all of ucp (zarr, fsspec); it accepts the
grammar of LOCAL_STATE.md, and tests/test_trainer.py checks it against ucp.layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist

_LAYOUT_RE = re.compile(r"tp(\d+)pp(\d+)(?:vpp(\d+))?(?:ep(\d+))?(?:dp(\d+))?(?:zero(\d+))?")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    zero: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        text = f"tp{self.tp}pp{self.pp}"
        for name, value, default in (("vpp", self.vpp, 1), ("ep", self.ep, 1), ("dp", self.dp, 1),
                                     ("zero", self.zero, 0)):
            if value != default:
                text += f"{name}{value}"
        return text


def parse_layout(text: str) -> Layout:
    match = _LAYOUT_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"bad layout {text!r}: expected tp{{T}}pp{{P}}[vpp{{V}}][ep{{E}}][dp{{D}}][zero{{Z}}]")
    tp, pp, vpp, ep, dp, zero = (int(g) if g is not None else None for g in match.groups())
    layout = Layout(tp=tp, pp=pp, vpp=vpp or 1, ep=ep or 1, dp=dp or 1, zero=zero or 0)
    if min(layout.tp, layout.pp, layout.vpp, layout.ep, layout.dp) < 1:
        raise ValueError(f"bad layout {text!r}: degrees must be >= 1")
    if layout.dp % layout.ep:
        raise ValueError(f"bad layout {text!r}: ep={layout.ep} must divide dp={layout.dp}")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"bad layout {text!r}: zero must be 0..3")
    return layout


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in a layout."""

    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int


def coords_of(rank: int, layout: Layout) -> Coords:
    tp = rank % layout.tp
    dp = (rank // layout.tp) % layout.dp
    pp = rank // (layout.tp * layout.dp)
    return Coords(tp=tp, dp=dp, pp=pp, ep=dp % layout.ep, expert_dp=dp // layout.ep)


def rank_of(layout: Layout, tp: int, dp: int, pp: int) -> int:
    return tp + layout.tp * (dp + layout.dp * pp)


def group_partitions(layout: Layout) -> dict[str, list[list[int]]]:
    """Every process group of a layout, by kind, as lists of global ranks in group-rank order."""
    L = layout
    X = L.dp // L.ep  # expert-data-parallel degree
    return {
        "tp": [[rank_of(L, t, d, p) for t in range(L.tp)] for d in range(L.dp) for p in range(L.pp)],
        "dp": [[rank_of(L, t, d, p) for d in range(L.dp)] for t in range(L.tp) for p in range(L.pp)],
        "pp": [[rank_of(L, t, d, p) for p in range(L.pp)] for t in range(L.tp) for d in range(L.dp)],
        # EP: the ranks of one expert-DP index (dp = x*E + e) that hold the other experts.
        "ep": [[rank_of(L, t, x * L.ep + e, p) for e in range(L.ep)]
               for t in range(L.tp) for x in range(X) for p in range(L.pp)],
        # Expert-DP: the replicas of one EP rank's experts.
        "expert_dp": [[rank_of(L, t, x * L.ep + e, p) for x in range(X)]
                      for t in range(L.tp) for e in range(L.ep) for p in range(L.pp)],
        # Tied embeddings across stages: the first and the last stage's copies share one gradient.
        "embedding": [[rank_of(L, t, d, 0), rank_of(L, t, d, L.pp - 1)] for t in range(L.tp) for d in range(L.dp)]
        if L.pp > 1 else [],
    }


class Mesh:
    """This rank's coordinates and its process groups (every rank creates every group, in the same order)."""

    def __init__(self, layout: Layout, rank: int):
        self.layout = layout
        self.rank = rank
        self.coords = coords_of(rank, layout)
        groups = {kind: self._make(partition) for kind, partition in group_partitions(layout).items()}
        self.tp_group, self.dp_group, self.pp_group = groups["tp"], groups["dp"], groups["pp"]
        self.ep_group, self.expert_dp_group = groups["ep"], groups["expert_dp"]
        self.embedding_group = groups["embedding"]
        # Global ranks of this rank's pipeline neighbours (None at the ends).
        c, L = self.coords, layout
        self.prev_stage_rank = rank_of(L, c.tp, c.dp, c.pp - 1) if c.pp > 0 else None
        self.next_stage_rank = rank_of(L, c.tp, c.dp, c.pp + 1) if c.pp < L.pp - 1 else None

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    def _make(self, partition: list[list[int]]) -> dist.ProcessGroup | None:
        """Create one group per member list and return the one holding this rank (None for a group of one)."""
        mine = None
        for members in partition:
            group = dist.new_group(members) if len(members) > 1 else None
            if self.rank in members:
                mine = group
        return mine


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)
