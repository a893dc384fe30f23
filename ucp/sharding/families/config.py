"""What every model family's config shares: the class each family's config dataclass inherits, which names the
fields every family has (a model's shape as the decoder, the vocabulary and the pipeline stages see it)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

from ...errors import UcpError


class FamilyConfig:
    """What every family's config dataclass shares (it inherits this): head_dim derived when absent, the GQA check,
    stage_layers as ints, and JSON both ways (unknown fields refused)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # (every family's config is a dataclass)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None
    tie_word_embeddings: bool
    make_vocab_size_divisible_by: int
    num_local_experts: int  # routed experts per MoE layer (a dense family's config says 0)
    stage_layers: list[int] | None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise UcpError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UcpError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.stage_layers is not None:
            self.stage_layers = [int(x) for x in self.stage_layers]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UcpError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**d)
