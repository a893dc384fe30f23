"""Layer 7, interop: ucp as the hub between other frameworks' checkpoints. May import every layer below.

- `hf`: Hugging Face safetensors (config.json + sharded safetensors, every family of docs/INTEROP.md) to and from ucp;
- `megatron/`: Megatron-LM checkpoints, torch format (`iter_*/mp_rank_*/model_optim_rng.pt`) and torch_dist,
  resharded through atoms (a folder of its own: its modules in the order docs/ARCHITECTURE.md gives);
- `dcp`: PyTorch Distributed Checkpoint (torch.distributed.checkpoint) to and from ucp;
- `weights`: weights-only loads into SFT / RL jobs in any layout;
- `streaming`: conversions in groups within a memory budget (the next group read while one is written);
- `cli`: the `convert`, `export` and `import` subcommands.
"""

from .errors import InteropError, SourceMismatchError

__all__ = ["InteropError", "SourceMismatchError"]
