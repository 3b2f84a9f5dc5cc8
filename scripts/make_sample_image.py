"""Writes deform_surgeon/webgpu/serve/sample.png, the picture `deform-surgeon serve` runs by default
(deform_surgeon/webgpu/sample_image.py draws it), 256x256. Deterministic: running it again writes the same bytes.

Usage: python scripts/make_sample_image.py [OUT.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

from deform_surgeon.webgpu.sample_image import png, scene

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else
               Path(__file__).parents[1] / "deform_surgeon/webgpu/serve/sample.png")
    out.write_bytes(png(scene()))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
