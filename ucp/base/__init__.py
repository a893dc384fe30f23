"""Layer 0, base: what every other layer stands on, with no notion of a checkpoint.

`boxes` (n-D regions), `chunking` (how an atom is cut into objects and inner chunks), `workpool` (thread-pool
batching, a lane for small objects), `heap`, `dtypes` (the dtype table, bytes views), `devices` (copies between host
memory and devices: side streams, page-locking). Imports nothing of ucp's but `ucp.errors`.
"""
