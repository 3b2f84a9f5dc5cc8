"""The :class:`Placement` record: what one session creation (and optional run) on a WebGPU EP showed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .logparse import LogSummary

_LOG_FIELDS = frozenset(LogSummary.__dataclass_fields__)
_LOG_COUNTS = ("cpu_nodes", "total_nodes")  # LogSummary's properties, written to JSON beside its fields


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
    log: LogSummary  # what ORT's verbose log says; its fields read as the placement's own (`p.cpu_nodes`)
    adapter: dict[str, Any] | None
    run: dict[str, Any] | None
    model: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device_profile: dict[str, Any] | None = None  # {name, source, limits} the model was checked against
    applied_limits: dict[str, int] | None = None  # what the browser page requested its device with (None: node)
    limit_violations: list[dict[str, Any]] = field(default_factory=list)  # nodes / tensors beyond the profile
    peak_rss_mib: dict[str, float] = field(default_factory=dict)  # browser: Chromium's processes by type (VmHWM)
    # bundle wasm: the wasm heap's size (bytes) after the session and after the run, its limit, refused grows
    wasm_heap: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """True when the session was created, no node exceeds the device profile and, if a run was asked for,
        the run succeeded: a model with a node over the device's limits is not resident, whatever ORT placed."""
        return self.session_ok and not self.limit_violations and (self.run is None or bool(self.run.get("ok")))

    def __getattr__(self, name: str) -> Any:
        # only called for names the dataclass does not have: the log's fields and counts
        if name in _LOG_FIELDS or name in _LOG_COUNTS:
            return getattr(self.log, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """One flat record: the log's fields and counts beside the placement's own (the stable JSON keys)."""
        d = asdict(self)
        log = d.pop("log")
        return {**{k: d[k] for k in ("runtime", "bundle", "session_ok", "error")},
                **log, **{k: getattr(self.log, k) for k in _LOG_COUNTS}, **d}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        own = set(cls.__dataclass_fields__) - {"log"}
        log = LogSummary(**{k: v for k, v in d.items() if k in _LOG_FIELDS})
        return cls(log=log, **{k: v for k, v in d.items() if k in own})
