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
    reader = _LogReader()
    for raw in lines:
        reader.read(_strip(raw))
    return reader.summary()


@dataclass
class _LogReader:
    """What the lines read so far say, line by line: a placement block is a header followed by its node lines, so
    the reader carries which provider's node list it is in (``current``) from one line to the next."""

    by_provider: Counter[str] = field(default_factory=Counter)
    by_provider_op: dict[str, Counter[str]] = field(default_factory=dict)
    cpu_names: list[str] = field(default_factory=list)
    memcpy_tensors: list[str] = field(default_factory=list)
    memcpy_kinds: Counter[str] = field(default_factory=Counter)
    memcpy_providers: Counter[str] = field(default_factory=Counter)
    knf: list[dict[str, str]] = field(default_factory=list)
    knf_seen: set[tuple[str, str]] = field(default_factory=set)
    placement_logged: bool = False
    nodes_listed: bool = False
    current: str | None = None  # provider whose node list is being read

    def read(self, line: str) -> None:
        """One log line (ANSI codes stripped), read by the ORT function that wrote it: the placement block, a copy
        node or a missing kernel (a line naming more than one is read as the first of them); other lines are noise."""
        if "VerifyEachNodeIsAssignedToAnEp]" in line:
            self._placement_line(line)
        elif "AddCopyNode]" in line:
            self._copy_line(line)
        elif "kernel not found in registries" in line:
            self._kernel_not_found_line(line)

    def _placement_line(self, line: str) -> None:
        """A line of the placement block: its start, a provider's header (its nodes listed after it, or all nodes on
        one provider and none listed), or a node of the current provider's list; any other line ends the list."""
        if _PLACEMENTS_START.search(line):
            self.placement_logged = True
            self.current = None
        elif m := _HEADER.search(line):
            self.placement_logged = True
            self.nodes_listed = True
            self.current = m["ep"]
            self.by_provider[self.current] += int(m["n"])
            self.by_provider_op.setdefault(self.current, Counter())
        elif m := _ALL.search(line):
            self.placement_logged = True
            self.current = None
            self.by_provider[m["ep"]] += int(m["n"])
        elif (m := _NODE.search(line)) and self.current is not None:
            self.by_provider_op[self.current][m["op"]] += 1
            if self.current == CPU_EP:
                self.cpu_names.append(m["name"])
        else:
            self.current = None  # e.g. the "Some nodes were not assigned..." warning ends a list

    def _copy_line(self, line: str) -> None:
        """One inserted copy node: counted here because the "All nodes placed" form lists no nodes."""
        if m := _MEMCPY.search(line):
            self.memcpy_kinds[m["kind"]] += 1
            self.memcpy_tensors.append(m["tensor"])
            self.memcpy_providers[m["ep"]] += 1

    def _kernel_not_found_line(self, line: str) -> None:
        """A node the EP has no kernel for, once: GetCapability runs more than once per session."""
        if m := _KNF.search(line):
            key = (m["op"], m["node"])
            if key not in self.knf_seen:
                self.knf_seen.add(key)
                self.knf.append({"op": m["op"], "node": m["node"]})

    def summary(self) -> LogSummary:
        """The lines read, as a :class:`LogSummary`; the GPU provider is the first one named that is not the CPU."""
        gpu_candidates = [ep for ep in self.by_provider if ep != CPU_EP] + list(self.memcpy_providers)
        return LogSummary(
            placement_logged=self.placement_logged,
            nodes_listed=self.nodes_listed,
            nodes_by_provider=dict(self.by_provider),
            nodes_by_provider_op={ep: dict(c.most_common()) for ep, c in self.by_provider_op.items()},
            cpu_ops=dict(self.by_provider_op.get(CPU_EP, Counter()).most_common()),
            cpu_node_names=self.cpu_names,
            memcpy=sum(self.memcpy_kinds.values()),
            memcpy_by_kind=dict(self.memcpy_kinds),
            memcpy_tensors=self.memcpy_tensors,
            memcpy_provider=next(iter(self.memcpy_providers), None),
            kernel_not_found=self.knf,
            gpu_provider=gpu_candidates[0] if gpu_candidates else None,
        )
