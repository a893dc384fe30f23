"""Megatron-LM checkpoints, the torch format (`iter_*/mp_rank_*/model_optim_rng.pt`) and torch_dist, resharded
through atoms and converted to and from ucp. Part of layer 7 (interop): may import every layer below and interop's
shared modules (`errors`, `dtypes`, `staging`, `streaming`, `torch_file`, `dcp`, `hf`).

One concern per module, each importing only those before it in this order (docs/ARCHITECTURE.md's interop table):
`save` (a save's names and layouts on disk; no torch), `files` (its torch.save files read safely), `optimizer` and
`distrib_optim` (the optimizer's entries), `args` (a job's args and ucp's model configs), `source` (a checkpoint
opened as a source), `target` (what a conversion writes), `dist` (the torch_dist format) and `convert` (the driver:
`convert` with a `ConvertOptions` record). Nothing is imported here, so that `ucp.interop.megatron.save` stays free
of torch for the command line.
"""
