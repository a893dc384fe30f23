"""Layouts and process groups.

Rank order and the EP carve-out follow docs/LOCAL_STATE.md:

    rank = tp_rank + T * (dp_rank + D * pp_rank)
    ep_rank = dp_rank % E,  expert_dp_rank = dp_rank // E

Layouts are ucp's (`ucp.sharding.layout.Layout`, `parse_layout`): the trainer and the checkpoints share one grammar.
"""

from __future__ import annotations

import torch.distributed as dist

from ucp.sharding.layout import Layout, RankCoords, parse_layout

__all__ = ["Layout", "Mesh", "RankCoords", "coords_of", "group_partitions", "parse_layout", "rank_of"]


def coords_of(rank: int, layout: Layout) -> RankCoords:
    return layout.coords(rank)


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
        "ep": [
            [rank_of(L, t, x * L.ep + e, p) for e in range(L.ep)]
            for t in range(L.tp)
            for x in range(X)
            for p in range(L.pp)
        ],
        # Expert-DP: the replicas of one EP rank's experts.
        "expert_dp": [
            [rank_of(L, t, x * L.ep + e, p) for x in range(X)]
            for t in range(L.tp)
            for e in range(L.ep)
            for p in range(L.pp)
        ],
        # Tied embeddings across stages: the first and the last stage's copies share one gradient.
        "embedding": [[rank_of(L, t, d, 0), rank_of(L, t, d, L.pp - 1)] for t in range(L.tp) for d in range(L.dp)]
        if L.pp > 1
        else [],
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
