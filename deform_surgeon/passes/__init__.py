"""Layer 4, node-level rewrites. Each module is one pass: a pattern, a check that returns a reason, a
replacement; with them what shows a rewrite exact on its own (`local_proof`, `float16_proof`, `precision`) and
how fitting cuts and joins a tensor (`cut_and_join`).

`graph.ranges` is the prover the passes ask; nothing else decides whether a rewrite is safe.

Imports: `base`, `files`, `graph`.
"""
