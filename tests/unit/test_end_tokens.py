"""Every id a model's generation_config.json lists ends a sequence: the same set everywhere."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gateway.backends import BackendError, check_compatible
from specd.engine.checkpoints import MANIFEST, ModelLoadError
from specd.engine.end_tokens import end_token_ids
from specd.engine.errors import ErrorKind
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.grammar import GrammarCompiler, canonical
from specd.engine.params import SamplingParams
from specd.engine.sequences import SequenceTable
from specd.engine.tasks import SequenceSpec
from specd.rpc.serving import fingerprint_from_pb, fingerprint_pb


def _model_dir(root: Path, tok, eos_token_id) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(root)
    if eos_token_id != "absent":
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return root


@pytest.mark.parametrize(
    ("written", "expected"),
    [("absent", {"eos"}), (None, {"eos"}), (7, {7, "eos"}), ([9, 7, 9], {7, 9, "eos"}), (["eos"], {"eos"})],
)
def test_end_ids_are_generation_configs_and_the_tokenizers(tmp_path, tok, written, expected):
    eos = tok.eos_token_id
    written = [eos if w == "eos" else w for w in written] if isinstance(written, list) else written
    path = _model_dir(tmp_path / "m", tok, written)
    assert end_token_ids(str(path), tok) == tuple(sorted(eos if e == "eos" else e for e in expected))


@pytest.mark.parametrize("bad", ["7", [1, "x"], [-1], True])
def test_a_malformed_eos_token_id_is_a_load_error(tmp_path, tok, bad):
    path = _model_dir(tmp_path / "m", tok, bad)
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        end_token_ids(str(path), tok)


def test_a_distilled_drafter_ends_where_its_target_does(tmp_path, tok):
    target = _model_dir(tmp_path / "target", tok, [5, 6])
    drafter = _model_dir(tmp_path / "drafter", tok, "absent")
    (drafter / MANIFEST).write_text(json.dumps({"format": "specd-distilled-drafter", "target": str(target)}))
    assert end_token_ids(str(drafter), tok) == tuple(sorted({5, 6, tok.eos_token_id}))


def test_end_ids_travel_in_the_fingerprint_and_a_difference_is_named(tok):
    a = TokenizerFingerprint.of(tok, [tok.eos_token_id, 7])
    assert a.end_token_ids == tuple(sorted({7, tok.eos_token_id}))
    assert fingerprint_from_pb(fingerprint_pb(a)) == a
    assert TokenizerFingerprint.of(tok).end_token_ids == (tok.eos_token_id,)
    b = TokenizerFingerprint.of(tok)
    assert a.differences(b) == [f"end token ids {list(a.end_token_ids)} != {[tok.eos_token_id]}"]


class _Backend:
    def __init__(self, fingerprint: TokenizerFingerprint) -> None:
        self.fingerprint = fingerprint
        self.kind = 1  # DRAFTER_KIND_MODEL
        self.address = "drafter:1"
        self.info = None


def test_the_gateway_refuses_a_verifier_whose_end_ids_differ_and_tells_of_a_drafters(tok, caplog):
    two = TokenizerFingerprint.of(tok, [tok.eos_token_id, 7])
    one = TokenizerFingerprint.of(tok)
    check_compatible(two, _Backend(two), _Backend(two))  # type: ignore[arg-type]
    assert "configured apart" not in caplog.text
    with pytest.raises(BackendError, match="verifier's: end token ids"):
        check_compatible(one, _Backend(two), None)  # type: ignore[arg-type]
    # A drafter's own end ids are its configuration: the target's count, and travel with each sequence.
    with caplog.at_level("INFO", logger="gateway.backends"):
        check_compatible(two, _Backend(two), _Backend(one))  # type: ignore[arg-type]
    told = [r.getMessage() for r in caplog.records if "configured apart" in r.getMessage()]
    assert len(told) == 1 and f"end token ids [{tok.eos_token_id}] != {list(two.end_token_ids)}" in told[0]


def test_the_grammar_allows_every_end_id_where_the_output_is_complete_and_ends_there(tok, vocab_size):
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    assert other != tok.eos_token_id
    grammars = GrammarCompiler(tok, vocab_size, [tok.eos_token_id, other])
    schema = canonical({"type": "object"})
    m = grammars.matcher(schema)
    assert not m.allowed()[[tok.eos_token_id, other]].any()
    m.push(tok.encode("{}"))
    assert m.allowed()[[tok.eos_token_id, other]].all()
    m.push([other])
    assert m.ended and not m.allowed().any()
    # Without it in the set, the same id is no end: the grammar refuses it as content.
    plain = GrammarCompiler(tok, vocab_size).matcher(schema)
    plain.push(tok.encode("{}"))
    assert not bool(plain.allowed()[other]) and bool(plain.allowed()[tok.eos_token_id])
    assert torch.equal(m.allowed(), torch.zeros(vocab_size, dtype=torch.bool))


def test_a_sequences_end_ids_rule_its_grammar_and_the_services_own_eos_is_then_no_end(tok, vocab_size):
    """A base drafter's grammar (its tokenizer's eos `<|endoftext|>`) told the target's ends."""
    base = copy.deepcopy(tok)
    base.eos_token = "<|endoftext|>"
    own, target_ends = base.eos_token_id, frozenset({tok.eos_token_id, 7})
    assert own not in target_ends
    m = GrammarCompiler(base, vocab_size, [own]).matcher(canonical({"type": "object"}), ends=target_ends)
    m.push(tok.encode("{}"))
    allowed = m.allowed()
    assert allowed[sorted(target_ends)].all() and not bool(allowed[own])
    m.push([7])
    assert m.ended


def test_end_ids_outside_the_vocabulary_are_refused_at_open(vocab_size):
    table = SequenceTable(None, vocab_size, 2, 64, torch.device("cpu"))
    spec = SequenceSpec("s", [1, 2], SamplingParams(temperature=0.0), end_token_ids=(2, vocab_size))
    errors, _ = table.open([spec])
    assert errors[0] is not None and errors[0].kind == ErrorKind.INVALID_ARGUMENT
    assert f"end_token_ids: token id {vocab_size} is outside the vocabulary" in errors[0].message
    assert table.open([dataclasses.replace(spec, end_token_ids=(2, 7))])[0] == [None]
    assert table.seqs["s"].ends == {2, 7}
