"""docs/architecture.md's permission table is the one nats-server is configured with."""

from __future__ import annotations

from pathlib import Path

from tokenpipe.natsauth import ensure_credentials, permission_table, server_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_the_documented_permission_table_is_the_generated_one() -> None:
    text = DOC.read_text()
    documented = text.split("<!-- permissions:begin -->\n", 1)[1].split("<!-- permissions:end -->", 1)[0]
    assert documented == permission_table(), "regenerate with tokenpipe.natsauth.permission_table()"


def test_the_generated_server_config_has_every_role_and_no_anonymous_user(tmp_path: Path) -> None:
    creds = ensure_credentials(tmp_path / "creds")
    conf = server_config(creds)
    assert set(creds) == {"relay", "generator", "admin", "app-default"}
    for cred in creds.values():
        assert f'"user": "{cred.user}"' in conf and cred.password in conf
    assert "no_auth_user" not in conf
    again = ensure_credentials(tmp_path / "creds")  # reused, not regenerated
    assert {u: c.password for u, c in again.items()} == {u: c.password for u, c in creds.items()}
