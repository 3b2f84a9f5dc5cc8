"""Layer 6, the checks of whole models: the patched model against the original on ORT CPU, byte for byte
(`verify`), run in segments where a whole run does not fit (`run_in_segments`), and the one verdict vocabulary
every comparison prints (`verdict`). (A rewrite's own proof is a layer below: `proofs`.)

Imports: `base`, `files`, `graph`, `proofs`, `passes`.
"""
