"""pytest set-up: the tests folder on the import path (for `helpers`, `graphs`, `exporter_replica`), quiet ORT."""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import FIXTURES  # noqa: E402 (needs the path above)

ort.set_default_logger_severity(3)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
