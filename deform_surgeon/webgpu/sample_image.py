"""The sample picture `serve` runs by default and the harnesses run through transformers.js's image pipeline: a
foreground object (a shaded ball on a short stand) in front of a sky and a field, drawn from formulas at any size,
so that no photograph (and no licence) is involved, and no imaging library is needed to write it.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIZE = 256


def scene(height: int = SIZE, width: int | None = None) -> np.ndarray:
    """The picture as uint8 RGB [height, width, 3] (square unless `width` is given), drawn from formulas."""
    width = height if width is None else width
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    y, x = y / max(height - 1, 1), x / max(width - 1, 1)
    sky = np.stack([0.55 + 0.3 * y, 0.72 + 0.2 * y, 0.95 + 0.0 * y], -1)
    field = np.stack([0.30 + 0.1 * np.sin(40 * x) * 0.2, 0.55 - 0.2 * (y - 0.7), 0.25 + 0 * y], -1)
    img = np.where((y > 0.7 + 0.03 * np.sin(6 * x))[..., None], field, sky)
    # the stand
    stand = (np.abs(x - 0.5) < 0.04) & (y > 0.55) & (y < 0.86)
    img[stand] = [0.35, 0.25, 0.18]
    # the ball, lit from the upper left
    cx, cy, r = 0.5, 0.42, 0.22
    d2 = (x - cx) ** 2 + (y - cy) ** 2
    ball = d2 < r * r
    z = np.sqrt(np.clip(r * r - d2, 0, None)) / r
    light = np.clip(((cx - x) * 0.6 + (cy - y) * 0.8) / r * 0.5 + z * 0.7, 0.15, 1.0)
    stripes = 0.85 + 0.15 * np.sign(np.sin(18 * (x + y)))
    ball_rgb = np.stack([0.95 * light * stripes, 0.45 * light, 0.15 * light], -1)
    img[ball] = ball_rgb[ball]
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def png(rgb: np.ndarray) -> bytes:
    """`rgb` (uint8 [h, w, 3]) as a PNG file's bytes: the smallest encoder that needs no imaging library."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[i].tobytes() for i in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
