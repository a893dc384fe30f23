"""Interop: ucp as the hub between other frameworks' checkpoints.

- `hf`: Hugging Face Mixtral (config.json + sharded safetensors) to and from ucp;
- `megatron`: Megatron-LM torch checkpoints (`iter_*/mp_rank_*/model_optim_rng.pt`) resharded through atoms;
- `dcp`: PyTorch Distributed Checkpoint (torch.distributed.checkpoint) to and from ucp;
- `weights`: weights-only loads into SFT / RL jobs in any layout;
- `streaming`: conversions in groups within a memory budget (the next group read while one is written);
- `cli`: the `convert`, `export` and `import` subcommands.
"""

from .errors import InteropError, SourceMismatchError

__all__ = ["InteropError", "SourceMismatchError"]
