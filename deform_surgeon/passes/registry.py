"""The pass registry: every node-level pass by its name, in the order `patch` runs them.

Why a registry: a pass is addressed by its name wherever a user or a test picks passes (`--skip-pass NAME`,
`skip_passes=` in the Python API and in batch manifests, the report's list of the passes that ran), and the
choices of those come from here, as OnnxSlim takes its `--skip-fusion-patterns` choices from its pattern registry
and onnxscript's rewriter holds its default rules in one named set. When a patched model fails to verify on a
user's machine, skipping one pass at a time bisects which rewrite is at fault.

Why an ordered tuple and not registration by a decorator at import time: the order is part of the output (the
passes run in this order to a fixed point, and a later pass sees what an earlier one built), so it is written
down once, here, rather than following whichever module happened to be imported first. A pass's name is its
class's `name`: the same string its `Action`s carry in the report.

Every pass is exact on its own (each rewrite is proven, or verified before it is written), so any subset of them
gives a model that computes the same bytes; skipping a pass leaves exactly its rewrites out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..base.errors import SurgeonError
from ..graph.pipeline import Pass
from .bands import BandOversize
from .deform_conv import LowerDeformConv
from .fit import FitStorageBuffers
from .gather_elements import LowerGatherElements
from .gathernd import LowerGatherND
from .residency import IndexChainResidency
from .run_state import RunState
from .split import SplitBlocks
from .sum_chain import ChainSum


@dataclass(frozen=True)
class Registered:
    """One pass in the registry: its class and how `patch` makes it for one run (the split, bands and deform_conv
    passes share the run's `RunState`: the blocks to keep whole, the chunks asked for)."""

    cls: type
    make: Callable[[RunState], Pass]

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def summary(self) -> str:
        """The first sentence of the pass's docstring (for `--help` and the docs)."""
        return " ".join((self.cls.__doc__ or "").split()).split(". ")[0].rstrip(".")


REGISTRY: tuple[Registered, ...] = (
    Registered(LowerDeformConv, lambda state: LowerDeformConv(state.keep_whole)),
    Registered(LowerGatherND, lambda state: LowerGatherND()),
    Registered(LowerGatherElements, lambda state: LowerGatherElements()),
    Registered(IndexChainResidency, lambda state: IndexChainResidency()),
    Registered(ChainSum, lambda state: ChainSum()),
    Registered(FitStorageBuffers, lambda state: FitStorageBuffers()),
    Registered(SplitBlocks, lambda state: SplitBlocks(state)),
    Registered(BandOversize, lambda state: BandOversize(state)),
)
PASS_NAMES: tuple[str, ...] = tuple(r.name for r in REGISTRY)


def check_pass_names(names: Iterable[str] | None, option: str = "skip_passes") -> tuple[str, ...]:
    """`names` as a tuple in the registry's order, each once; `SurgeonError` (one line naming `option` and the
    known names) for a name the registry does not hold or a value that is not a list of names."""
    if names is None:
        return ()
    # read once, here: a generator checked and then read again would be empty (nothing skipped, silently), and a
    # number is no list (TypeError: 'int' object is not iterable)
    listed = list(names) if isinstance(names, Iterable) and not isinstance(names, str | bytes) else None
    if listed is None or not all(isinstance(n, str) for n in listed):
        raise SurgeonError(None, f"{option} takes a list of pass names, not {names!r}",
                           f"known passes: {', '.join(PASS_NAMES)}")
    names = listed
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise SurgeonError(None, f"unknown pass {', '.join(repr(n) for n in unknown)} in {option}",
                           f"known passes: {', '.join(PASS_NAMES)}")
    return tuple(n for n in PASS_NAMES if n in set(names))


def make_passes(state: RunState | None = None, skip: Iterable[str] = ()) -> list[Pass]:
    """The registered passes but those named in `skip`, made for one run that shares `state`."""
    state = state if state is not None else RunState()
    skipped = set(check_pass_names(skip))
    return [r.make(state) for r in REGISTRY if r.name not in skipped]
