"""Layer 3, what a graph is: its ops (`ops`), the pass framework every pass and analysis shares (`pipeline`:
`Context`, `Pass`, `Action`, `Refuse`), shapes and value ranges (`shapes`, `ranges`), the deform blocks
(`blocks`), the region lifted into onnx-graphsurgeon (`region`), tensor sizes against a device's limits
(`budget`, `device`), which nodes have a WebGPU kernel (`kernels`), constant folding (`fold`), a model's nodes in
order and sub-models of them (`subgraphs`) and fixing symbolic input dims (`input_shapes`).

Imports: `base`, `files`.
"""
