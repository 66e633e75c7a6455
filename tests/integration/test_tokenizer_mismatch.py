"""A drafter whose tokenizer differs from the verifier's is refused, with the difference named."""

from __future__ import annotations

import copy

import stack as st
import tinymodels


def test_gateway_refuses_a_drafter_with_another_tokenizer(tmp_path, tok, tiny_draft, backends, model_dirs, log_dir):
    verifier, _ = backends
    other = copy.deepcopy(tok)
    other.add_tokens(["<specd-extra-token>"])
    draft_dir = tinymodels.save(tiny_draft, other, tmp_path / "mismatched-draft")
    drafter = st.start_backend(
        "drafter", ["--model", str(draft_dir), "--dtype", "float32", "--quantize", "none"], log_dir
    )
    try:
        port = st.free_port()
        gateway = st.spawn(
            "gateway",
            [
                "--host", st.HOST,
                "--http-port", str(port),
                "--grpc-port", "0",
                "--verifier", verifier.address,
                "--drafter", drafter.address,
                "--tokenizer", str(model_dirs["target"]),
            ],
            log_dir,
            port,
        )  # fmt: skip
        code = gateway.proc.wait(120)
        output = gateway.output()
    finally:
        drafter.stop()
    assert code != 0
    assert "refusing drafter" in output
    assert f"vocab size {len(tok) + 1} != {len(tok)}" in output
