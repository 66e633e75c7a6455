"""The embedded target's special tokens come from its GGUF metadata, whatever transformers makes of them."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import AutoTokenizer

from specd.engine.checkpoints import (
    EMBEDDED,
    EMBEDDED_DRAFTER,
    _set_special_tokens,
    embedded_gguf_path,
    gguf_special_token_ids,
    load_tokenizer,
    materialize,
)
from specd.engine.fingerprint import TokenizerFingerprint


def test_the_embedded_gguf_declares_smollm2_instruct_special_tokens():
    assert gguf_special_token_ids(embedded_gguf_path()) == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}


def test_a_conversion_that_maps_eos_wrongly_is_corrected_from_the_metadata():
    # What one transformers release made of this GGUF: eos <|im_start|>, no pad token.
    wrong = AutoTokenizer.from_pretrained(str(materialize(EMBEDDED)), local_files_only=True)
    wrong.eos_token = wrong.convert_ids_to_tokens(1)
    wrong.pad_token = None
    config = SimpleNamespace(bos_token_id=1, eos_token_id=1, pad_token_id=None)
    model = SimpleNamespace(config=config, generation_config=SimpleNamespace(eos_token_id=1))
    _set_special_tokens(wrong, model, gguf_special_token_ids(embedded_gguf_path()))
    assert (wrong.eos_token_id, wrong.pad_token_id, wrong.bos_token_id) == (2, 2, 1)
    assert (config.eos_token_id, config.pad_token_id, model.generation_config.eos_token_id) == (2, 2, 2)
    # ... which makes it the tokenizer the shipped drafter was distilled with.
    drafter = TokenizerFingerprint.of(load_tokenizer(EMBEDDED_DRAFTER))
    assert TokenizerFingerprint.of(wrong).differences(drafter) == []
