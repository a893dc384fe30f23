"""Parallelism of the reference trainer, one module per dimension.

mesh      the layout string, rank coordinates and the process groups
tensor    Megatron tensor parallelism: column/row linears, vocab-parallel embedding and cross-entropy
expert    expert parallelism: token dispatch/combine with all-to-all
pipeline  stage split and the 1F1B schedule
data      data parallelism: gradient sync, global grad-norm clipping, AdamW with ZeRO-1 flat buffers
collectives  the collectives on every backend and device (host copies for gloo with CUDA tensors)
"""
