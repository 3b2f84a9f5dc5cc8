"""Every subcommand in one form (tool.py): listed by `deform-surgeon --help`, even one whose module cannot be
imported (which then says in one line what to install); `batch` takes every option of `patch`, from the same
argument groups; a report read through the API names each option by its keyword, from the same groups."""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from pathlib import Path

import pytest
from helpers import one_error_line, run

from deform_surgeon.base.tool import Tool, paragraphs
from deform_surgeon.commands import batch
from deform_surgeon.commands.batch import BatchTool
from deform_surgeon.commands.cli import TOOLS, MissingTool, build_parser, load_tool
from deform_surgeon.commands.command import PatchTool
from deform_surgeon.commands.report import api_words

# The commands the README documents: none may drop out of `--help` (the registry may hold more)
DOCUMENTED = {"patch", "inspect", "verify", "batch", "budget", "placement", "serve", "setup"}


def listed_commands(help_text: str) -> list[str]:
    """The command names `deform-surgeon --help` lists under COMMAND."""
    section = help_text.split("COMMAND\n", 2)[-1].split("\noptions:")[0]
    return re.findall(r"^ {4}(\S+)", section, re.M)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_is_listed_in_help_and_loads(tmp_path):
    proc = run("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert listed_commands(proc.stdout) == list(TOOLS)
    assert DOCUMENTED <= set(TOOLS)
    for name, where in TOOLS.items():
        tool = load_tool(name, where)
        assert isinstance(tool, Tool) and not isinstance(tool, MissingTool), f"{name}: {tool.help}"
        assert tool.name == name and tool.help
        assert re.search(rf"^ {{4}}{name}\s", proc.stdout, re.M), proc.stdout  # its help line names it
    for name in TOOLS:
        sub = run(name, "--help", cwd=tmp_path)
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: deform-surgeon {name}"), sub.stderr


def test_a_commands_docstring_is_its_help_line_and_description():
    class Count(Tool):
        """count the nodes (100% of them)
        of a model

        Reads MODEL and counts
        its nodes.

        Exit 0.
        """

        name = "count"

    class Short(Tool):
        """one line only"""

    class Plain(Short):
        pass

    assert Count.help == "count the nodes (100%% of them) of a model"  # argparse-ready: % escaped
    assert Count.description == "Reads MODEL and counts its nodes.\n\nExit 0."
    assert (Short.help, Short.description) == ("one line only", None)
    assert (Plain.help, Plain.description) == ("one line only", None)  # no docstring of its own: inherited
    with pytest.raises(TypeError, match="sets help"):
        class Twice(Tool):
            """the text"""

            help = "the text again"

    parser = argparse.ArgumentParser(prog="deform-surgeon")
    Count().add_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    assert "count the nodes (100% of them) of a model" in " ".join(parser.format_help().split())
    assert "Reads MODEL and counts its nodes. Exit 0." in " ".join(subparsers(parser)["count"].format_help().split())

    for name, where in TOOLS.items():  # every registered command: its help line is its docstring's first paragraph
        cls = type(load_tool(name, where))
        assert cls.__dict__.get("__doc__") and cls.help.strip(), name
        assert cls.help == paragraphs(cls.__doc__)[0].replace("%", "%%") and "\n" not in cls.help, name


SITECUSTOMIZE = """
import importlib.abc, sys

class _Unloadable(importlib.abc.MetaPathFinder):
    # what a broken or partial install does: importing {module} fails
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise {error}

sys.meta_path.insert(0, _Unloadable())
"""


def _requirement(name: str) -> str:
    """`name`'s requirement as setup.cfg declares it, in the form installed metadata gives it
    (`onnxruntime<1.33,>=1.32`)."""
    import configparser

    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(Path(__file__).parents[2] / "setup.cfg")
    requirements = [Requirement(x.strip()) for x in config["options"]["install_requires"].splitlines()
                    if x.strip() and not x.strip().startswith("#")]
    return str(next(r for r in requirements if r.name == name))


@pytest.mark.parametrize("error, install", [
    # a package deform-surgeon requires is missing: its own requirement, from the installed metadata
    ("ModuleNotFoundError(\"No module named 'onnxruntime'\", name='onnxruntime')",
     f"pip install '{_requirement('onnxruntime')}'"),
    # one of deform-surgeon's own modules is missing or broken: reinstall it
    ("ImportError('cannot import name run_harness')", "pip install --force-reinstall deform_surgeon"),
])
def test_a_command_that_cannot_be_imported_is_listed_and_says_what_to_install(tmp_path, error, install):
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(SITECUSTOMIZE).format(module="deform_surgeon.webgpu.placement.runner", error=error))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = run("--help", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert listed_commands(proc.stdout) == list(TOOLS)  # nothing silently gone
    line = " ".join(re.search(r"^ {4}placement\s(.*?)(?=^ {4}\S)", proc.stdout, re.M | re.S)[1].split())
    assert line.startswith("(cannot be loaded: ") and f"install what it needs: {install}" in line, line
    for argv in (["placement", "model.onnx", "--runtime", "node"], ["placement", "--help"], ["placement"]):
        proc = run(*argv, cwd=tmp_path, env=env)
        assert proc.returncode == 2 and proc.stdout == "", (argv, proc.stdout, proc.stderr)
        text = one_error_line(proc)
        assert text.startswith("the placement command cannot be loaded: ") and f"install what it needs: {install}" \
            in text, text
    # the other commands are untouched (serve uses placement's runner, so it is unavailable too, and says so)
    assert run("patch", "--help", cwd=tmp_path, env=env).returncode == 0
    assert run("setup", "--help", cwd=tmp_path, env=env).returncode == 0
    serve = run("serve", "a.onnx", cwd=tmp_path, env=env)
    assert serve.returncode == 2 and one_error_line(serve).startswith("the serve command cannot be loaded: ")


def patch_options():
    """Every option of `patch`'s argument groups, as the groups declare them."""
    return [option for group in PatchTool().groups for option in group.options]


def test_batch_takes_every_option_of_patch_on_its_command_line_and_in_a_manifest(tmp_path):
    parsers = subparsers(build_parser())
    patch_parser, batch_parser = parsers["patch"], parsers["batch"]
    assert [type(g) for g in BatchTool().groups] == [type(g) for g in PatchTool().groups]
    options = patch_options()
    assert len(options) >= 14
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    for option in options:
        for flag in option.flags:  # the same flag, into the same keyword, on both command lines
            assert patch_parser._option_string_actions[flag].dest == option.dest
            assert batch_parser._option_string_actions[flag].dest == option.dest
        assert batch.OPTIONS[option.dest] == option.manifest and option.manifest
        assert option.dest in batch.ENTRY_KEYS and option.dest in batch.DEFAULT_KEYS
        # a manifest entry with the option is read, and its value checked, by the option's own declaration
        (tmp_path / "m.toml").write_text(f'[[model]]\ninput = "m.onnx"\n{option.dest} = 0.5\n')
        [entry] = batch.plan(str(tmp_path / "m.toml"), [], {})
        types = " or ".join(t.__name__ for t in option.manifest)
        assert entry.error.endswith(f"option {option.dest} = 0.5 should be {types}"), entry.error


def test_batch_passes_each_command_line_option_to_every_entry(tmp_path):
    """`batch --flag value` reaches each entry's options (what the worker gives `patch`), parsed by the groups."""
    argv = ["batch", "--glob", "*.onnx", "--verify", "--allow-unproven", "--sum-mode", "tree", "--max-buffer", "1MiB",
            "--max-memory", "2MiB", "--device-profile", "spec-default", "--input-shapes", "x:1,3,8,8",
            "--skip-pass", "fit", "--iterations", "2", "--seed", "7", "--val-range", "x:[0,2]", "--opt-level", "basic",
            "--copy-unchanged", "--strict"]
    args = build_parser().parse_args(argv)
    tool = args.tool
    cli = {k: v for group in tool.groups for k, v in group.parse(args).items()}
    assert set(cli) == {o.dest for o in patch_options()}
    (tmp_path / "a.onnx").write_bytes(b"")
    [entry] = batch.plan(None, [str(tmp_path / "*.onnx")], cli)
    assert entry.options == {"verify": True, "allow_unproven": True, "sum_mode": "tree", "max_buffer": 2**20,
                             "max_memory": 2 * 2**20, "device_profile": "spec-default",
                             "input_shapes": {"x": (1, 3, 8, 8)}, "skip_passes": ["fit"], "iterations": 2, "seed": 7,
                             "val_range": {"x": (0.0, 2.0)}, "opt_level": "basic", "copy_unchanged": True,
                             "strict": True}


def test_a_report_read_through_the_api_names_every_patch_option_by_its_keyword():
    for option in patch_options():
        for flag in (f for f in option.flags if f.startswith("--")):
            assert api_words(f"see {flag}.") == f"see {option.dest}.", flag
    assert api_words("--verbose or --report FILE.json") == "format(verbose=True) or --report FILE.json"
    assert api_words("--max-buffer-size --input-shapes x") == "--max-buffer-size input_shapes x"



def test_ctrl_c_while_a_command_is_imported_stops_the_command(tmp_path):
    """A library may turn Ctrl-C during its import into an ImportError (onnxruntime's "initialization failed"):
    that stops the command (130), it does not make the command one that cannot be loaded while another runs."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.abc, os, signal, sys, time

        class _Interrupted(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "deform_surgeon.webgpu.placement.runner":
                    try:
                        os.kill(os.getpid(), signal.SIGINT)
                        time.sleep(30)
                    except KeyboardInterrupt:
                        raise ImportError("initialization failed") from None

        sys.meta_path.insert(0, _Interrupted())
    """))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = run("setup", "--check", cwd=tmp_path, env=env)  # a command that otherwise returns, exit 0 or 2
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "deform-surgeon: interrupted\n", "")
