"""A patch run's options, by concern, as the command line groups them (commands/args.py: `RewriteArgs`, `WriteArgs`,
`ComparisonArgs`): what to rewrite and what to fit it to (`graph.pipeline.Options`, from `rewrite_options`), where
and how to write (`WriteOptions`), how the whole model is compared (`ComparisonOptions`). Each is checked before
any work, with a one-line `SurgeonError` naming the API keyword."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...base.errors import SurgeonError
from ...checks.verify import check_verify_options
from ...files import DATA_SUFFIXES, EXTERNAL_DATA_CHOICES, DataForm
from ...graph.device import DeviceProfile, resolve_profile
from ...graph.input_shapes import check_input_shapes
from ...graph.pipeline import SUM_MODES, Options
from ...passes.registry import check_pass_names


@dataclass(frozen=True)
class WriteOptions:
    """Where and how OUT is written: `output` None writes nothing (`inspect`, or `patch` without an output: a
    check); `strict`: nothing on a finding; `copy_unchanged`: a copy when nothing is rewritten; `form`: where the
    weights go (`--external-data`, the data file's suffix)."""

    output: Path | None = None
    copy_unchanged: bool = False
    strict: bool = False
    form: DataForm = field(default_factory=DataForm)


@dataclass(frozen=True)
class ComparisonOptions:
    """The whole-model comparison on ORT CPU: `verify`, whether the user asked for it (OUT is then written only
    if byte-identical), and `options`, `checks.verify.verify`'s keywords, which also set the comparison that
    decides a rewrite not shown exact on its own."""

    verify: bool = False
    options: dict = field(default_factory=dict)


def check_switches(**flags: object) -> None:
    """On/off options must be booleans: a string such as "no" or "false" is true to Python, and
    `allow_unproven="no"` would rewrite unproven gathers."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise SurgeonError(None, f"{name} must be True or False (got {value!r})")


def _size(name: str, value: int | str | None) -> int | None:
    """A size option as the CLI and batch manifests take it: bytes or a string such as "256MiB" or "1.5GB"."""
    from ...graph.budget import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except SurgeonError as exc:
        raise SurgeonError(None, f"{name}: {exc.problem}", exc.hint) from None


def rewrite_options(*, allow_unproven: bool = False, sum_mode: str | None = None, max_buffer: int | str | None = None,
                    max_memory: int | str | None = None, device_profile: str | Path | DeviceProfile | None = None,
                    input_shapes: dict | None = None, skip_passes: list[str] | tuple[str, ...] | None = None
                    ) -> Options:
    """The rewrite options of `patch` and `inspect` (what the passes do and the device they fit), checked."""
    check_switches(allow_unproven=allow_unproven)
    sum_mode = "chain" if sum_mode is None else sum_mode
    if not isinstance(sum_mode, str) or sum_mode not in SUM_MODES:
        raise SurgeonError(None, f"unknown sum mode {sum_mode!r}", f"choose one of {', '.join(SUM_MODES)}")
    max_buffer, max_memory = _size("max_buffer", max_buffer), _size("max_memory", max_memory)
    profile = resolve_profile(device_profile)
    if max_buffer is None:  # fit the profile: no tensor over what one binding may hold, nor over one buffer
        max_buffer = min(profile.max_binding, profile.max_buffer)
    return Options(allow_unproven=allow_unproven, sum_mode=sum_mode, max_buffer=max_buffer, max_memory=max_memory,
                   device_profile=profile.name, storage_buffers=profile.storage_buffers,
                   input_shapes=check_input_shapes(input_shapes),
                   skip_passes=check_pass_names(skip_passes, "skip_passes"))


def write_options(output: Path | None, *, copy_unchanged: bool, strict: bool, external_data: str | None,
                  data_suffix: str | None) -> WriteOptions:
    """`patch`'s writing options, checked (`copy_unchanged` and `strict` by `check_switches` before)."""
    external_data = "auto" if external_data is None else external_data
    if not isinstance(external_data, str) or external_data not in EXTERNAL_DATA_CHOICES:
        raise SurgeonError(None, f"unknown external_data {external_data!r}",
                           f"choose one of {', '.join(EXTERNAL_DATA_CHOICES)}")
    if data_suffix is not None and data_suffix not in DATA_SUFFIXES:
        raise SurgeonError(None, f"unknown data_suffix {data_suffix!r}", f"choose one of {', '.join(DATA_SUFFIXES)}")
    return WriteOptions(output, copy_unchanged, strict, DataForm(external_data, data_suffix))


def comparison_options(verify: bool, verify_options: dict | None) -> ComparisonOptions:
    """`patch`'s comparison options, checked: also used without `verify`, by the whole-model check of a rewrite
    not shown exact on its own."""
    check_verify_options(verify_options)
    return ComparisonOptions(verify, verify_options or {})
