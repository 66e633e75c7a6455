"""Generate docs/configuration.md: every flag of every `specd` command.

Run `python scripts/gen_config_docs.py` after adding or changing a flag; `--check`
exits non-zero when the committed file differs from what the parsers generate
(tests/unit/test_config_docs.py runs it).

The flags are read from the argparse parser each command really parses with, so
the page cannot drift from the code, wherever a module moves: the `specd` entry
point is read from pyproject.toml, the commands are the ones its `--help` lists,
each is started through it with `parse_known_args` intercepted, and the parser
it built is walked. Flags built
from a config dataclass (specd.configuration) carry their environment variable
in their help text; it gets its own column here. The environment is cleared of
SPECD_* and OTEL_* variables first, so a default is the code's, not this
shell's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
COMMAND_LINE = re.compile(r"^  ([a-z][a-z-]*)\s{2,}(\S.*)$")
SCRIPT_LINE = re.compile(r'^specd\s*=\s*"([\w.]+:\w+)"', re.M)
ENV_SUFFIX = re.compile(r"\s*\(env (\S+); default .*\)\s*$", re.S)

HEADER = """\
# Configuration

Every flag of every `specd` command, generated from the parsers the commands
run by `scripts/gen_config_docs.py` (do not edit by hand: rerun the script;
`tests/unit/test_config_docs.py` fails when this file is stale).

The drafter, verifier, gateway and `specd health` build their flags from config
dataclasses: each flag also reads the environment variable in its `env` column
when it is set, and the flag given on the command line wins. `specd up` passes
its flags on to its three children, which inherit its environment: a child's
flag that `specd up` does not pass itself can be set through the child's
variable (`SPECD_DRAFTER_DECODER=transformers specd up`). Defaults are the
code's; a boolean flag given without a value means true.
"""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def entry_point() -> Callable[[Sequence[str]], None]:
    """The function the `specd` command runs, as pyproject.toml's [project.scripts] names it."""
    match = SCRIPT_LINE.search((ROOT / "pyproject.toml").read_text())
    if match is None:
        raise SystemExit("pyproject.toml names no `specd` script")
    module, _, function = match.group(1).partition(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def commands() -> list[tuple[str, str]]:
    """(command, one-line summary) in the order `specd --help` lists them."""
    usage = io.StringIO()
    with contextlib.redirect_stdout(usage), contextlib.suppress(SystemExit):
        entry_point()(["--help"])
    found: list[tuple[str, str]] = []
    for line in usage.getvalue().splitlines():
        match = COMMAND_LINE.match(line)
        if match:
            found.append((match.group(1), match.group(2).strip()))
        elif found and line.startswith("      ") and line.strip():
            name, summary = found[-1]
            found[-1] = (name, f"{summary} {line.strip()}")
    if not found:
        raise SystemExit("`specd --help` lists no commands")
    return found


def parser_of(command: str) -> argparse.ArgumentParser:
    """The parser `specd COMMAND` parses its arguments with."""
    main = entry_point()

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            main([command])
        except _Captured as got:
            return got.parser
    raise SystemExit(f"specd {command} parsed no arguments with argparse")


def _code(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "`" + ",".join(str(v) for v in value) + "`" if value else '`""`'
    text = str(value)
    home = str(Path.home())
    if home != "/" and text.startswith(home):
        text = "~" + text[len(home) :]
    return f"`{text}`" if text else '`""`'


def _cell(text: str) -> str:
    """One table cell: one line, and no character markdown would read as markup."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside `code spans`, which show their text as is
        for char, escaped in (("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
            parts[i] = parts[i].replace(char, escaped)
    return "`".join(parts)


def _help(action: argparse.Action, prog: str) -> tuple[str, str]:
    """(description, environment variable) of one action."""
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a literal %, as argparse would fail on
            text = text % {**params, "prog": prog}
    match = ENV_SUFFIX.search(text)
    if match:
        return text[: match.start()], match.group(1)
    return text, ""


def _rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        description, env = _help(action, parser.prog)
        default = "–" if action.default in (argparse.SUPPRESS,) or not action.option_strings else _code(action.default)
        choices = _cell(", ".join(_code(c) for c in action.choices)) if action.choices else "–"
        env_cell = f"`{env}`" if env else "–"
        yield f"| {name} | {env_cell} | {default} | {choices} | {_cell(description) or '–'} |"


def section(command: str, summary: str) -> str:
    parser = parser_of(command)
    about = parser.description.split("\n\n")[0] if parser.description else summary[:1].upper() + summary[1:] + "."
    lines = [f"## `specd {command}`", "", _cell(about)]
    lines += ["", "| flag | env | default | choices | what it does |", "|---|---|---|---|---|"]
    lines += list(_rows(parser))
    return "\n".join(lines)


def render() -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "OTEL_"))}
    with mock.patch.dict(os.environ, clean, clear=True):
        return _render()


def _render() -> str:
    parts = [HEADER]
    listed = commands()
    parts.append("\n".join(f"- [`specd {c}`](#specd-{c}): {s}" for c, s in listed) + "\n")
    parts += [section(c, s) + "\n" for c, s in listed]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        OUT.write_text(text)
        print(f"wrote {OUT}")
        return 0
    if not OUT.exists() or OUT.read_text() != text:
        print("docs/configuration.md is stale; run: python scripts/gen_config_docs.py", file=sys.stderr)
        return 1
    print("docs/configuration.md is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
