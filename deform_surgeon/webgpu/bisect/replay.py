"""A search's verdicts kept in a JSON file as they come (`--replay`), so that an interrupted search goes on where
it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...base.errors import SurgeonError
from .result import AGREE, DIFFER, FAIL


@dataclass
class Replay:
    """The verdicts of a search, kept in a JSON file as they come, so that an interrupted search (a browser run of
    BiRefNet on a software adapter takes up to 25 minutes, a search about 15 of them) goes on where it stopped:
    Polygraphy's `debug reduce --save-debug-replay / --load-debug-replay`, for prefixes.

    The file names what was searched (the model's file size and node count, its first and last node, the runtime,
    the device profile and the inputs); a file that names another search is refused, not mixed in."""

    path: Path
    key: dict[str, Any]
    known: dict[int, str] = field(default_factory=dict)  # prefix end -> agrees | differs | fails
    loaded: int = 0  # how many of them the file held when the search began

    @classmethod
    def open(cls, path: str | Path, key: dict[str, Any]) -> Replay:
        import json

        path = Path(path)
        replay = cls(path, key)
        if path.exists():
            try:
                data = json.loads(path.read_text())
                recorded = data["search"]
            except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise _not_a_replay_file(path, e) from None
            if recorded != key:
                what = ", ".join([*(f"{k} {recorded.get(k)!r} (now {v!r})" for k, v in key.items()
                                    if recorded.get(k) != v),
                                  *(f"{k} {v!r} (not part of this search)" for k, v in recorded.items()
                                    if k not in key)]) if isinstance(recorded, dict) else f"{recorded!r:.200}"
                raise SurgeonError(path, f"records another search: {what}",
                                   "give --replay a new file name for this search")
            try:
                known = {_step(s["prefix_end"], key.get("nodes")): str(s["status"]) for s in data["steps"]}
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise _not_a_replay_file(path, e) from None
            if any(v not in (AGREE, DIFFER, FAIL) for v in known.values()):
                raise SurgeonError(path, "is not a bisect replay file (a step's status is not agrees, differs or "
                                         "fails)")
            replay.known, replay.loaded = known, len(known)
        return replay

    def record(self, k: int, node: str, status: str) -> None:
        import json

        from ...files import atomic_path

        self.known[k] = status
        steps = [{"prefix_end": i, "status": v} for i, v in sorted(self.known.items())]
        with atomic_path(self.path, suffix=".json") as tmp:
            tmp.write_text(json.dumps({"search": self.key, "steps": steps}, indent=1) + "\n")


def _not_a_replay_file(path: Path, e: BaseException) -> SurgeonError:
    return SurgeonError(path, f"is not a bisect replay file ({e.__class__.__name__}: {str(e)[:200]})",
                        "give --replay a new file name, or the file an earlier bisect wrote")


def _step(value: Any, nodes: int | None) -> int:
    """A recorded prefix end: a whole number of nodes, 0 to the model's node count (a string, a fraction, a bool
    or a step past the model is no step of this search: `ValueError`, the file refused)."""
    if type(value) is not int or not 0 <= value <= (nodes if isinstance(nodes, int) else value):
        raise ValueError(f"prefix_end {value!r} is not a step of a model of {nodes} nodes")
    return value
