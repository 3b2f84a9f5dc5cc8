"""Node-level rewrites. Each module is one pass: a pattern, a check that returns a reason, a replacement.

`ranges` is the prover the others ask; nothing else decides whether a rewrite is safe.
"""
