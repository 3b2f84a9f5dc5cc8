"""`deform-surgeon batch`: patch many models (a TOML manifest and/or globs) in parallel worker processes.

Why a process per model: a model that crashes the ONNX parser, exhausts memory or fails in any other way fails
its own entry and nothing else; a fresh process also returns a large model's memory to the system. Processes
come from a fork server that has already imported the package, so starting one costs milliseconds.

Every entry ends in one of: `ok` (written; with --verify, verified), `unchanged` (nothing to rewrite),
`refused` (some node was refused, or some tensor stays over the device profile; written unless strict: the word
and exit code `patch` gives the same file), `failed` (bad input, verification failed, worker died; nothing
written). Exit code: 0 if every entry is ok or unchanged, 3 if some were refused and none failed,
1 if any failed, 2 if the batch itself cannot start (manifest missing or malformed, no models).

Manifest (paths relative to the manifest's folder)::

    [defaults]                    # optional; any entry option, plus out_dir and report_dir
    verify = true
    out_dir = "patched"           # outputs of entries without `output` (default: beside the input)

    [[model]]
    input = "birefnet_1024.onnx"
    output = "patched/birefnet_1024.webgpu.onnx"   # default: <out_dir>/<name>.patched.onnx
    report = "reports/birefnet_1024.json"          # default: <report_dir or output's folder>/<name>.report.json

    [[model]]
    glob = "variants/*.onnx"      # one entry per match, outputs by the default rule
    sum_mode = "chain"

A model folder instead of a manifest (`deform-surgeon batch DIR OUTDIR`): every `.onnx` below DIR (a
transformers.js repository's `onnx/` folder, say: one file per dtype) is patched into the same relative name in
OUTDIR, an unchanged model copied, each with its external data beside it; every other file (configs, tokenizer,
README) is copied unchanged, all or none, hidden files and folders (`.git`) are not; only regular files inside DIR
are read, and anything that cannot be read or written refuses the folder before anything is written (exit 2), a
config.json transformers.js would misread included (`TransformersConfig`); and one table says per variant its size,
how many deform blocks have a WebGPU kernel for every node, which nodes remain without one (kernels.py), the
verification and the time. Why `batch` and not `patch DIR OUTDIR`: a folder is a list of models, and batch already
runs each in its own process (one variant that fails or runs out of memory fails alone), with its progress, reports,
summary and exit codes.

Entry options: every option of `patch` under its API keyword (the argument groups of args.py, `PATCH_GROUPS`, so
an option added there is one here too): allow_unproven, sum_mode, verify, strict, copy_unchanged, iterations, seed,
val_range (`{ image = [0, 1] }`), opt_level, max_buffer / max_memory (bytes, or a size such as "256MiB"),
device_profile, input_shapes (`{ input_image = [1, 3, 1024, 1024] }`), skip_passes (`["sum_chain"]`: passes not to
run, as `--skip-pass`). Switches given on the command line (--verify, --strict, ...) apply to every entry; valued
command-line options are defaults that the manifest overrides.

The modules, one job each: `entry` (an `Entry`, the options it takes), `manifest` (a manifest and globs read into
entries), `folder` (`batch DIR OUTDIR` planned), `copying` (DIR's other files copied), `collisions` (what every
entry reads and writes, checked before any work), `js_config` (transformers.js's config.json, read as its
JavaScript reads it), `workers` (the worker processes), `progress`, `table` (reports, tables, the exit code) and
`command` (`BatchTool` and `main`, the road through them).
"""

from __future__ import annotations

from .collisions import check_collisions
from .command import BatchTool, main
from .copying import copy_files, regular_bytes
from .entry import DEFAULT_KEYS, ENTRY_KEYS, FAILED, OPTIONS, SWITCHES, Entry
from .folder import plan_folder
from .js_config import DTYPE_SUFFIXES, TRANSFORMERS_SUBFOLDER, TransformersConfig, base_names, data_files_read
from .manifest import plan
from .progress import STAGE_FRACTION, Progress
from .table import entry_report, exit_code, summary_table, variant_table, write_reports
from .workers import run

__all__ = [
    "DEFAULT_KEYS", "DTYPE_SUFFIXES", "ENTRY_KEYS", "FAILED", "OPTIONS", "STAGE_FRACTION", "SWITCHES",
    "TRANSFORMERS_SUBFOLDER", "BatchTool", "Entry", "Progress", "TransformersConfig", "base_names",
    "check_collisions", "copy_files", "data_files_read", "entry_report", "exit_code", "main", "plan", "plan_folder",
    "regular_bytes", "run", "summary_table", "variant_table", "write_reports",
]
