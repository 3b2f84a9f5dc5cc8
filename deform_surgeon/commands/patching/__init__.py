"""The stages of a patch run (`commands.patch.PatchRun`), each in a module of its own: its options by concern
(`options`), `lift` (load, fold, lift the deform regions, run the passes; the `--max-memory` rounds), `prove`
(each rewrite not exact by construction shown exact on its own), `writing` (write, verify, undo), and the report's
notes (`notes`)."""
