"""The command line says what is wrong, in one line, and where to read more: every flag has a help text;
a flag a subcommand does not know names that subcommand's help; ``kvcoord health`` says why it fails;
``serve`` refuses a tokenizer directory that is not one at start, as every other ``--model`` mistake."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from kvcoord.cli import build_parser
from tests.procs import kvcoord_cmd


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvcoord_cmd(*args), capture_output=True, text=True, timeout=60)


def _parsers(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                out += _parsers(child, f"{name} {sub}")
    return out


def test_every_flag_of_every_command_has_a_help_text() -> None:
    """``--help`` explains every flag and argument (walks every subcommand's parser, so a new flag must
    come with one)."""
    parsers = _parsers(build_parser(), "kvcoord")
    assert len(parsers) > 10
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in parsers for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert not missing, missing


@pytest.mark.parametrize("args, command", [
    (["serve", "--port", "5000"], "serve"),
    (["drain", "--coordinator", "127.0.0.1:1", "x", "--node-id", "x"], "drain"),
    (["agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m", "--seed", "1"], "agent"),
    (["sim-engine", "--bogus"], "sim-engine"),
])
def test_an_unknown_flag_names_the_subcommands_help(args: list[str], command: str) -> None:
    out = _run(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"kvcoord {command}: unrecognized arguments: "), lines[0]
    assert lines[0].endswith(f"(see kvcoord {command} --help)"), lines[0]


def test_health_of_an_unreachable_coordinator_says_why_on_stderr() -> None:
    out = _run("health", "--coordinator", "127.0.0.1:1", "--timeout", "5")
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcoord health: 127.0.0.1:1 is UNREACHABLE ("), out.stderr
    assert '"status": "UNREACHABLE"' in out.stdout  # stdout stays the JSON a script reads


@pytest.mark.parametrize("where, message", [
    ("/nonexistent/dir", "not a directory"),
    ("EMPTY", "no tokenizer.json or tokenizer_config.json"),
])
def test_serve_refuses_a_tokenizer_directory_that_is_not_one(tmp_path: object, where: str,
                                                             message: str) -> None:
    path = str(tmp_path) if where == "EMPTY" else where
    out = _run("serve", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--http-listen", "",
               "--model", f"demo,algo=sha256_cbor,block_size=16,seed=0,tokenizer={path}")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"tokenizer {path}: {message}" in lines[0], out.stderr
