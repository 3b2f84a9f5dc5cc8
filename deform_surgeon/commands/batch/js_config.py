"""A transformers.js model folder's config.json: which data files transformers.js fetches for a model file, read as
its JavaScript reads the config (`data_files_read`, with JavaScript's `!!x`, `+x` and `String(x)` for the values
JSON.parse gives), and OUTDIR's copy of it made to say which models batch wrote with data (`TransformersConfig`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...base.errors import SurgeonError
from ...files import atomic_path, wire
from ...files.pair import MAX_DATA_CHUNKS
from .copying import regular_bytes

if TYPE_CHECKING:
    from .entry import Entry

TRANSFORMERS_SUBFOLDER = "onnx"  # where transformers.js fetches a model folder's files (`{subfolder}/model_fp16.onnx`)
# transformers.js 4.3.1's file name suffixes by dtype (DEFAULT_DTYPE_SUFFIX_MAPPING, src/utils/dtypes.js): a page asks
# for the file `model` of dtype fp16, `model_fp16.onnx`, and looks its data up by either name (`data_files_read`)
DTYPE_SUFFIXES = ("_fp16", "_int8", "_uint8", "_quantized", "_q4", "_q2", "_q1", "_q4f16", "_q2f16", "_q1f16", "_bnb4")
_JS_SPACE = ("\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029"
             "\u202f\u205f\u3000\ufeff")  # what JavaScript's Number("...") trims: WhiteSpace and LineTerminator
_JS_DECIMAL = re.compile(r"[+-]?(?:Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)")
_JS_RADIX = re.compile(r"0([xXoObB])([0-9a-zA-Z]+)")


def base_names(file_name: str) -> set[str]:
    """The names a page may give transformers.js for the file `file_name` (`fileName`, the model's file name
    without the dtype suffix: `model` for `model_fp16.onnx`, or `model_fp16` itself with dtype fp32)."""
    stem = file_name.removesuffix(".onnx")
    return {stem} | {stem[: -len(s)] for s in DTYPE_SUFFIXES if stem.endswith(s) and len(stem) > len(s)}


def data_files_read(value, file_name: str, base: str) -> int:
    """How many data files transformers.js 4.3.1 fetches for `file_name` (`model_fp16.onnx`) asked for as `base`
    (`model`), its config's `use_external_data_format` being `value`: `resolveExternalDataFormat(config, fullName,
    fileName)` (src/utils/model-loader.js) is 0 for a false value; in an object (an array too) the entry of the
    full name, else of the base name, else 0; else the value itself, each as JavaScript's `+x` reads it; its loop
    `for (i = 0; i < n; ++i)` then fetches ceil(n) files (1.5: 2), none for NaN or n <= 0, and over
    MAX_DATA_CHUNKS it refuses to load (shown as one more)."""
    if not _js_truthy(value):
        return 0
    if isinstance(value, dict):
        value = next((value[k] for k in (file_name, base) if k in value), 0)
    elif isinstance(value, list):  # (an array's own properties, its indices and length, name no model file)
        return 0
    n = _js_number(value)
    if not n > 0:
        return 0
    return MAX_DATA_CHUNKS + 1 if n > MAX_DATA_CHUNKS else math.ceil(n)


def _js_truthy(value) -> bool:
    """JavaScript's `!!value` for a value of JSON.parse."""
    return value not in (None, False, 0, "") or isinstance(value, (list, dict))


def _js_number(value) -> float:
    """JavaScript's `+value` (ToNumber) for a value of JSON.parse: an array through its string (`[2]` is 2, `[1, 2]`
    NaN), an object NaN."""
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer literal past a double's range
            return math.copysign(math.inf, value)
    if value is None:
        return 0.0
    if isinstance(value, (str, list)):
        text = (value if isinstance(value, str) else _js_string(value)).strip(_JS_SPACE)
        if not text:
            return 0.0
        if radix := _JS_RADIX.fullmatch(text):
            try:
                return float(int(radix[2], {"x": 16, "o": 8, "b": 2}[radix[1].lower()]))
            except ValueError:  # a digit the base has not
                return math.nan
            except OverflowError:
                return math.inf
        return float(text) if _JS_DECIMAL.fullmatch(text) else math.nan
    return math.nan


def _js_string(value) -> str:
    """JavaScript's `String(value)` of an array's element (null: empty; an array: its elements joined by commas),
    as far as `_js_number` needs it (a number: any text that reads back as that number)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(_js_string(v) for v in value)
    if isinstance(value, dict):
        return "[object Object]"
    n = _js_number(value)
    return repr(n) if math.isfinite(n) else ("Infinity" if n > 0 else "-Infinity")


def _not_json(name: str) -> float:
    """`NaN`, `Infinity`, `-Infinity`: Python's json takes them, JavaScript's JSON.parse does not."""
    raise ValueError(f"{name} is not JSON")


def _not_finite(value) -> bool:
    """Whether a number in `value` is not finite (a literal such as 1e400: read as infinity, it would be written
    back as `Infinity`, which JSON.parse rejects)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_not_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_not_finite(v) for v in value)
    return False


@dataclass
class TransformersConfig:
    """OUTDIR's config.json in a transformers.js model folder (`config.json` beside `onnx/`), read before any model
    is written: transformers.js fetches a model's external data only when its
    `transformers.js_config.use_external_data_format` says so, so batch makes it say which files it wrote with
    data, and keeps every other value of the config as it was read. Whether it can (`problem`) is decided up front:
    a config that cannot be written back as read (not JSON as JSON.parse reads it, a number past a float's range,
    a lone surrogate, nesting deeper than Python reads) refuses the batch before anything is written where it
    would have to change, and is left untouched where it says the right thing already."""

    path: Path  # OUTDIR/config.json
    raw: bytes  # as read: DIR's (the copy's source), else OUTDIR's own
    config: dict | None  # None where it cannot be read (see `problem`)
    problem: str | None = None

    @classmethod
    def read(cls, source: Path, target: Path) -> TransformersConfig:
        raw = b"".join(regular_bytes(source))
        try:
            config = json.loads(raw.decode("utf-8-sig"), parse_constant=_not_json)  # (transformers.js reads a BOM)
        except (UnicodeError, ValueError, RecursionError) as e:
            return cls(target, raw, None, f"cannot be read as JSON ({type(e).__name__})")
        if not isinstance(config, dict):
            return cls(target, raw, None, "is not a JSON object")
        try:
            (json.dumps(config, ensure_ascii=False) + "\n").encode("utf-8")
            infinite = _not_finite(config)
        except (UnicodeError, RecursionError) as e:  # (a lone surrogate: read, but not writable as UTF-8)
            return cls(target, raw, config, f"cannot be written back as read ({type(e).__name__})")
        if infinite:
            return cls(target, raw, config, "holds a number past a float's range, which would be written back as "
                       "`Infinity` (JSON.parse rejects it)")
        return cls(target, raw, config)

    @classmethod
    def planned(cls, out: Path, copies: list[tuple[Path, Path]], entries: list[Entry]) -> TransformersConfig | None:
        """OUTDIR's config.json as it will be before the models are written (None: there is none, or no model is
        written into OUTDIR/onnx/); refused (`SurgeonError`, exit 2) if it would have to change and cannot."""
        target, folder = out / "config.json", out / TRANSFORMERS_SUBFOLDER
        source = next((s for s, t in copies if t == target), target if target.exists() else None)
        planned = {Path(e.output).name: int(e.external) for e in entries
                   if e.error is None and Path(e.output).parent == folder}
        if source is None or not planned:
            return None
        config = cls.read(source, target)
        if config.problem and not config.says(planned):
            raise SurgeonError(source, f"{config.problem}, so batch cannot make it say which models in "
                               f"{TRANSFORMERS_SUBFOLDER}/ have external data", "transformers.js would fetch the "
                               "wrong data files: fix or remove the config, then run again")
        return config

    def value(self):
        section = (self.config or {}).get("transformers.js_config")
        return section.get("use_external_data_format") if isinstance(section, dict) else None

    def says(self, counts: dict[str, int]) -> bool:
        """Whether transformers.js reads `counts` (file name -> its data files) from the config, whichever base
        name a page gives (`base_names`)."""
        return all(data_files_read(self.value(), name, base) == n
                   for name, n in counts.items() for base in base_names(name))

    def update(self) -> str | None:
        """Make the config say how many data files each model in OUTDIR/onnx/ has, as each model file names them
        (`_data_files_named`): the written ones as written (never a data file an earlier run left), and the ones
        a failed or stopped run left as they are (the copy of DIR's config said what DIR's models had). Returns
        what was done, or None (the config says so already: left as copied, byte for byte)."""
        folder = self.path.parent / TRANSFORMERS_SUBFOLDER
        counts = {p.name: _data_files_named(p) for p in sorted(folder.glob("*.onnx"))}
        if self.says(counts):
            return None
        if self.problem:  # (only where the plan's external data was not written: a model with no stored tensor)
            return f"{self.path}: {self.problem}, so not updated: transformers.js may fetch the wrong data files"
        section = self.config.get("transformers.js_config")
        self.config["transformers.js_config"] = {**(section if isinstance(section, dict) else {}),
                                                 "use_external_data_format": counts}
        bom = "\ufeff" if self.raw.startswith(b"\xef\xbb\xbf") else ""
        with atomic_path(self.path, suffix=".json") as tmp:
            tmp.write_bytes((bom + json.dumps(self.config, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        shown = ", ".join(f"{k}: {v}" for k, v in counts.items() if v)
        return (f"{self.path}: transformers.js_config.use_external_data_format set to the data files written "
                f"({shown or 'none'}), so transformers.js fetches them")


def _data_files_named(model: Path) -> int:
    """How many data files of transformers.js's names the model file names, in the order it fetches them
    (`<name>_data`, `<name>_data_1`, ...): 1 for a model the writer wrote with `<name>.onnx_data`, 0 for one file
    (or a data file in another name, which transformers.js never fetches)."""
    try:
        named = {Path(loc).name for loc in wire.scan_model(model).locations}
    except (OSError, RuntimeError, ValueError, SurgeonError):
        return 0
    n = 0
    while f"{model.name}_data" + (f"_{n}" if n else "") in named:
        n += 1
    return n
