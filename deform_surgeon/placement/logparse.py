"""Pure parser of onnxruntime's verbose session-creation log (native EP in Node, JSEP or native EP in a
browser).

Why a log parser: neither onnxruntime-node nor onnxruntime-web exposes the node->EP assignment through its
API, but with ``logSeverityLevel: 0, logVerbosityLevel: 0`` ORT prints it while partitioning the graph. The
formats below were taken from real runs of onnxruntime-node 1.30.0 and onnxruntime-web 1.30.0 (see
``tests/fixtures/placement_*.log``; the ``file.cc:line`` prefix is shortened here):

``VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 1``
    followed by one ``VerifyEachNodeIsAssignedToAnEp]   Sum (the_sum)`` line per node (three spaces, the
    header has two). When every node is on one EP, ORT instead prints a single
    ``VerifyEachNodeIsAssignedToAnEp]  All nodes placed on [WebGpuExecutionProvider]. Number of nodes: 1``
    and lists no nodes at all.
``transformer_memcpy.cc:393 AddCopyNode] Add MemcpyFromHost after x0 for WebGpuExecutionProvider``
    one line per inserted copy node (``MemcpyToHost before <tensor>`` in the other direction).
``GetCapability] webgpu kernel not found in registries for Op type: Sum node name: the_sum``
    from ``webgpu_execution_provider.cc`` (JSEP prints the same text from ``js_execution_provider.cc``);
    GetCapability runs more than once per session, so a node is reported several times: deduplicated here.

In the browser the lines arrive as console messages; ORT's warnings carry ANSI colour codes in both
runtimes, which are stripped before matching.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

CPU_EP = "CPUExecutionProvider"
MEMCPY_OPS = ("MemcpyFromHost", "MemcpyToHost")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER = re.compile(
    r"VerifyEachNodeIsAssignedToAnEp\]\s+Node\(s\) placed on \[(?P<ep>[^\]]+)\]\. Number of nodes: (?P<n>\d+)"
)
_ALL = re.compile(
    r"VerifyEachNodeIsAssignedToAnEp\]\s+All nodes placed on \[(?P<ep>[^\]]+)\]\. Number of nodes: (?P<n>\d+)"
)
# A node line has three spaces after the bracket (the header has two); the op type has no spaces, the node
# name is everything inside the outermost parentheses (it may itself contain spaces or parentheses).
_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\] {3}(?P<op>[^\s(]+) \((?P<name>.*)\)\s*$")
_PLACEMENTS_START = re.compile(r"VerifyEachNodeIsAssignedToAnEp\] Node placements\s*$")
_MEMCPY = re.compile(
    r"AddCopyNode\] Add (?P<kind>MemcpyFromHost|MemcpyToHost) (?:after|before) (?P<tensor>.+?)"
    r" for (?P<ep>\S+)\s*$"
)
_KNF = re.compile(
    r"GetCapability\] (?P<who>\S+) kernel not found in registries"
    r" for Op type: (?P<op>\S+) node name: (?P<node>.*?)\s*$"
)


@dataclass(frozen=True)
class LogSummary:
    """What the verbose log says about one session's partitioning.

    ``placement_logged`` is False when the log has no ``VerifyEachNodeIsAssignedToAnEp`` block (session
    creation failed before partitioning finished, or the log level was too low): then the counts mean nothing.
    ``nodes_listed`` is False when ORT printed only the "All nodes placed on [EP]" summary (one EP took every
    node), in which case no per-node op list exists in the log.
    """

    placement_logged: bool = False
    nodes_listed: bool = False
    nodes_by_provider: dict[str, int] = field(default_factory=dict)
    nodes_by_provider_op: dict[str, dict[str, int]] = field(default_factory=dict)
    cpu_ops: dict[str, int] = field(default_factory=dict)
    cpu_node_names: list[str] = field(default_factory=list)
    memcpy: int = 0
    memcpy_by_kind: dict[str, int] = field(default_factory=dict)
    memcpy_tensors: list[str] = field(default_factory=list)
    memcpy_provider: str | None = None
    kernel_not_found: list[dict[str, str]] = field(default_factory=list)
    gpu_provider: str | None = None

    @property
    def cpu_nodes(self) -> int:
        return self.nodes_by_provider.get(CPU_EP, 0)

    @property
    def total_nodes(self) -> int:
        return sum(self.nodes_by_provider.values())


def _strip(line: str) -> str:
    return _ANSI.sub("", line).rstrip("\r\n")


def parse_ort_log(lines: Iterable[str]) -> LogSummary:
    """Parses ORT verbose log lines (any mix of other output is ignored) into a :class:`LogSummary`.

    Accepts an iterable of lines or a single string (split on newlines). Node counts per provider come from
    the "Number of nodes: N" headers (they include the inserted Memcpy nodes, which ORT places on the GPU
    EP); ``memcpy`` counts ``AddCopyNode`` lines, one per inserted copy node, because the node list is absent
    when ORT prints the "All nodes placed" form. Several placement blocks (subgraphs of If/Loop) are summed.
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    by_provider: Counter[str] = Counter()
    by_provider_op: dict[str, Counter[str]] = {}
    cpu_names: list[str] = []
    memcpy_tensors: list[str] = []
    memcpy_kinds: Counter[str] = Counter()
    memcpy_providers: Counter[str] = Counter()
    knf: list[dict[str, str]] = []
    knf_seen: set[tuple[str, str]] = set()
    placement_logged = False
    nodes_listed = False
    current: str | None = None  # provider whose node list is being read

    for raw in lines:
        line = _strip(raw)
        if "VerifyEachNodeIsAssignedToAnEp]" in line:
            if _PLACEMENTS_START.search(line):
                placement_logged = True
                current = None
                continue
            m = _HEADER.search(line)
            if m:
                placement_logged = True
                nodes_listed = True
                current = m["ep"]
                by_provider[current] += int(m["n"])
                by_provider_op.setdefault(current, Counter())
                continue
            m = _ALL.search(line)
            if m:
                placement_logged = True
                current = None
                by_provider[m["ep"]] += int(m["n"])
                continue
            m = _NODE.search(line)
            if m and current is not None:
                by_provider_op[current][m["op"]] += 1
                if current == CPU_EP:
                    cpu_names.append(m["name"])
                continue
            current = None  # e.g. the "Some nodes were not assigned..." warning ends a list
            continue
        if "AddCopyNode]" in line:
            m = _MEMCPY.search(line)
            if m:
                memcpy_kinds[m["kind"]] += 1
                memcpy_tensors.append(m["tensor"])
                memcpy_providers[m["ep"]] += 1
            continue
        if "kernel not found in registries" in line:
            m = _KNF.search(line)
            if m:
                key = (m["op"], m["node"])
                if key not in knf_seen:
                    knf_seen.add(key)
                    knf.append({"op": m["op"], "node": m["node"]})
            continue

    gpu_candidates = [ep for ep in by_provider if ep != CPU_EP] + list(memcpy_providers)
    gpu_provider = gpu_candidates[0] if gpu_candidates else None
    return LogSummary(
        placement_logged=placement_logged,
        nodes_listed=nodes_listed,
        nodes_by_provider=dict(by_provider),
        nodes_by_provider_op={ep: dict(c.most_common()) for ep, c in by_provider_op.items()},
        cpu_ops=dict(by_provider_op.get(CPU_EP, Counter()).most_common()),
        cpu_node_names=cpu_names,
        memcpy=sum(memcpy_kinds.values()),
        memcpy_by_kind=dict(memcpy_kinds),
        memcpy_tensors=memcpy_tensors,
        memcpy_provider=next(iter(memcpy_providers), None),
        kernel_not_found=knf,
        gpu_provider=gpu_provider,
    )
