"""Layer 2, model files in and out, never copying weights: load and check (load.py), stored tensors
(weights.py), a model as protobuf records (wire.py), the bridge to onnx-graphsurgeon (graph.py) and the atomic,
streaming writer (write.py), with its temporaries and folder locks (temporary.py) and an output and its data file
put in place as a pair (pair.py).

Why a package of its own: the rules "weights are never copied" and "no input is modified and no partial output
file is ever left behind" live here and only here; so do a command's files checked before any work
(`io_check`).

Imports: `base`.
"""

from .graph import export_graph, tidy
from .load import (
    TypeTable,
    check_and_infer,
    check_model,
    check_spliced,
    checked_types,
    infer_value_types,
    load_model,
    path_problem,
    user_path,
)
from .pair import DATA_SUFFIXES, external_data_path
from .temporary import atomic_path, temp_prefix
from .weights import (
    STORED_WEIGHT_BYTES,
    Weights,
    elem_nbytes,
    skeleton_bytes,
    split_weights,
)
from .wire import ModelScan, copy_fields, scan_model
from .write import (
    BROWSER_SINGLE_FILE_LIMIT,
    EXTERNAL_DATA_CHOICES,
    DataForm,
    Written,
    check_external_output,
    copy_atomic,
    save_model_atomic,
    single_file_problem,
    weights_external,
)

__all__ = [
    "BROWSER_SINGLE_FILE_LIMIT", "DATA_SUFFIXES", "DataForm", "EXTERNAL_DATA_CHOICES", "ModelScan",
    "STORED_WEIGHT_BYTES", "TypeTable", "Weights", "Written",
    "atomic_path", "check_and_infer", "check_external_output", "check_model", "check_spliced", "checked_types",
    "copy_atomic", "copy_fields", "elem_nbytes", "export_graph", "external_data_path", "infer_value_types",
    "load_model", "path_problem", "save_model_atomic", "scan_model", "single_file_problem", "skeleton_bytes",
    "split_weights", "temp_prefix", "tidy", "user_path", "weights_external",
]
