"""One form for every `deform-surgeon` subcommand, after Polygraphy's tools: a `Tool` subscribes to argument groups.

An `ArgGroup` is a set of `Option`s that add themselves to a parser and parse themselves back into the keyword
arguments of the Python API (`None` means the API's default), so a command is its docstring (its help), its own
few arguments, the groups it takes, and `run`. `patch`, `inspect` and `batch` take the same groups (args.py): an
option is written once, and appears wherever its group does, in a batch manifest under its API keyword too.

This module imports nothing of the package, so a command's `Tool` may live in any layer, beside its work.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """One command-line option: its flags, the API keyword it fills (`dest`), its help and argparse's `settings`.

    `parse` turns the parsed text into the API's value (given only when the option was given); `manifest` is the
    types a batch manifest takes for it (empty: not a manifest key) and `check` a manifest value's problem (None if
    none); `api` is how the Python API says it when that is not `dest` (`-v` is `format(verbose=True)`)."""

    flags: tuple[str, ...]
    dest: str
    help: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)  # argparse's: type, choices, metavar, action, nargs
    parse: Callable[[Any], Any] | None = None
    manifest: tuple[type, ...] = ()
    check: Callable[[Any], str | None] | None = None
    api: str | None = None

    @property
    def switch(self) -> bool:
        return self.settings.get("action") == "store_true"

    @property
    def api_name(self) -> str:
        return self.api or self.dest

    def add_to(self, group: Any, help: str | None = None) -> None:
        default = {} if self.switch else {"default": None}  # a switch is False unless given; a value None
        group.add_argument(*self.flags, dest=self.dest, help=help or self.help, **default, **self.settings)

    def value(self, args: argparse.Namespace) -> Any:
        given = getattr(args, self.dest)
        return self.parse(given) if self.parse is not None and given not in (None, False) else given


class ArgGroup:
    """Options shown together under `title`; `helps` words an option's help for one command (`batch`'s `--verify`
    keeps each output, `patch`'s writes OUT), without a second option."""

    title: str = ""
    options: tuple[Option, ...] = ()

    def __init__(self, helps: Mapping[str, str] | None = None) -> None:
        self.helps = dict(helps or {})
        unknown = set(self.helps) - {o.dest for o in self.options}
        if unknown:
            raise ValueError(f"{type(self).__name__} has no option {', '.join(sorted(unknown))}")
        self.group: Any = None  # the argparse group, once added: a command may add its own options to it

    def add_to(self, parser: argparse.ArgumentParser, into: Any = None) -> Any:
        """Add the options under `title`, or `into` an argparse group the command made (to place its own among
        them); returns the argparse group."""
        self.group = parser.add_argument_group(self.title) if into is None else into
        for option in self.options:
            option.add_to(self.group, self.helps.get(option.dest))
        return self.group

    def parse(self, args: argparse.Namespace) -> dict[str, Any]:
        """The API's keyword arguments, from the parsed command line (None: not given, the API's default)."""
        return {o.dest: o.value(args) for o in self.options}

    def problem(self, spec: Mapping[str, Any]) -> str | None:
        """What is wrong with the values of this group's options in `spec` (a manifest's entry), None if nothing;
        each value's type was checked already. A group adds the checks that take two options together."""
        for option in self.options:
            if option.dest not in spec:
                continue
            choices = option.settings.get("choices")
            if choices is not None and option.settings.get("action") != "append" and spec[option.dest] not in choices:
                return f"option {option.dest} = {spec[option.dest]!r} should be one of {', '.join(choices)}"
            problem = option.check(spec[option.dest]) if option.check is not None else None
            if problem:
                return problem
        return None


def paragraphs(doc: str) -> list[str]:
    """A docstring's paragraphs, each one line: its lines joined with spaces (argparse reflows them anyway)."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]


class Tool:
    """A subcommand: `name`, its text (the subclass's docstring), the argument groups it subscribes to
    (`subscribe`), its own arguments (`add_args`) and `run(args) -> exit code`.

    As in Polygraphy, a command's text is its class docstring, written once: its first paragraph is the one-line
    `help` that `deform-surgeon --help` lists (`%` escaped for argparse: the docstring is plain text), the paragraphs
    after it the `description` that `deform-surgeon NAME --help` shows under the usage (None if there are none).
    A subclass without a docstring of its own keeps what it inherits; one with a docstring sets neither attribute
    itself. A developer's note on a command is a comment, not its docstring."""

    name: str = ""
    help: str = ""
    description: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        doc = cls.__dict__.get("__doc__")
        if not doc or not doc.strip():
            return
        given = [a for a in ("help", "description") if a in vars(cls)]
        if given:
            raise TypeError(f"{cls.__name__} sets {' and '.join(given)}: its docstring is its text, written once")
        first, *rest = paragraphs(doc)
        cls.help = first.replace("%", "%%")  # argparse %-formats a help, not a description without %(prog)
        cls.description = "\n\n".join(rest) or None

    def __init__(self) -> None:
        self.groups: list[ArgGroup] = self.subscribe()

    def subscribe(self) -> list[ArgGroup]:
        """The argument groups this command takes, in the order its `--help` shows them."""
        return []

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        """This command's own arguments. The groups are added after them, unless it placed one itself (`add_to`, to
        add its own options to that group)."""

    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.description)
        self.add_args(parser)
        for group in self.groups:
            if group.group is None:
                group.add_to(parser)
        parser.set_defaults(tool=self)
        return parser

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError
