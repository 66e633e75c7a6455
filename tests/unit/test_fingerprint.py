from __future__ import annotations

import copy

import pytest

from specd.engine.fingerprint import TokenizerFingerprint


def test_same_tokenizer_same_fingerprint(tok):
    a = TokenizerFingerprint.of(tok)
    b = TokenizerFingerprint.of(copy.deepcopy(tok))
    assert a == b
    assert a.differences(b) == []
    assert a.vocab_size == len(tok.get_vocab())
    assert len(a.vocab_sha256) == 64
    assert a.special_token_ids == {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "unk": tok.unk_token_id,
    }


def test_added_token_changes_vocab_size_and_hash(tok):
    other = copy.deepcopy(tok)
    assert other.add_tokens(["<specd_test_token>"]) == 1
    a, b = TokenizerFingerprint.of(tok), TokenizerFingerprint.of(other)
    assert a != b
    assert b.vocab_size == a.vocab_size + 1
    diffs = a.differences(b)
    assert len(diffs) == 2
    assert any(d.startswith("vocab size") and str(a.vocab_size) in d for d in diffs)
    assert any(d.startswith("vocabulary hash") for d in diffs)
    assert not any("token id" in d for d in diffs)
    assert len(b.differences(a)) == 2
    # The original is untouched by the copy's change.
    assert TokenizerFingerprint.of(tok) == a


def test_different_eos_is_named(tok):
    other = copy.deepcopy(tok)
    other.eos_token = tok.bos_token
    assert other.eos_token_id != tok.eos_token_id
    a, b = TokenizerFingerprint.of(tok), TokenizerFingerprint.of(other)
    assert a.vocab_size == b.vocab_size and a.vocab_sha256 == b.vocab_sha256
    assert a.differences(b) == [
        f"eos token id {tok.eos_token_id} != {other.eos_token_id}",
        f"end token ids [{tok.eos_token_id}] != [{other.eos_token_id}]",
    ]


def test_same_vocab_with_different_ids_changes_the_hash():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab
            self.eos_token_id = 0

        def get_vocab(self):
            return dict(self.vocab)

    a = TokenizerFingerprint.of(Tok({"x": 0, "y": 1, "z": 2}))
    b = TokenizerFingerprint.of(Tok({"x": 0, "y": 2, "z": 1}))
    same = TokenizerFingerprint.of(Tok({"z": 2, "x": 0, "y": 1}))  # insertion order does not matter
    assert a.vocab_size == b.vocab_size == 3
    assert a.vocab_sha256 != b.vocab_sha256
    assert a == same
    assert a.special_token_ids == {"eos": 0}


@pytest.mark.parametrize(
    ("left", "right", "expected"),
    [
        ({"eos": 2}, {"eos": 2}, []),
        ({"eos": 2}, {"eos": 3}, ["eos token id 2 != 3"]),
        ({"bos": 1, "eos": 2}, {"eos": 2}, ["bos token id 1 != None"]),
        ({}, {"pad": 0, "unk": 5}, ["pad token id None != 0", "unk token id None != 5"]),
    ],
)
def test_differences_in_special_ids(left, right, expected):
    a = TokenizerFingerprint(10, "ab" * 32, left)
    b = TokenizerFingerprint(10, "ab" * 32, right)
    assert a.differences(b) == expected


def test_differences_lists_everything():
    a = TokenizerFingerprint(10, "a" * 64, {"eos": 2})
    b = TokenizerFingerprint(11, "b" * 64, {"eos": 3})
    assert a.differences(b) == [
        "vocab size 10 != 11",
        f"vocabulary hash {'a' * 12} != {'b' * 12}",
        "eos token id 2 != 3",
    ]


def test_which_ids_are_special_is_the_vocabularys_and_roles_are_configuration(tok):
    fp = TokenizerFingerprint.of(tok)
    assert fp.special_ids == tuple(sorted(i for i, t in tok.added_tokens_decoder.items() if t.special))
    assert tok.eos_token_id in fp.special_ids and len(fp.special_ids) > 3
    # Another role for a special token (a base model's eos): configuration, told apart from the vocabulary.
    base = copy.deepcopy(tok)
    base.eos_token = "<|endoftext|>"
    other = TokenizerFingerprint.of(base)
    assert other.vocabulary_differences(fp) == []
    assert other.config_differences(fp) == [
        f"eos token id {base.eos_token_id} != {tok.eos_token_id}",
        f"end token ids [{base.eos_token_id}] != [{tok.eos_token_id}]",
    ]
    # A special id the other tokenizer spells as text is a difference of vocabulary.
    plain = TokenizerFingerprint(
        fp.vocab_size, fp.vocab_sha256, fp.special_token_ids, fp.end_token_ids, fp.special_ids[1:]
    )
    assert fp.vocabulary_differences(plain) == [f"special ids: [{fp.special_ids[0]}] only here, none only there"]
    assert fp.config_differences(plain) == []
