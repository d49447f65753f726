"""Exact steps on partial batches: each replica computes with its own rows, as in TF.

`trace` traces the replica function once per distinct replica shape and cuts it at its
collectives; `plan` runs the pieces and the collectives between them; `mesh` compiles the pieces
once over the whole mesh; `schedule` groups independent all-reduces into one cut.
"""
