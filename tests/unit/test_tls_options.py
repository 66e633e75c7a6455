"""API-key matching and the TLS options' consistency checks (no servers)."""

from __future__ import annotations

import pytest

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from specd.rpc.tls import ApiKeyError, ApiKeys, TlsConfigError, channel_credentials, server_credentials


def test_api_keys_accept_only_bearer_with_a_listed_key():
    keys = ApiKeys(("alpha", "beta"))
    assert keys.enabled
    for ok in ("Bearer alpha", "bearer beta", "  Bearer   alpha "):
        assert keys.allows(ok), ok
    for bad in (None, "", "alpha", "Bearer", "Bearer gamma", "Basic alpha", "Bearer alph", "Bearer alphaa"):
        assert not keys.allows(bad), bad


def test_keys_are_compared_as_the_bytes_http_carries_and_unsendable_keys_fail_at_start():
    keys = ApiKeys(("alpha",))
    assert keys.allows(b"Bearer alpha") and not keys.allows(b"Bearer alpha\xe9")
    assert not keys.allows("Bearer alph\u00e9")
    for unsendable in ("caf\u00e9-key", "two words", "tab\there"):
        with pytest.raises(ApiKeyError, match="API key 2 has characters an HTTP header cannot carry"):
            ApiKeys(("alpha", unsendable))


def test_no_keys_leaves_the_api_open():
    keys = ApiKeys(("",))
    assert not keys.enabled and keys.allows(None)


def test_gateway_reads_comma_separated_keys_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("SPECD_GATEWAY_API_KEY", "sk-one, sk-two,,sk-three")
    assert GatewayConfig.from_args([]).api_key == ("sk-one", "sk-two", "sk-three")
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--help"])
    help_text = capsys.readouterr().out
    assert "SPECD_GATEWAY_API_KEY" in help_text and "sk-" not in help_text, "--help must not print the keys"


@pytest.mark.parametrize(
    "argv",
    [
        ["--tls-cert", "c.pem"],
        ["--tls-key", "k.pem"],
        ["--backend-tls-cert", "c.pem", "--backend-tls-key", "k.pem"],
        ["--backend-tls-ca", "ca.pem", "--backend-tls-cert", "c.pem"],
    ],
)
def test_gateway_refuses_half_configured_tls(argv):
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(argv)


@pytest.mark.parametrize("argv", [["--tls-cert", "c.pem"], ["--tls-client-ca", "ca.pem"]])
def test_services_refuse_half_configured_tls(argv):
    with pytest.raises(SystemExit):
        DrafterConfig.from_args(argv)


def test_credentials_are_plaintext_by_default_and_name_missing_files(tmp_path):
    assert server_credentials("", "") is None and channel_credentials("") is None
    with pytest.raises(TlsConfigError, match=r"cannot read the TLS key .*key\.pem"):
        server_credentials(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    with pytest.raises(TlsConfigError, match="needs the CA"):
        channel_credentials("", "c.pem", "k.pem")
    with pytest.raises(TlsConfigError):
        server_credentials("", "", client_ca="ca.pem")
