"""Layer 5, sharding: pure functions from a model and a layout to who holds what.

`layout` (layout strings, rank order), `partition` (partition specs: TP splits, fused QKV and gate/up, vocab
padding, experts), `quantization` (block-quantised weights and their scales), `families` (model families as tables,
and the names Megatron-LM's args give them), `reshard` (which rank holds which box of which atom). No IO; may
import the layers below.
"""
