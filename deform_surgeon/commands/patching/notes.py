"""What the report says beside the actions: its note (the --max-memory line, what stays over the device profile,
the symbolic-dims line, `--strict`'s line) and where the output's weights go and why (`weights_form`, then
`data_written` once written)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import onnx

from ...files import DataForm, Weights, Written, elem_nbytes, single_file_problem, weights_external
from ...graph.budget import human
from ...graph.input_shapes import symbolic_inputs
from ..report import PatchReport
from .lift import Lifted


def annotate(report: PatchReport, lifted: Lifted, *lines: str) -> None:
    """The report's note (`lines`, the --max-memory line among them, then what stays over the device profile and the
    symbolic-dims line) and its `stays_over`, from the same lift: the status (`PatchReport.status`, a tensor over
    the profile is a finding) and the note that names those tensors never tell two lifts apart."""
    left = stays_over(lifted)
    report.stays_over = [o for _, o, _, _ in left]
    report.note = "; ".join(x for x in (*lines, over_profile_note(lifted, left), symbolic_note(lifted)) if x)


def strict_note(report: PatchReport) -> None:
    """`--strict` and a finding: what was found, that nothing is written, then the rest of the note (the tensors
    over the profile are named only there)."""
    report.note = "; ".join(x for x in (f"--strict: {report.findings}; {report.output} not written", report.note)
                            if x)


def stays_over(lifted: Lifted) -> list[tuple[int, str, onnx.NodeProto, bool]]:
    """The original model's tensors over the profile's buffer size that the patched model still makes, largest
    first, as (bytes, name, producer, size unknown), those of a size shape inference does not know included where
    they are over it even at their smallest (`lift.over_limit`). Why: the passes fit deform blocks, decoder Convs
    and Resizes, token-major MatMul chains and wide nodes, each where its shapes are known; anything else is left as it
    is, and a plain `patch`, which fits the profile by default, must say so (and exit as for a refused node, see
    `PatchReport.status`) rather than let the user find it out when the GPU refuses the buffer."""
    over, smallest = lifted.oversize, lifted.over_at_smallest
    if not over and not smallest:
        return []
    whole, _ = lifted.patched()
    return sorted((((elem_nbytes(*lifted.types[o]) or 0) if o in over else smallest[o], o, n, o in smallest)
                   for n in whole.graph.node for o in n.output if o in over or o in smallest),
                  key=lambda x: (-x[0], x[1]))


def over_profile_note(lifted: Lifted, left: list[tuple[int, str, onnx.NodeProto, bool]]) -> str:
    """The note naming what `stays_over` found ("" when nothing)."""
    if not left:
        return ""
    ops = Counter(n.op_type for _, _, n, _ in left).most_common()
    limit = lifted.ctx.options.max_buffer
    named = ", ".join(f"'{o}' {'at least ' if unknown else ''}{human(size)} from {n.op_type} '{n.name}'"
                      for size, o, n, unknown in left[:3])
    unknown = sum(u for *_, u in left)
    some = (f"; {unknown} of them with a dim shape inference leaves symbolic, over it even where that dim is 1, "
            "which no pass can compute in parts" if unknown else "")
    return (f"STAYS OVER the device profile: {len(left)} tensor(s) over {human(limit)} (made by "
            f"{', '.join(f'{op} {c}' for op, c in ops)}; largest {named}{', ...' if len(left) > 3 else ''}{some}): "
            "no pass computes them in parts (`deform-surgeon budget MODEL` lists every tensor of known size over a "
            "profile)")


def symbolic_note(lifted: Lifted) -> str:
    """For a model with symbolic input dims patched as it is: for which sizes its deform blocks were proven, and
    what stays on the CPU ("" when every input dim is a number)."""
    symbolic = symbolic_inputs(lifted.model)
    if not symbolic:
        return ""
    sampled = sorted({str(list(lifted.types[n.input[0]][1])) for n in lifted.model.graph.node
                      if n.op_type in ("GatherND", "GatherElements") and n.input[0] in lifted.types
                      and lifted.types[n.input[0]][1] is not None})
    proven = (f"the deform blocks were proven for the sizes the export baked in (sampled data shapes "
              f"{', '.join(sampled[:4])}{', ...' if len(sampled) > 4 else ''}), not for other input sizes"
              if sampled else "no deform block has a static sampled shape")
    return (f"symbolic input dims ({'; '.join(symbolic)}): {proven}; the shape computations on the symbolic dims "
            "stay on the CPU EP; give --input-shape NAME:DIMS to patch for the size the model will get")


def weights_form(model_path: Path, output_path: Path | None, weights: Weights, form: DataForm,
                  as_is: bool = False) -> dict:
    """Where the output's weights go and why, and what would keep a browser page from loading it, before anything
    is written (or, with no output or `as_is`, the input as it is), the input's size standing for the output's:
    the report's `weights` until `data_written` puts what was written in its place."""
    size = sum(os.path.getsize(p) for p in [model_path, *sorted(weights.sources())])
    target = output_path or model_path
    external = weights.external if as_is else weights_external(form.choice, weights.external, size)
    data = form.data_path(target, weights.named_sources()).name if external else None
    return {"external_data": data, "why": _why(external, weights.external, form.choice, size),
            "browser_problem": None if external else single_file_problem(target.name, size)}


def _why(external: bool, input_external: bool, choice: str, size: int | None) -> str:
    """Why the output's weights are (or are not) in a data file: the report's `weights.why`."""
    if choice != "auto":
        return f"--external-data {choice}"
    if external and not input_external:
        return f"one file of {(size or 0) / 2**20:,.0f} MiB would not load in a browser page"
    return "as the input's"


def data_written(report: PatchReport, written: Written, weights: Weights, form: DataForm) -> None:
    """The report's weights form as written (`Written`): the data file's name where one was written, and the
    output's own size as one file for the 512 MiB rule's reason and warning (the input's size said "one file of
    2,289 MiB" of a 510 KB output); none where the model had no stored tensor to put there (`--external-data
    always` of such a model named a file that did not exist)."""
    name = Path(report.output or report.model).name
    external = written.data is not None
    why = _why(external, weights.external, form.choice, written.one_file_size)
    if not external and (form.choice == "always" or (form.choice == "auto" and weights.external)):
        why += ", but it has no stored tensor to put in a data file: written as one file"
    problem = None if external or written.one_file_size is None else single_file_problem(name, written.one_file_size)
    report.weights = {"external_data": written.data.name if external else None, "why": why,
                      "browser_problem": problem}


