"""A TOML manifest and `--glob` patterns read into a batch's entries (`plan`): the manifest's `[defaults]` and
`[[model]]` entries, each entry's options resolved from the command line, the defaults and its own."""

from __future__ import annotations

import glob as globlib
import tomllib
from pathlib import Path

from ...base.errors import SurgeonError
from ..args import manifest_problem
from .collisions import check_collisions
from .entry import DEFAULT_KEYS, ENTRY_KEYS, OPTIONS, SWITCHES, Entry


def plan(manifest: str | None, globs: list[str], cli: dict, summary: str | None = None) -> list[Entry]:
    """The entries of a batch, in order, each with its output and report paths and its options resolved.

    Problems of the batch as a whole raise `SurgeonError`; problems of one entry are recorded in `entry.error`.
    """
    defaults, raw = _read_manifest(Path(manifest)) if manifest is not None else ({}, [])
    raw += [({"glob": g}, Path(), "--glob") for g in globs]
    if not raw:
        raise SurgeonError(manifest, "no models: the manifest lists none" if manifest else
                           "no models: give a manifest or --glob PATTERN")
    out_dir = defaults.get("out_dir") or cli.get("out_dir")
    report_dir = defaults.get("report_dir") or cli.get("report_dir")
    entries: list[Entry] = []
    for spec, base, where in raw:
        number = len(entries) + 1
        problem = _spec_problem(spec)
        if problem:
            entries.append(Entry(number, str(spec.get("input", spec.get("glob", f"entry {number}"))),
                                 error=f"{where}: {problem}"))
            continue
        options = _entry_options(cli, defaults, spec)
        models = _models_of(spec, base)
        if not models:
            entries.append(Entry(number, spec["glob"], error=f"glob '{spec['glob']}' matches no file"))
            continue
        for inp, out, rep in models:
            out = str(base / out) if out else str(Path(out_dir or Path(inp).parent) / f"{Path(inp).stem}.patched.onnx")
            if not rep:
                rep = str(Path(report_dir or Path(out).parent) / f"{Path(out).stem}.report.json")
            else:
                rep = str(base / rep)
            entries.append(Entry(len(entries) + 1, inp, out, rep, dict(options)))
    check_collisions(entries, summary)
    return entries


def _read_manifest(path: Path) -> tuple[dict, list[tuple[dict, Path, str]]]:
    """A manifest's `[defaults]` (its out_dir and report_dir made relative to the manifest's folder) and its
    `[[model]]` entries, each with the folder its paths are relative to and where it was given (for its error
    lines). A manifest that cannot be read as one, or whose defaults are wrong, refuses the batch (`SurgeonError`):
    every entry would inherit the problem."""
    if not path.is_file():
        raise SurgeonError(path, "no such file" if not path.exists() else "is not a file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SurgeonError(path, f"not a valid TOML manifest ({' '.join(str(exc).split())})") from None
    unknown = set(data) - {"defaults", "model"}
    if unknown:
        raise SurgeonError(path, f"unknown manifest key(s): {', '.join(sorted(unknown))}",
                           "a manifest has [defaults] and [[model]] entries")
    defaults = data.get("defaults", {})
    models = data.get("model", [])
    if not isinstance(defaults, dict) or not isinstance(models, list) or not all(isinstance(m, dict)
                                                                                  for m in models):
        raise SurgeonError(path, "[defaults] must be a table and [[model]] an array of tables")
    bad = set(defaults) - DEFAULT_KEYS
    if bad:
        raise SurgeonError(path, f"unknown option(s) in [defaults]: {', '.join(sorted(bad))}",
                           f"known: {', '.join(sorted(DEFAULT_KEYS))}")
    problem = manifest_problem(defaults)
    if problem:
        raise SurgeonError(path, f"[defaults]: {problem}")
    base = path.parent
    defaults = {k: (str(base / v) if k in ("out_dir", "report_dir") and isinstance(v, str) else v)
                for k, v in defaults.items()}
    return defaults, [(m, base, f"{path}, [[model]] #{k}") for k, m in enumerate(models, 1)]


def _spec_problem(spec: dict) -> str | None:
    """What is wrong with one entry as given (its keys, its paths, its options' values), or None: such an entry
    fails alone, and the rest of the batch runs."""
    bad = set(spec) - ENTRY_KEYS
    if bad:
        return f"unknown option(s) {', '.join(sorted(bad))} (known: {', '.join(sorted(ENTRY_KEYS))})"
    if ("input" in spec) == ("glob" in spec):
        return "an entry needs exactly one of `input` or `glob`"
    if "glob" in spec and ("output" in spec or "report" in spec):
        return "a `glob` entry cannot name one `output` or `report`; give each model its own entry"
    if not all(isinstance(spec.get(k, ""), str) for k in ("input", "glob", "output", "report")):
        return "input, glob, output and report must be strings"
    return manifest_problem(spec)


def _entry_options(cli: dict, defaults: dict, spec: dict) -> dict:
    """One entry's options: the command line's valued options, overridden by `[defaults]`, overridden by the
    entry's own; a switch (--verify, ...) is on where any of them turns it on, as on `patch`'s command line."""
    options = {k: v for k, v in cli.items() if k in OPTIONS and v is not None and k not in SWITCHES}
    options.update({k: v for k, v in defaults.items() if k in OPTIONS})
    options.update({k: v for k, v in spec.items() if k in OPTIONS})
    for k in SWITCHES:
        options[k] = bool(options.get(k)) or bool(cli.get(k))
    return options


def _models_of(spec: dict, base: Path) -> list[tuple[str, str | None, str | None]]:
    """The models one entry names, as (input, its output, its report; None: by the default rule): its `input`, or
    every match of its `glob` (none: an empty list), a `.patched.onnx` an earlier batch wrote left out."""
    if "glob" not in spec:
        return [(str(base / spec["input"]), spec.get("output"), spec.get("report"))]
    pattern = str(base / spec["glob"])
    matches = sorted(p for p in globlib.glob(pattern, recursive=True) if not p.endswith(".patched.onnx"))
    return [(m, None, None) for m in matches]
