"""Layer 3, protocol: how a step comes to exist, once, whole and checked.

`codec` (chunk objects and their checksums, the shard index), `commit` (the commit marker, exclusive and decided by
what the store holds), `attempt` (save attempts, their owners and leases, garbage), `comm` (the collectives a save
needs), `coordination` (how ranks agree: map, decide, share the decision or one error), `session` (the save
protocol, `SaveSession`, that every save path runs). May import the layers below: base, format, storage.
"""
