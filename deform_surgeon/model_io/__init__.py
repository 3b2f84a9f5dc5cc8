"""Models in and out, never copying weights: load and check (load.py), stored weights (weights.py), the bridge to
onnx-graphsurgeon (graph.py) and the atomic, streaming writer (write.py).

Why a package of its own: the rules "weights are never copied" and "no input is modified and no partial output
file is ever left behind" live here and only here.
"""

from .graph import FastGraph, export_graph, import_graph
from .load import TypeTable, check_and_infer, check_model, check_spliced, infer_value_types, load_model
from .weights import (
    STORED_WEIGHT_BYTES,
    Weights,
    copy_fields,
    elem_nbytes,
    split_weights,
    stub,
    stubbed_copy,
    weightless,
)
from .write import (
    atomic_path,
    check_external_output,
    copy_atomic,
    external_data_path,
    save_model_atomic,
    temp_prefix,
)

__all__ = [
    "STORED_WEIGHT_BYTES", "FastGraph", "TypeTable", "Weights", "atomic_path", "check_and_infer",
    "check_external_output", "check_model", "check_spliced", "copy_atomic", "copy_fields", "elem_nbytes",
    "export_graph", "external_data_path", "import_graph", "infer_value_types", "load_model", "save_model_atomic",
    "split_weights", "stub", "stubbed_copy", "temp_prefix", "weightless",
]
