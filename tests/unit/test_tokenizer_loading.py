"""`load_tokenizer` takes transformers' generic tokenizer class directly where AutoTokenizer would
choose it (no AutoTokenizer import, so no torch at the gateway's start; test_gateway_imports
checks that), and AutoTokenizer everywhere else; either way the tokenizer is the one AutoTokenizer
loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinymodels
from transformers import AutoTokenizer, TokenizersBackend
from transformers.models.auto import tokenization_auto

from specd.engine import checkpoints
from specd.engine.fingerprint import TokenizerFingerprint

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


def test_the_overrides_read_from_source_are_transformers_own_tables():
    overridden, mistral = checkpoints.auto_tokenizer_overrides()
    assert overridden == set(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    assert {"mistral", "mixtral"} <= mistral
    # Whatever the mapping names for the other types, it is never MistralCommonBackend.
    for model_type, name in tokenization_auto.TOKENIZER_MAPPING_NAMES.items():
        assert model_type in mistral or not (name or "").startswith("MistralCommon")


def test_without_the_tables_autotokenizer_decides(saved, monkeypatch):
    monkeypatch.setattr(checkpoints, "auto_tokenizer_overrides", lambda: None)
    assert checkpoints.generic_tokenizer_class(saved) is None
