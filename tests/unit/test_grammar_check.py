"""Constraints fail at the door: what can never match is a 400 with one line, over HTTP and gRPC."""

from __future__ import annotations

import grpc
import pytest
from api_harness import CHAT, COMPLETIONS, body_for, grpc_generate, http_post
from never_grammars import NEVER, NODE

from specd.engine.grammar import one_line


@pytest.mark.parametrize(("fields", "param"), NEVER)
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_constraint_that_can_never_match_is_a_400_with_one_line(tok, fields, param, endpoint):
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"] and len(error["message"]) < 400
    assert not scheduler.submitted


def test_grpc_refuses_the_same_constraints(tok):
    aborted, scheduler = grpc_generate(tok, {"guided_regex": "[a&&b]"})
    assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "guided_regex can never be satisfied" in aborted.details and not scheduler.submitted


def test_satisfiable_constraints_pass(tok):
    optional = {"$defs": {"node": {**NODE, "required": []}}, "$ref": "#/$defs/node"}
    tree = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": optional}}}
    for fields in ({"guided_regex": "[a-z]+"}, {"guided_choice": ["yes", "no"]}, tree):
        r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields))
        assert r.status_code == 200, r.text
        assert scheduler.submitted[0].grammar or scheduler.submitted[0].json_schema


def test_an_engine_panic_reaches_no_client_beyond_its_first_line():
    panic = "thread panicked at src/earley/regexvec.rs:12:5:\nlimit exceeded\nstack backtrace:\n   0: /root/.cargo/x.rs"
    assert one_line(panic) == "the grammar engine failed: limit exceeded"
    assert one_line("bad at /home/ci/.cargo/registry/src/x/lib.rs:3:1 here") == "bad at <source> here"
    assert one_line("x" * 1000).endswith("...") and len(one_line("x" * 1000)) == 300
    assert one_line("") == ""
