"""Would a row split of a float16 deform block be exact on ORT CPU, and where does ORT CPU round a float16 block?
(issue 34, item 1: the investigation; docs/variants.md records what it printed.)

    python scripts/measure_fp16_split.py [--max-buffer BYTES] [--seeds 3]

1. The replica decoder (tests/helpers/exporter_replica.py, 64x64, 8 deform blocks) is patched in float32 with a small
   --max-buffer, so `patch` splits its deform blocks into row chunks (each Conv split shown exact on its own);
   the unsplit and the split model are then both made float16 as transformers.js's fp16 file is made
   (scripts/make_variants.py: onnxconverter-common with keep_io_types, onnxslim). That is the split the float16
   files would get, made before the conversion instead of refused after it.
2. Both float16 models run on ORT CPU at levels 'disable' and 'all' on seeded inputs: byte-identical or not, and
   the largest difference.
3. Where ORT CPU rounds: ORT's own optimized graph of the unsplit float16 model (level 'disable'; its
   InsertCastTransformer runs at every level) says which nodes run on float32 kernels behind inserted Casts, and
   which of the model's float16 tensors ORT never materialises (the Casts between two float32 nodes removed). The
   split's Slices are then checked against that: a Slice that reads a tensor ORT never materialises in float16
   adds a rounding the unsplit model does not have.
4. ORT's own float32 form (that optimized graph, its Casts written into the file) against the float16 model, and
   the row split forced (the split pass without its float16 refusal) on the float16 model and on that form.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))


def _run(path: Path, feeds: dict, level: str, optimized: Path | None = None) -> list[np.ndarray]:
    import onnxruntime as ort

    from deform_surgeon.base.ort_cpu import ort_level as _ort_level

    options = ort.SessionOptions()
    options.graph_optimization_level = _ort_level(level)
    options.log_severity_level = 3
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _materialised(model: onnx.ModelProto, optimized: onnx.ModelProto) -> tuple[Counter, set[str]]:
    """From ORT's optimized graph: the op types it runs behind inserted float32 Casts, and the float16 tensors of
    `model` it never materialises (no longer a tensor of its graph: computed and kept in float32)."""
    made = {o for n in optimized.graph.node for o in n.output}
    cast_out = {n.output[0] for n in optimized.graph.node if n.op_type == "Cast" and "InsertedPrecisionFreeCast" in
                n.name}
    behind = Counter(n.op_type for n in optimized.graph.node if n.op_type != "Cast"
                     and any(i in cast_out for i in n.input))
    half = _float16_tensors(model)
    return behind, {t for t in half if t not in made}


def _float16_tensors(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    return {vi.name for vi in (*inferred.graph.value_info, *inferred.graph.output)
            if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-buffer", type=int, default=20_000, help="bytes; small enough to split the blocks")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model", metavar="FLOAT16.onnx", default=None,
                        help="a float16 model of static input dims instead of the replica: steps 3 and 4 only")
    args = parser.parse_args()

    from helpers import exporter_replica
    from make_variants import fp16

    import deform_surgeon as ds

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model is not None:
            _float32_form(Path(args.model), tmp, args)
            return 0
        whole32, split32 = tmp / "whole32.onnx", tmp / "split32.onnx"
        onnx.save(exporter_replica.build(exporter_replica.Spec()), whole32)
        report = ds.patch(whole32, split32, max_buffer=args.max_buffer)
        splits = [a for a in report.actions if a.pass_name == "split" and a.action == "rewritten"]
        print(f"float32 patch at --max-buffer {args.max_buffer:,}: {len(splits)} deform block(s) split into row "
              f"chunks ({', '.join(str(a.details.get('chunks')) for a in splits)} chunks)")
        whole16, split16 = tmp / "whole16.onnx", tmp / "split16.onnx"
        onnx.save(fp16(onnx.load(whole32)), whole16)
        onnx.save(fp16(onnx.load(split32)), split16)

        for level in ("disable", "all"):
            same, worst = _compare(whole16, split16, level, args.seeds)
            print(f"float16 split vs unsplit, ORT CPU level '{level}', {args.seeds} seeded input(s): "
                  f"{'byte-identical' if same else 'differs'} (max |diff| {worst:.3g})")

        never, half = _float32_form(whole16, tmp, args)
        split_model = onnx.load(split16)
        slices = [n for n in split_model.graph.node if n.op_type == "Slice" and "/chunk" in n.name]
        slices = slices or [n for n in split_model.graph.node if n.op_type == "Slice"]
        read = Counter("never materialised (adds a rounding)" if n.input[0] in never else
                       "materialised in float16 (no new rounding)" if n.input[0] in half else "not float16"
                       for n in slices)
        print(f"the split's {len(slices)} Slice(s) read tensors that the unsplit model has "
              + "; ".join(f"{v}: {k}" for k, v in read.most_common()))

    return 0


def _float32_form(whole16: Path, tmp: Path, args: argparse.Namespace) -> tuple[set[str], set[str]]:
    """Steps 3 and 4 on a float16 model: where ORT CPU rounds it, its float32 form, the row split forced on both.
    Returns the model's float16 tensors ORT never materialises, and all its float16 tensors."""
    import deform_surgeon as ds

    feeds = _feeds(whole16, 1)
    opt = tmp / "whole16.ort.onnx"
    _run(whole16, feeds, "disable", opt)
    model16 = onnx.load(whole16)
    behind, never = _materialised(model16, onnx.load(opt))
    half = _float16_tensors(model16)
    print(f"unsplit float16 model on ORT CPU: {sum(behind.values())} node(s) run on float32 kernels behind "
          f"inserted Casts ({', '.join(f'{k} {v}' for k, v in behind.most_common())}); {len(never)} of its "
          f"{len(half)} float16 tensors never materialised in float16 (kept in float32 between those nodes)")
    # 4. ORT's own float32 form: its optimized graph (at `form` level: 'disable', or 'basic' with its fusions) with
    # the inserted Casts written out
    for form in ("disable", "basic"):
        print(f"-- ORT's float32 form taken at level '{form}':")
        explicit = tmp / f"explicit16_{form}.onnx"
        _run(whole16, feeds, form, explicit)
        again = tmp / f"explicit16_{form}.ort.onnx"
        _run(explicit, feeds, "disable", again)
        casts = [{n.name for n in onnx.load(f).graph.node if "InsertedPrecisionFreeCast" in n.name}
                 for f in (explicit, again)]
        written, inserted = len(casts[0]), len(casts[1] - casts[0])
        print(f"ORT's float32 form: {written} Cast(s) written out; ORT inserts {inserted} more into it (every node "
              f"{'then runs on a kernel of its own types' if not inserted else 'is not yet on its own types'})")
        for level in ("disable", "all"):
            same, worst = _compare(whole16, explicit, level, args.seeds)
            print(f"ORT's own float32 form (its inserted Casts written into the file) vs the float16 model, level "
                  f"'{level}': {'byte-identical' if same else 'differs'} (max |diff| {worst:.3g})")
        sources = [("ORT's float32 form", explicit)] + ([("the float16 model itself", whole16)] if form == "disable"
                                                         else [])
        for label, source in sources:
            out = tmp / f"forced_{source.stem}.onnx"
            with _split_float16_allowed():
                forced = ds.patch(source, out, max_buffer=args.max_buffer)
            n = sum(a.pass_name == "split" and a.action == "rewritten" for a in forced.actions)
            for level in ("disable", "all"):
                same, worst = _compare(whole16, out, level, args.seeds)
                print(f"row split forced on {label} ({n} block(s) split) vs the unsplit float16 model, level "
                      f"'{level}': {'byte-identical' if same else 'differs'} (max |diff| {worst:.3g})")
    return never, half


def _feeds(path: Path, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs in [0, 1) of the model's own (static) dims and float types."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in onnx.load(path, load_external_data=False).graph.input:
        tt = vi.type.tensor_type
        dtype = np.float16 if tt.elem_type == onnx.TensorProto.FLOAT16 else np.float32
        feeds[vi.name] = rng.random([d.dim_value for d in tt.shape.dim]).astype(dtype)
    return feeds


def _compare(a: Path, b: Path, level: str, seeds: int) -> tuple[bool, float]:
    same, worst = True, 0.0
    for seed in range(1, seeds + 1):
        feeds = _feeds(a, seed)
        x, y = _run(a, feeds, level)[0], _run(b, feeds, level)[0]
        same &= x.tobytes() == y.tobytes()
        worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return same, worst


class _split_float16_allowed:
    """The split pass without its float16 refusal (for this measurement only): its dtype test sees float16 as
    float32. The Conv stays whole in a float16 block (its own split is for float32 only)."""

    def __enter__(self):
        import deform_surgeon.passes.split as split

        class Numpy:
            def __getattr__(self, key):
                return getattr(np, key)

            @staticmethod
            def dtype(x):
                return np.dtype(np.float32) if x is not None and np.dtype(x) == np.float16 else np.dtype(x)

        self.module, self.saved = split, split.np
        split.np = Numpy()

    def __exit__(self, *exc):
        self.module.np = self.saved


if __name__ == "__main__":
    raise SystemExit(main())
