"""Layer 4, what shows a rewrite exact on its own, where it is not exact by construction: the rewritten part beside
what it replaced, each in the context ORT CPU fuses it in, on the real shapes (`local_proof`); a float16 rewrite's
proof on the nodes around it, held to the roundings ORT CPU chooses in the two models (`float16_proof`); and where
ORT CPU rounds a float16 model, read from the graphs it saves (`precision`).

The passes record a proof as they rewrite (`local_proof.record`); `patch` runs the proofs before it writes.
A proof never builds a rewrite, so nothing here imports the passes.

Imports: `base`, `files`, `graph`.
"""
