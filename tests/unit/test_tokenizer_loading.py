"""`load_tokenizer` takes transformers' generic tokenizer class directly where AutoTokenizer would
choose it (no config class import, so no torch.distributed or dynamo at the gateway's start),
and AutoTokenizer everywhere else; either way the tokenizer is the one AutoTokenizer loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tinymodels
from transformers import AutoTokenizer, TokenizersBackend

from specd import checkpoints
from specd.fingerprint import TokenizerFingerprint

TEXTS = ["Hello  world\n\tX é", "<|im_start|>user\nhi<|im_end|>", "  leading spaces and 123 digits"]


@pytest.fixture
def saved(tmp_path: Path, tok, tiny_target) -> Path:
    return tinymodels.save(tiny_target, tok, tmp_path / "model")


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_generic_tokenizer_directory_loads_what_autotokenizer_loads(saved):
    assert json.loads((saved / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert checkpoints.generic_tokenizer_class(saved) is TokenizersBackend
    ours = checkpoints.load_tokenizer(str(saved))
    auto = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    assert type(ours) is type(auto)
    assert TokenizerFingerprint.of(ours) == TokenizerFingerprint.of(auto)
    assert ours.get_vocab() == auto.get_vocab()
    for text in TEXTS:
        assert ours(text).input_ids == auto(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize(
    "change",
    [
        ("tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"}),
        ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "custom.Tokenizer"]}}),
        ("config.json", {"model_type": "phi3_v"}),  # a type transformers overrides the hub's class for
    ],
    ids=["another class", "custom code", "overridden model type"],
)
def test_anything_else_goes_through_autotokenizer(saved, change):
    name, fields = change
    edit_json(saved / name, **fields)
    assert checkpoints.generic_tokenizer_class(saved) is None


def test_without_a_tokenizer_json_autotokenizer_decides(saved):
    (saved / "tokenizer.json").unlink()
    assert checkpoints.generic_tokenizer_class(saved) is None


def test_loading_a_generic_tokenizer_imports_no_torch_distributed(saved):
    code = (
        "import sys\n"
        "from specd import checkpoints\n"
        f"checkpoints.load_tokenizer({str(saved)!r})\n"
        "print(sorted(m for m in ('torch.distributed.tensor', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
