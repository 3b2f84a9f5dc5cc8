"""Layer 5, node-level rewrites. The passes, each a pattern, a check that returns a plan or a reason, and a
replacement (`graph.pipeline.Pass`), in the order `patch` runs them (`registry`): `deform_conv`, `gathernd`,
`gather_elements`, `residency`, `sum_chain`, `fit`, `split` and `bands`. Beside them, what they are built from:
the bands pass's planners (`conv_bands`, `resize_groups`, `matmul_chunks`, and `oversize`, what the three share),
how fitting cuts and joins a tensor (`cut_and_join`), the state the split and bands passes share with `patch`
across lifts (`run_state`), and `float16_slices`, a whole-model rewrite `patch` runs before the region is
lifted.

`graph.ranges` is the prover the passes ask; nothing else decides whether a rewrite is safe. A rewrite that is not
exact by construction records its proof (`proofs.local_proof.record`).

Imports: `base`, `files`, `graph`, `proofs`.
"""
