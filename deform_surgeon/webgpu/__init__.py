"""Layer 8, the real WebGPU runtimes: where onnxruntime-web and -node place a model's nodes (`placement`), the
first node a runtime gets wrong (`bisect`), a local page of the original and the patched model (`serve`), the
pinned runtimes they run on installed (`setup`), and the picture they run (`sample_image`).

Imports: every layer below.
"""
