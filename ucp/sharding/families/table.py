"""The machinery behind a model family: a declarative table of rules, one per canonical atom pattern.

Another model family is a new table, not new machinery: a rule names the canonical atom (Hugging Face
naming, with ``{L}`` for the global layer and ``{X}`` for the global expert), the local Megatron-Core tensor it
lives in (``{i}`` local layer, ``{e}`` local expert; rules that name the same local tensor are fused, in
table order), where it is placed, its shape and its partition spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...format.manifest import scale_shape
from ..partition import PartitionSpec
from ..quantization import scale_name
from .config import FamilyConfig
from .megatron_names import MegatronNames

PLACES = ("first", "layer", "expert", "last")


def _always(config: Any) -> bool:
    return True


def _every_layer(config: Any, layer: int) -> bool:
    return True


# Partition spec builders the families' tables share (a rule's `spec` is called with the family config).


def vocab_spec(c: Any) -> PartitionSpec:
    return PartitionSpec("vocab", pad_to_multiple_of=c.make_vocab_size_divisible_by, unpadded=c.vocab_size)


def embedding_spec(c: Any) -> PartitionSpec:
    return dataclasses.replace(vocab_spec(c), tied_to=("lm_head.weight",) if c.tie_word_embeddings else ())


def qkv_spec(part: str) -> Callable[[Any], PartitionSpec]:
    def spec(c: Any) -> PartitionSpec:
        return PartitionSpec(
            "fused_qkv",
            part=part,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
        )

    return spec


def replicated(c: Any) -> PartitionSpec:
    return PartitionSpec()


def row_split(c: Any) -> PartitionSpec:
    return PartitionSpec("split", split_dim=1)


def column_split(c: Any) -> PartitionSpec:
    return PartitionSpec("split", split_dim=0)


def gate_up_spec(part: str) -> Callable[[Any], PartitionSpec]:
    def spec(c: Any) -> PartitionSpec:
        return PartitionSpec("fused_gate_up", part=part)

    return spec


@dataclass(frozen=True)
class Rule:
    canonical: str  # canonical atom name pattern ({L}, {X})
    local: str  # local tensor name pattern ({i}, {e})
    place: str  # "first" (first model chunk), "layer", "expert" (per expert of a layer), "last" (last chunk)
    shape: Callable[[Any], tuple[int, ...]]
    spec: Callable[[Any], PartitionSpec]  # layer, expert, zero_group are filled in by place
    present: Callable[[Any], bool] = _always
    tied_copy: bool = False  # a local copy of the atom ``canonical`` names (tied weights); no atom of its own
    # Layer and expert rules: the layers that have this tensor (e.g. DeepSeek-V3's first dense layers, then MoE ones)
    in_layer: Callable[[Any, int], bool] = _every_layer
    # False: Megatron holds the tensor as a buffer, not a parameter (no optimizer state there): the router's expert bias
    parameter: bool = True
    # A block-quantised weight's scales (`block_scaled`): the canonical pattern of the weight they scale
    scales_of: str | None = None

    def __post_init__(self) -> None:
        if self.place not in PLACES:
            raise ValueError(f"rule {self.canonical}: place {self.place!r} not in {PLACES}")


def block_size(config: FamilyConfig) -> tuple[int, int] | None:
    """The block size of a model whose linear weights are block-quantised (its config's `weight_block_size`), or
    None: weights as they are."""
    block = getattr(config, "weight_block_size", None)
    return None if block is None else (block[0], block[1])


def block_scaled(rules: tuple[Rule, ...], quantised: Callable[[Rule], bool]) -> tuple[Rule, ...]:
    """`rules` for a family whose config may say its linear weights are block-quantised (`block_size`): each rule
    that `quantised` picks is followed by the rule of its scales, present when the config is quantised, and its
    spec then carries the block (TP splits must fall on block edges, `ucp.sharding.partition`). The scales take the weight's
    partition kind, layers and local name + `_scale_inv` (so fused weights' scales are fused alike: a rank's gate
    scales, then its up scales); they are not trained (no optimizer state, outside ZeRO's buffers)."""
    out: list[Rule] = []
    for rule in rules:
        if not quantised(rule):
            out.append(rule)
            continue
        weight, present = rule, rule.present

        def spec(c: Any, weight: Rule = weight) -> PartitionSpec:
            block = block_size(c)
            return weight.spec(c) if block is None else dataclasses.replace(weight.spec(c), block=block)

        def shape(c: Any, weight: Rule = weight) -> tuple[int, ...]:
            block = block_size(c)
            assert block is not None  # (present only then)
            return scale_shape(weight.shape(c), block)

        def scaled(c: Any, present: Callable[[Any], bool] = present) -> bool:
            return present(c) and block_size(c) is not None

        out.append(dataclasses.replace(rule, spec=spec))
        out.append(
            Rule(
                scale_name(rule.canonical),
                scale_name(rule.local),
                rule.place,
                shape,
                rule.spec,
                present=scaled,
                in_layer=rule.in_layer,
                parameter=False,
                scales_of=rule.canonical,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type[FamilyConfig]
    rules: tuple[Rule, ...]
    megatron: MegatronNames[Any] | None = None  # how Megatron-LM's args name its models (None: they do not)

    def rules_at(self, place: str, config: FamilyConfig) -> list[Rule]:
        return [r for r in self.rules if r.place == place and r.present(config)]


def atom_name(rule: Rule, layer: int | None = None, expert: int | None = None) -> str:
    return rule.canonical.format(L=layer, X=expert)


def local_name(rule: Rule, layer: int | None = None, expert: int | None = None) -> str:
    return rule.local.format(i=layer, e=expert)


def atom_spec(rule: Rule, config: FamilyConfig, layer: int | None = None, expert: int | None = None) -> PartitionSpec:
    spec = rule.spec(config)
    return dataclasses.replace(
        spec, layer=layer, expert=expert, zero_group="expert" if rule.place == "expert" else "dense"
    )


def _rule_atoms(family: Family, config: FamilyConfig) -> Iterator[tuple[Rule, int | None, int | None]]:
    """(rule, layer, expert) of every atom, in the fixed canonical order (`iter_atoms`)."""
    for rule in family.rules_at("first", config):
        if not rule.tied_copy:
            yield rule, None, None
    layer_rules = [r for r in family.rules_at("layer", config) if not r.tied_copy]
    expert_rules = [r for r in family.rules_at("expert", config) if not r.tied_copy]
    for layer in range(config.num_hidden_layers):
        for rule in layer_rules:
            if rule.in_layer(config, layer):
                yield rule, layer, None
        in_layer = [r for r in expert_rules if r.in_layer(config, layer)]
        experts = config.num_local_experts if in_layer else 0
        for expert in range(experts):
            for rule in in_layer:
                yield rule, layer, expert
    for rule in family.rules_at("last", config):
        if not rule.tied_copy:
            yield rule, None, None


def iter_atoms(family: Family, config: FamilyConfig) -> Iterator[tuple[str, tuple[int, ...], PartitionSpec, str]]:
    """(name, shape, spec, place) of every atom, in the fixed canonical order: first-chunk atoms; then layer
    by layer, the layer's atoms followed by its experts' atoms expert by expert; then last-chunk atoms.
    Tied copies have no atom of their own."""
    for rule, layer, expert in _rule_atoms(family, config):
        yield (
            atom_name(rule, layer, expert),
            tuple(rule.shape(config)),
            atom_spec(rule, config, layer, expert),
            rule.place,
        )


def buffer_atoms(family: Family, config: FamilyConfig) -> frozenset[str]:
    """The atoms that are buffers, not parameters (`Rule.parameter`): no optimizer state, outside ZeRO's buffers."""
    return frozenset(atom_name(r, layer, x) for r, layer, x in _rule_atoms(family, config) if not r.parameter)


def block_scales(family: Family, config: FamilyConfig) -> dict[str, str]:
    """The block-quantised weights of the model and their scales: weight atom name -> scale atom name (empty for a
    model whose weights are not quantised)."""
    return {
        r.scales_of.format(L=layer, X=x): atom_name(r, layer, x)
        for r, layer, x in _rule_atoms(family, config)
        if r.scales_of is not None
    }


def canonical_atoms(family: Family, config: FamilyConfig) -> dict[str, tuple[tuple[int, ...], PartitionSpec]]:
    """Every atom of the model: name -> (full shape, partition spec), in the order of ``iter_atoms``."""
    return {name: (shape, spec) for name, shape, spec, _ in iter_atoms(family, config)}


@dataclass(frozen=True)
class ExpertNames:
    """A MoE family's atom names for a layer's router and each expert's gate, up and down projections (patterns
    with {L} and {X}), read off its rules. They say how transformers' in-memory fused experts map to atoms:
    `mlp.experts.gate_up_proj` [experts, 2*ffn, hidden] is, per expert, [gate; up], `down_proj` [experts, hidden,
    ffn] is down, and the router is `mlp.gate.weight`."""

    router: str
    gate: str
    up: str
    down: str

    def router_atom(self, layer: int | str) -> str:
        return self.router.format(L=layer)

    def gate_up_atoms(self, layer: int | str, experts: int) -> tuple[str, ...]:
        """gate, up of expert 0, gate, up of expert 1, ..."""
        return tuple(p.format(L=layer, X=x) for x in range(experts) for p in (self.gate, self.up))

    def down_atoms(self, layer: int | str, experts: int) -> tuple[str, ...]:
        return tuple(self.down.format(L=layer, X=x) for x in range(experts))


def expert_names(family: Family) -> ExpertNames | None:
    """The family's ExpertNames (None for a dense family): the router is the rule held in Megatron's
    mlp.router, gate and up the expert rules fused in linear_fc1 (in that order), down the one in linear_fc2."""
    experts = [r for r in family.rules if r.place == "expert"]
    if not experts:
        return None
    fc1 = [r.canonical for r in experts if r.local.endswith("linear_fc1.weight")]
    down = next(r.canonical for r in experts if r.local.endswith("linear_fc2.weight"))
    router = next(r.canonical for r in family.rules if r.local.endswith("mlp.router.weight"))
    return ExpertNames(router, fc1[0], fc1[1], down)
