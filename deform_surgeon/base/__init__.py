"""Layer 1, the base: what any layer may use, and which uses nothing of the package's but this layer.

Errors and the one-line refusal (`errors`), sizes (`sizes`), giving memory back (`memory`), a function run in a
forked child (`background`), signals held while steps finish together (`signals`), which thread counts give ORT
CPU's Convs and GEMMs other bytes (`threads`), a patch's stages and progress (`stages`), ORT CPU as the project's
one small oracle (`ort_cpu`), the command framework (`tool`) and where the pinned JavaScript runtimes live
(`js_runtimes`).

Imports: nothing of deform_surgeon outside `base` (tests/test_layers.py).
"""
