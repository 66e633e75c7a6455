"""docs/configuration.md is what scripts/gen_config_docs.py generates from the parsers:
every flag of every command, with its environment variable where it reads one."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from specd import configuration
from verifier_service.config import VerifierConfig

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _script()


@pytest.fixture(scope="module")
def rendered(gen: ModuleType) -> str:
    return gen.render()


def test_committed_file_is_what_the_parsers_generate(rendered: str) -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == rendered, "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


@pytest.mark.parametrize(
    ("cls", "prefix", "command"),
    [
        (GatewayConfig, "GATEWAY", "gateway"),
        (DrafterConfig, "DRAFTER", "drafter"),
        (VerifierConfig, "VERIFIER", "verifier"),
    ],
)
def test_every_config_field_is_a_row_with_its_variable(rendered: str, cls: type, prefix: str, command: str) -> None:
    section = rendered.split(f"## `specd {command}`", 1)[1].split("\n## ", 1)[0]
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        env = configuration.env_name(f, prefix)
        assert f"| `{flag}` | `{env}` |" in section, f"{flag} of specd {command} is missing or has no {env}"


def test_every_command_of_specd_help_has_a_section(gen: ModuleType, rendered: str) -> None:
    names = [name for name, _ in gen.commands()]
    assert {"up", "drafter", "verifier", "gateway", "bench", "distill"} <= set(names)
    for name in names:
        assert f"## `specd {name}`" in rendered


def test_up_flags_are_listed(rendered: str) -> None:
    up = rendered.split("## `specd up`", 1)[1].split("\n## ", 1)[0]
    for flag in ("--placement", "--drafter", "--verifier-dtype", "--tls-client-cert", "-k`, `--num-speculative-tokens"):
        assert f"`{flag}`" in up


def test_rows_show_default_choices_variable_and_escape_markup(gen: ModuleType) -> None:
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument(
        "--mode", choices=["", "a|b"], default="", help="pick <one> of *these* (env SPECD_X_MODE; default '')"
    )
    parser.add_argument("--n", type=int, default=3, help="`a<b>` stays (%(default)s)")
    parser.add_argument("path")
    rows = list(gen._rows(parser))
    assert rows[0] == '| `--mode` | `SPECD_X_MODE` | `""` | `""`, `a\\|b` | pick &lt;one&gt; of \\*these\\* |'
    assert rows[1] == "| `--n` | – | `3` | – | `a<b>` stays (3) |"
    assert rows[2] == "| `path` (positional) | – | – | – | – |"


def test_environment_does_not_leak_into_defaults(gen: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_GATEWAY_MAX_BATCH", "7")
    text = gen.render()
    assert "| `--max-batch` | `SPECD_GATEWAY_MAX_BATCH` | `32` |" in text
    assert os.environ["SPECD_GATEWAY_MAX_BATCH"] == "7"


def test_check_mode_fails_on_a_stale_file(gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n")
    monkeypatch.setattr(gen, "OUT", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
