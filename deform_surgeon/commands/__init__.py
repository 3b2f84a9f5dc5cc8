"""Layer 7, the commands: `patch` and `inspect`, each one `PatchRun` (`patch`), its stages in `patching` (lift,
prove, export, write, verify, undo), the report (`report`), `batch` (`batch`), the command line (`cli`, `args`),
and what batch's fork server loads (`ctrl_c_ignored`).

Imports: every layer below (`base`, `files`, `graph`, `proofs`, `passes`, `checks`), not `webgpu`: the command
line loads the WebGPU commands by name when run (`cli.TOOLS`).
"""
