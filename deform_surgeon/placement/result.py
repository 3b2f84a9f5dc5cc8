"""The :class:`Placement` record: what one session creation (and optional run) on a WebGPU EP showed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Placement:
    """Placement of a model's nodes on a real WebGPU runtime, read from ORT's own verbose log.

    Frozen because it is a measurement: a caller that wants another view builds a new one. The top-level keys
    of :meth:`to_dict` are a stable interface (CI artefacts and ``--json`` files are diffed across commits).

    ``run`` is None without ``run=True``; otherwise ``{ok, error, outputs: {name: {identical, max_abs_diff,
    dtype, shape, ...}}, gpu_errors, reference_error}``. ``max_abs_diff`` is None when the outputs cannot be
    compared element-wise (dtype or shape differ). ``adapter`` is None when no adapter information exists
    (see ``notes``).
    """

    runtime: str
    bundle: str | None
    session_ok: bool
    error: str | None
    cpu_nodes: int
    memcpy: int
    nodes_by_provider: dict[str, int]
    cpu_ops: dict[str, int]
    cpu_node_names: list[str]
    memcpy_tensors: list[str]
    kernel_not_found: list[dict[str, str]]
    adapter: dict[str, Any] | None
    run: dict[str, Any] | None
    model: str = ""
    gpu_provider: str | None = None
    total_nodes: int = 0
    placement_logged: bool = False
    memcpy_by_kind: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device_profile: dict[str, Any] | None = None  # {name, source, limits} the model was checked against
    applied_limits: dict[str, int] | None = None  # what the browser page requested its device with (None: node)
    limit_violations: list[dict[str, Any]] = field(default_factory=list)  # nodes / tensors beyond the profile

    @property
    def ok(self) -> bool:
        """True when the session was created, no node exceeds the device profile and, if a run was asked for,
        the run succeeded: a model with a node over the device's limits is not resident, whatever ORT placed."""
        return self.session_ok and not self.limit_violations and (self.run is None or bool(self.run.get("ok")))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})
