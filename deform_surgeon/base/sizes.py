"""Byte counts as users write them (`--max-buffer 256MiB`) and as every report prints them: one place, imported by
the modules that read or print a size (budget, verify, the passes) without importing what they do."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import SurgeonError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")
# The most bytes a size may name: what a signed 64-bit count holds (9.22 EB), more than any file, buffer or memory.
# Past it a size can only be a slip of the keyboard, and a float would print another number than the one given.
MAX_SIZE = 2**63 - 1


def parse_size(text: str | int) -> int:
    """Bytes from `268435456`, `256MiB`, `256 MiB`, `0.25GiB`, `800MB` (kB/MB/GB decimal, KiB/MiB/GiB binary), read
    exactly (no float: every digit given is the size's), from 1 to `MAX_SIZE`."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = (m.group("unit").lower() if m else None)
        if m is None or unit not in _UNITS:
            raise SurgeonError(None, f"bad size '{text}'", "write bytes or e.g. 256MiB, 1GiB, 800MB")
        exact = Fraction(m.group("num")) * _UNITS[unit]
        value = round(exact)
        if abs(exact - value) > Fraction(1, 10**6) * max(1, exact):
            raise SurgeonError(None, f"bad size '{text}'", "not a whole number of bytes")
    if value < 1:
        raise SurgeonError(None, f"bad size '{text}'", "must be at least 1 byte")
    if value > MAX_SIZE:
        raise SurgeonError(None, f"bad size '{text}'", f"more than 2**63 - 1 bytes ({MAX_SIZE / 1e18:.2f} EB), "
                                                       "which no file or memory holds")
    return value


def human(n: int | None) -> str:
    """A byte count for people, the one form every report uses: decimal and binary units past 1 MB ("268.4 MB
    (256.0 MiB)": WebGPU's limits are binary, file sizes decimal), exact bytes below; "?" for an unknown size."""
    if n is None:
        return "?"
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"
    if n >= 10**6:
        return f"{n / 1e6:.1f} MB ({n / 2**20:.1f} MiB)"
    return f"{n:,} B"
