"""Layer 1, format: what is on disk, with no IO.

`manifest` (names, the step manifest and atom metadata, the format's version and bounds, JSON in and out),
`packs` (where packed atoms lie in their pack objects), `tree` (the state tree: which leaves are atoms, which JSON).
docs/FORMAT.md is the specification. May import `ucp.base` and `ucp.errors`.
"""
