"""Credentials, identities and nats-server configuration as pure functions; docs/architecture.md's
permission table is the one nats-server is configured with."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import bcrypt

from tokenpipe.bus import connect
from tokenpipe.natsauth import add_app, ensure_credentials, identity
from tokenpipe.natsconfig import account_table, accounts, permission_table, server_config
from tokenpipe.settings import Settings
from tokenpipe_cli.cli import _nats_config, build_parser
from tokenpipe_cli.natsserver import NatsServer

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_the_documented_permission_table_is_the_generated_one() -> None:
    text = DOC.read_text()
    documented = text.split("<!-- permissions:begin -->\n", 1)[1].split("<!-- permissions:end -->", 1)[0]
    assert documented == permission_table(), "regenerate with tokenpipe.natsconfig.permission_table()"
    documented = text.split("<!-- accounts:begin -->\n", 1)[1].split("<!-- accounts:end -->", 1)[0]
    assert documented == account_table(), "regenerate with tokenpipe.natsconfig.account_table()"


def test_the_generated_server_config_has_every_role_and_no_anonymous_user(tmp_path: Path) -> None:
    creds = ensure_credentials(tmp_path / "creds")
    conf = server_config(creds)
    assert set(creds) == {"relay", "generator", "admin", "app-default"}
    layout = accounts(creds)
    users = {u["user"]: (name, u["password"]) for name, acc in layout.items() for u in acc["users"]}
    for cred in creds.values():
        assert f'"user": "{cred.user}"' in conf
        assert cred.password not in conf  # bcrypt hashes, not the passwords
        account, hashed = users[cred.user]
        assert bcrypt.checkpw(cred.password.encode(), hashed.encode())
        assert account == {"app": "APP_default", "relay": "RELAY"}.get(cred.role, "TOKENPIPE")
    assert "no_auth_user" not in conf
    # The app's account imports only its own request/cancel services and its own tokens,
    # each exported to its account alone, and the generators' placement summaries (to every
    # account that submits: the relay's too).
    exports = [e for e in layout["TOKENPIPE"]["exports"] if "APP_default" in e["accounts"]]
    assert {e.get("service") or e.get("stream") for e in exports} == {
        "tp.req.*.default", "tp.req.*.default.*", "tp.cancel.default.>", "tp.live.default.>", "tp.gen.place.>"}
    assert all(e["accounts"] == (["RELAY", "APP_default"] if e.get("stream") == "tp.gen.place.>" else ["APP_default"])
               for e in exports)
    # What the relay's account imports names the relay's subjects alone (or no owner's).
    relay_imports = {(i.get("service") or i.get("stream"))["subject"] for i in layout["RELAY"]["imports"]}
    assert not any(".default" in subject or subject.startswith(("tp.tok.", "tp.live.>")) for subject in relay_imports)
    assert {"tp.req.*.relay", "tp.cancel.relay.>", "tp.live.relay.>"} <= relay_imports
    assert {(i.get("service") or i.get("stream"))["subject"] for i in layout["APP_default"]["imports"]} == {
        "tp.req.*.default", "tp.req.*.default.*", "tp.cancel.default.>", "tp.live.default.>", "tp.gen.place.>"}
    # Live batches (only what tokenpipe's store accepted) arrive under the app's own token subjects.
    assert [i.get("to") for i in layout["APP_default"]["imports"] if "stream" in i] == [None, "tp.tok.default.>"]
    again = ensure_credentials(tmp_path / "creds")  # reused, not regenerated
    assert {u: c.password for u, c in again.items()} == {u: c.password for u, c in creds.items()}


def test_a_role_finds_its_identity_in_its_credentials(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    app = add_app(creds, "billing")
    ident = identity(Settings.load(env={}, nats_creds=str(app), data_dir=str(tmp_path)), "app")
    assert (ident.owner, ident.provisions, ident.registry, ident.own_account) == ("billing", False, False, True)
    assert ident.options["user"] == "app-billing" and ident.options["inbox_prefix"] == "_INBOX.app-billing"
    # No credentials at all (an open bus): the SDK acts in the relay's namespace, as before owners.
    open_bus = identity(Settings.load(env={}, data_dir=str(tmp_path / "empty")), "app")
    assert (open_bus.owner, open_bus.provisions, open_bus.registry, open_bus.options) == ("relay", True, True, {})
    # Next to `tokenpipe up`: a role finds its own file in the data dir.
    ensure_credentials(creds)
    relay = identity(Settings.load(env={}, data_dir=str(tmp_path)), "relay")
    assert relay.options["user"] == "relay" and relay.registry and not relay.provisions  # only the admin
    assert identity(Settings.load(env={}, data_dir=str(tmp_path)), "admin").provisions
    gen = identity(Settings.load(env={}, data_dir=str(tmp_path)), "generator")
    assert gen.options["user"] == "generator" and not gen.provisions and not gen.registry
    jwt = tmp_path / "user.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\nxxx\n------END NATS USER JWT------\n")
    assert identity(Settings.load(env={}, nats_creds=str(jwt)), "relay").options["user_credentials"] == str(jwt)
    tls = identity(Settings.load(env={}, nats_url="tls://h:4222", data_dir=str(tmp_path / "empty")), "relay")
    assert tls.options["tls"] is not None


def test_tokenpipe_nats_serves_the_same_authorization_and_tls(tmp_path: Path) -> None:
    args = build_parser().parse_args(["nats", "--auth", "--creds-dir", str(tmp_path / "creds"),
                                      "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem",
                                      "--tls-verify"])
    path = _nats_config(args, str(tmp_path / "nats"))
    assert path is not None
    conf = path.read_text()
    assert 'include "../creds/accounts.conf"' in conf
    assert '"user": "generator"' in (tmp_path / "creds" / "accounts.conf").read_text()
    assert '"cert_file": "c.pem"' in conf and '"verify": true' in conf
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _beside_up(tmp_path: Path, up_nats_url: str) -> Path:
    """A data dir as `tokenpipe up` leaves it: every role's credentials and an up.json naming its NATS server."""
    ensure_credentials(tmp_path / "creds")
    (tmp_path / "up.json").write_text(json.dumps({"state": "stopped", "nats_url": up_nats_url}))
    return tmp_path


def test_credentials_of_tokenpipe_up_go_only_to_the_server_it_runs(tmp_path: Path) -> None:
    data = str(_beside_up(tmp_path, "nats://127.0.0.1:4222"))
    for same in ("nats://127.0.0.1:4222", "nats://localhost:4222", "127.0.0.1", "nats://10.0.0.9:1,localhost:4222"):
        assert identity(Settings.load(env={}, nats_url=same, data_dir=data), "relay").options["user"] == "relay", same
    other = identity(Settings.load(env={}, nats_url="nats://127.0.0.1:5999", data_dir=data), "relay")
    assert "user" not in other.options and other.provisions  # an open bus of its own: it provisions
    (tmp_path / "up.json").write_text("{not json")  # nothing says where they belong: they are offered
    assert identity(Settings.load(env={}, nats_url="nats://127.0.0.1:5999", data_dir=data), "relay").options["user"]


async def test_a_benchmark_on_its_own_nats_server_failed_after_make_up_left_credentials(tmp_path: Path) -> None:
    """`make up` left credentials in the default data dir; a benchmark (and tests) then connected to
    their own open nats-server with them, did not provision, and failed: BucketNotFoundError."""
    data = _beside_up(tmp_path / "data", "nats://127.0.0.1:4222")
    with NatsServer(tmp_path / "nats") as server:
        bus = await connect(Settings.load(env={}, nats_url=server.url, data_dir=str(data)), name="test-open-bus")
        try:
            assert bus.provisions and bus.registry
            await bus.meta.put("k", b"v")
            assert (await bus.meta.get("k")).value == b"v"
        finally:
            await bus.close()


def test_passwords_are_192_random_bits_so_their_hashes_take_bcrypts_least_cost(tmp_path: Path) -> None:
    """A warm `tokenpipe up` spent ~1 s of CPU on bcrypt at nats-server's default cost (11): 0.12 s to hash each
    user's password at every start and as long for nats-server to check each connect. The work factor only
    slows the guessing of a chosen password; tokenpipe's are random, and so the hashes take the least cost."""
    import base64

    creds = ensure_credentials(tmp_path / "creds")
    hashes = {u["user"]: u["password"] for acc in accounts(creds).values() for u in acc["users"]}
    for cred in creds.values():
        assert len(base64.urlsafe_b64decode(cred.password + "=" * (-len(cred.password) % 4))) >= 24
        assert hashes[cred.user].startswith(("$2b$04$", "$2a$04$"))
    assert len({c.password for c in creds.values()}) == len(creds)
