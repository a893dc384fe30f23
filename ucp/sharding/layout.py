"""Parallel layouts: which rank sits where in a TP x DP x PP (x EP, ZeRO) grid.

A layout string is ``tp{T}pp{P}[vpp{V}][ep{E}][dp{D}][zero{Z}]`` (every degree 1, zero 0, when absent).
Rank order is Megatron's, tp fastest, then dp, then pp (docs/LOCAL_STATE.md):

    rank = tp_rank + T * (dp_rank + D * pp_rank)

Expert parallelism is carved out of the data-parallel dimension: ``ep_rank = dp_rank % E`` and
``expert_dp_rank = dp_rank // E``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError

GRAMMAR = "tp{T}pp{P}[vpp{V}][ep{E}][dp{D}][zero{Z}] (e.g. tp8pp4, tp2pp2ep4dp4zero1)"
_LAYOUT_RE = re.compile(r"(?:tp(\d+))?(?:pp(\d+))?(?:vpp(\d+))?(?:ep(\d+))?(?:dp(\d+))?(?:zero(\d+))?")


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one rank. ``ep``/``expert_dp`` are derived from ``dp``."""

    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int


@dataclass(frozen=True)
class Layout:
    """Degrees of a parallel layout; validated on construction."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"layout {self._raw()}: degree {name}={value!r} must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"layout {self._raw()}: zero={self.zero!r} must be 0, 1, 2 or 3")
        if self.dp % self.ep:
            raise LayoutError(f"layout {self._raw()}: ep={self.ep} must divide dp={self.dp} (EP is carved out of DP)")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"layout {self._raw()}: vpp={self.vpp} needs pp > 1")

    def _raw(self) -> str:
        """The layout as it was asked for, valid or not: its string form with every degree that is not 1."""
        extra = "".join(f"{name}{getattr(self, name)}" for name in ("vpp", "ep", "dp") if getattr(self, name) != 1)
        return f"tp{self.tp}pp{self.pp}{extra}" + (f"zero{self.zero}" if self.zero != 0 else "")

    def __str__(self) -> str:
        s = f"tp{self.tp}pp{self.pp}"
        if self.vpp > 1:
            s += f"vpp{self.vpp}"
        if self.ep > 1:
            s += f"ep{self.ep}"
        if self.dp > 1:
            s += f"dp{self.dp}"
        if self.zero:
            s += f"zero{self.zero}"
        return s

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def num_chunks(self) -> int:
        """Model chunks (PP stages times virtual stages)."""
        return self.pp * self.vpp

    @property
    def expert_dp(self) -> int:
        """Size of the expert-data-parallel group."""
        return self.dp // self.ep

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside layout {self} (world size {self.world_size})")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return RankCoords(tp=tp, dp=dp, pp=pp, ep=dp % self.ep, expert_dp=dp // self.ep)

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        for name, value, size in (("tp", tp, self.tp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name} rank {value} is outside layout {self} ({name} degree {size})")
        return tp + self.tp * (dp + self.dp * pp)

    def dp_rank_of(self, ep: int, expert_dp: int) -> int:
        """The DP rank whose EP rank is ``ep`` and expert-DP rank is ``expert_dp``."""
        return ep + self.ep * expert_dp

    # Process groups, as lists of global ranks in group-rank order.
    def tp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(t, c.dp, c.pp) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(c.tp, d, c.pp) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(c.tp, c.dp, p) for p in range(self.pp)]

    def ep_group(self, rank: int) -> list[int]:
        """Ranks that hold the other experts of this rank's layers (same expert-DP rank)."""
        c = self.coords(rank)
        return [self.rank(c.tp, self.dp_rank_of(e, c.expert_dp), c.pp) for e in range(self.ep)]

    def expert_dp_group(self, rank: int) -> list[int]:
        """Ranks that hold replicas of this rank's experts (same EP rank); ZeRO shards expert state over it."""
        c = self.coords(rank)
        return [self.rank(c.tp, self.dp_rank_of(c.ep, x), c.pp) for x in range(self.expert_dp)]


def parse_layout(s: str, world_size: int | None = None) -> Layout:
    """Parse a layout string. When ``dp`` is absent and ``world_size`` is given, dp is inferred from it."""
    if not isinstance(s, str):
        raise LayoutError(f"layout must be a string like {GRAMMAR}, got {s!r}")
    text = s.strip().lower()
    m = _LAYOUT_RE.fullmatch(text)
    if not text or m is None:
        raise LayoutError(f"malformed layout {s!r}: expected {GRAMMAR}")
    tp, pp, vpp, ep, dp, zero = (None if g is None else int(g) for g in m.groups())
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("ep", ep), ("dp", dp)):
        if value == 0:
            raise LayoutError(f"layout {s!r}: degree {name}0 must be at least 1")
    tp, pp, vpp, ep = tp or 1, pp or 1, vpp or 1, ep or 1
    if dp is None:
        dp = 1
        if world_size is not None:
            if world_size % (tp * pp):
                raise LayoutError(f"layout {s!r}: world size {world_size} is not a multiple of tp*pp = {tp * pp}")
            dp = world_size // (tp * pp)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=dp, zero=zero or 0)
    if world_size is not None and layout.world_size != world_size:
        raise LayoutError(
            f"layout {s!r} needs world size tp*pp*dp = {layout.world_size}, but the world size is {world_size}"
        )
    return layout


def chunk_layer_counts(layout: Layout, num_layers: int, stage_layers: list[int] | None = None) -> list[int]:
    """Layers per model chunk c = v*P + p (virtual chunk v of stage p), in chunk order."""
    n = layout.num_chunks
    if stage_layers is not None:
        counts = [int(x) for x in stage_layers]
        if len(counts) != n:
            raise LayoutError(
                f"stage_layers has {len(counts)} entries but layout {layout} has pp*vpp = {n} model chunks"
            )
        if any(x < 1 for x in counts):
            raise LayoutError(f"stage_layers {counts}: every model chunk needs at least one layer")
        if sum(counts) != num_layers:
            raise LayoutError(f"stage_layers {counts} sum to {sum(counts)}, but the model has {num_layers} layers")
        return counts
    if n > num_layers:
        raise LayoutError(f"layout {layout} has pp*vpp = {n} model chunks but the model has only {num_layers} layers")
    if num_layers % n:
        raise LayoutError(
            f"{num_layers} layers do not split evenly over pp*vpp = {n} model chunks of layout {layout}; "
            "choose a pp*vpp that divides the layers, or, through the API, give the model config's stage_layers "
            "(layers per model chunk; the command line converts to even splits only)"
        )
    return [num_layers // n] * n


def validate_for_model(layout: Layout, model_config: Any) -> None:
    """Raise LayoutError when ``layout`` cannot hold the model.

    Uses the attributes every family config has: num_attention_heads, num_key_value_heads (TP divides them or is a
    multiple of them, as megatron-core requires), intermediate_size (or
    moe_intermediate_size, the experts' FFN size, where the family has one), num_hidden_layers, and optionally
    num_local_experts (0/absent: dense) and stage_layers.
    """
    cfg = model_config
    ffn = ("moe_intermediate_size", cfg.moe_intermediate_size) if hasattr(cfg, "moe_intermediate_size") else None
    for what, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ffn or ("intermediate_size", cfg.intermediate_size),
    ):
        if value % layout.tp:
            raise LayoutError(f"layout {layout}: tp={layout.tp} does not divide {what}={value}")
    kv = cfg.num_key_value_heads  # (fewer KV heads than TP ranks: ranks share a query group, as in megatron-core)
    if kv % layout.tp and layout.tp % kv:
        raise LayoutError(
            f"layout {layout}: tp={layout.tp} neither divides nor is a multiple of num_key_value_heads={kv}"
        )
    experts = getattr(cfg, "num_local_experts", 0) or 0
    if experts and experts % layout.ep:
        raise LayoutError(f"layout {layout}: ep={layout.ep} does not divide num_local_experts={experts}")
    if not experts and layout.ep > 1:
        raise LayoutError(f"layout {layout}: ep={layout.ep} but the model has no experts")
    chunk_layer_counts(layout, cfg.num_hidden_layers, getattr(cfg, "stage_layers", None))
