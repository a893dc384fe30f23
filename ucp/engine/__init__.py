"""Layer 4, engine: moving a step's bytes between tensors and storage, in one process.

`staging` (bounded, reused staging memory), `landing` (the load path to a device: page-locked slots, asynchronous
copies), `writer_process` (the process that encodes and writes async saves), `pipeline` (sync, async and lazy saves),
`checkpoint` (single-process save, `CheckpointReader`), `inspection` (inspect and verify). May import the layers
below: base, format, storage, protocol.
"""
