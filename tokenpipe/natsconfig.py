"""nats-server's configuration for tokenpipe's users: one account per tenant, bcrypt passwords.

The account layout is data (:func:`accounts`), rendered into nats-server's configuration
(:func:`server_config`), the Helm chart's values (:func:`chart_accounts`) and docs/architecture.md's
tables (:func:`permission_table`, :func:`account_table`); the tests check each against it.

Why accounts: inside one account a client may publish an allowed subject with *any* reply
subject, and the server then publishes its own answer (a PubAck error, a JetStream API reply, a
direct get's message) onto that reply subject without checking anyone's permissions: an app
could put those answers onto another owner's cancel, token or registry subjects. Accounts are
NATS's isolation boundary: a request that crosses a service import gets a reply subject of the
exporting account mapped back to the importer, so every answer an app provokes lands in the app's
own account. Layout:

- ``TOKENPIPE``: the generators and the admin; JetStream with ``TP_REQUESTS``,
  ``TP_TOKENS`` and, per owner (the relay, each app), the intake stream ``TP_REQ_<owner>``
  where its requests land, which ``TP_REQUESTS`` sources (tokenpipe.bus.intake_config: a
  publisher's ``Nats-Expected-Last-Subject-Sequence-Subject`` header is then evaluated against
  the owner's own requests alone, never another's; the generators may delete a finished
  request's copy there). For each app it exports, to that app's account
  only, the services ``tp.req.*.<app>`` (its requests; JetStream's PubAck is the reply) and
  ``tp.cancel.<app>.>`` (its cancels), and the stream ``tp.live.<app>.>`` (its tokens, live: each
  batch once tokenpipe's ``TP_TOKENS`` accepted it, never one it refused, tokenpipe.append).
- ``RELAY``: the relay (tokenpipe.relayaccount), importing what an app imports for owner ``relay`` and
  the generators' discovery, announcements, the admin's store answers and one look at ``TP_REQUESTS``'
  consumers; its JetStream holds its copy of its batches (sourced from tokenpipe's ``TP_TOKENS``), the
  ``tp_streams`` registry and the Batch API's buckets, which the admin provisions through the relay
  account's JetStream API, exported to tokenpipe's account and imported there as ``$JS.RELAY.API``.
- ``APP_<app>``: one per application (``tokenpipe creds add-app``), with JetStream of its own: the
  imported tokens arrive as ``tp.tok.<app>.>`` (the import maps the subject) and are kept there in
  the app's own ``TP_TOKENS`` (same retention), which is where the SDK reads history and live
  batches from. Bounded (:func:`app_limits`): one stream, file storage, consumers and connections
  as the settings say, so that no application can fill the server's store or its connection table.
  Nothing the app does with JetStream reaches tokenpipe's account: it has no import
  of tokenpipe's JetStream API at all (a consumer created across accounts could be given a deliver
  subject in tokenpipe's account).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import bcrypt

from .errors import ConfigError
from .natsauth import (
    RESERVED_APP_NAMES,
    Credential,
    TLSFiles,
    app_user,
    ensure_credentials,
    permissions,
    write_private,
)
from .settings import Settings
from .subjects import (
    ANNOUNCE_PREFIX,
    DISCOVER_SUBJECT,
    PLACE_PREFIX,
    RELAY_API,
    RELAY_COPY_PREFIX,
    RELAY_OWNER,
    REQUESTS_STREAM,
    STORE_PREFIX,
    TOKENPIPE_API,
    TOKENS_STREAM,
    check_owner,
    owner_tokens,
)

__all__ = [
    "RELAY_ACCOUNT",
    "TOKENPIPE_ACCOUNT",
    "account_name",
    "account_table",
    "accounts",
    "app_limits",
    "chart_accounts",
    "password_env",
    "permission_table",
    "server_config",
    "write_server_config",
    "ACCOUNTS_FILE",
]

TOKENPIPE_ACCOUNT = "TOKENPIPE"
RELAY_ACCOUNT = "RELAY"  # the relay's own (tokenpipe.relayaccount)
_JS = "$JS.API"
ACCOUNTS_FILE = "accounts.conf"  # in the credentials dir; the server configuration includes it
# bcrypt's least cost. Its work factor slows the guessing of a password a person chose; tokenpipe's are 192
# random bits (natsauth._ensure), which no work factor makes any harder to guess, and at nats-server's default
# (11) every start hashed each user's for 0.12 s in a row and nats-server spent as long checking each connect
# (about 1 s of CPU in a 4 s warm start of `tokenpipe up --generators 2` on 2 cores: issue 49).
_BCRYPT_ROUNDS = 4


def account_name(app: str) -> str:
    """The NATS account of application ``app``."""
    return f"APP_{check_owner(app)}"


def _exports(app: str) -> list[dict[str, Any]]:
    only = [account_name(app)]
    return [{"service": f"tp.req.*.{app}", "accounts": only},
            {"service": f"tp.req.*.{app}.*", "accounts": only},
            {"service": f"tp.cancel.{app}.>", "accounts": only},
            {"stream": f"tp.live.{app}.>", "accounts": only}]


def _imports(app: str) -> list[dict[str, Any]]:
    src = TOKENPIPE_ACCOUNT
    return [{"service": {"account": src, "subject": f"tp.req.*.{app}"}},
            {"service": {"account": src, "subject": f"tp.req.*.{app}.*"}},
            # The generators' placement summaries (tokenpipe.placement): the SDK places requests too.
            {"stream": {"account": src, "subject": f"{PLACE_PREFIX}.>"}},
            {"service": {"account": src, "subject": f"tp.cancel.{app}.>"}},
            # Stored batches only, under the app's own token subjects (what its TP_TOKENS keeps).
            {"stream": {"account": src, "subject": f"tp.live.{app}.>"}, "to": owner_tokens(app)}]


def _relay_services() -> list[tuple[str, str | None]]:
    """The services tokenpipe's account exports to the relay's, each with the subject the relay's
    account imports it as (None: the same). JetStream calls are imported under ``$JS.TP.API``: the
    relay's account has a JetStream of its own, which answers ``$JS.API`` there."""
    relay = RELAY_OWNER
    return [(f"tp.req.*.{relay}", None), (f"tp.req.*.{relay}.*", None), (f"tp.cancel.{relay}.>", None),
            (DISCOVER_SUBJECT, None), (f"{STORE_PREFIX}.>", None),
            (f"{_JS}.CONSUMER.INFO.{REQUESTS_STREAM}.*", f"{TOKENPIPE_API}.CONSUMER.INFO.{REQUESTS_STREAM}.*"),
            # The one its copy's sourcing calls (tokenpipe.relayaccount): a consumer of the relay's batches.
            (f"{_JS}.CONSUMER.CREATE.{TOKENS_STREAM}.*.{owner_tokens(relay)}",
             f"{TOKENPIPE_API}.CONSUMER.CREATE.{TOKENS_STREAM}.*.{owner_tokens(relay)}"),
            # And that consumer's flow control: its deliveries stop once its window is full until the copy's
            # answer reaches it (without this export a burst of 6,000 batches stalled at 5,195 for 30 s).
            # The consumer checks the answer's whole subject (its name and a random token), so the relay's
            # user, which answers its own consumers' flow control, can release no other consumer's.
            (f"$JS.FC.{TOKENS_STREAM}.>", None)]


def _relay_streams() -> list[str]:
    """The streams (plain messages) tokenpipe's account exports to the relay's: its live batches, the
    generators' announcements, and its copy's deliveries (the placement summaries go to every
    account that submits, :func:`accounts`)."""
    return [f"tp.live.{RELAY_OWNER}.>", f"{ANNOUNCE_PREFIX}.>", f"{RELAY_COPY_PREFIX}.>"]


def _relay_account(cred: Credential, password: str | None) -> dict[str, Any]:
    src = TOKENPIPE_ACCOUNT
    return {
        "jetstream": "enabled",
        "users": [_user(cred, password, [])],
        # Its JetStream to the admin alone (tokenpipe's account's users: no other may publish there).
        "exports": [{"service": f"{_JS}.>", "accounts": [TOKENPIPE_ACCOUNT]}],
        "imports": [{"service": {"account": src, "subject": subject}, **({"to": to} if to else {})}
                    for subject, to in _relay_services()]
        + [{"stream": {"account": src, "subject": subject}} for subject in (*_relay_streams(), f"{PLACE_PREFIX}.>")],
    }


def app_limits(settings: Settings) -> dict[str, Any]:
    """An application account's bounds, as nats-server's account ``jetstream`` and ``limits`` blocks.
    Unbounded, one app reserved 52 GiB for its token stream (``max_bytes``) and the next app's
    connect failed ("insufficient storage resources"); and it could open connections without end."""
    return {"jetstream": {"max_mem": 0,  # memory streams: none (its ordered consumers are not streams)
                          "max_file": settings.app_max_store_bytes,
                          "max_streams": 1,  # its TP_TOKENS; its permissions name no other
                          "max_consumers": settings.app_max_consumers},
            "limits": {"max_connections": settings.app_max_connections}}


def _user(cred: Credential, password: str | None, apps: list[str]) -> dict[str, Any]:
    perms = permissions(cred.role, cred.owner if cred.role == "app" else None, apps=apps)
    pw = password if password is not None else bcrypt.hashpw(cred.password.encode(),
                                                             bcrypt.gensalt(_BCRYPT_ROUNDS)).decode()
    return {"user": cred.user, "password": pw, "permissions": perms.as_config()}


def accounts(creds: dict[str, Credential], *, passwords: dict[str, str] | None = None,
             settings: Settings | None = None) -> dict[str, Any]:
    """nats-server's ``accounts`` block for ``creds`` (by user): tokenpipe's roles in
    :data:`TOKENPIPE_ACCOUNT`, each app in its own, bounded by ``settings`` (default: the
    defaults; :func:`app_limits`). Passwords are bcrypt hashes unless ``passwords`` gives a user's
    value (the Helm chart's environment references). An app with a reserved name (a credentials
    file written before names were checked) raises :class:`ConfigError`."""
    pw = passwords or {}
    bounds = app_limits(settings or Settings.load(env={}))
    roles = [c for c in creds.values() if c.role != "app"]
    apps = sorted((c for c in creds.values() if c.role == "app"), key=lambda c: c.owner)
    for c in apps:
        if c.owner.lower() in RESERVED_APP_NAMES:
            raise ConfigError(f"the credentials of application {c.owner!r} ({c.user}.json) use a reserved name: "
                              "remove the file and add the application under another name")
    relay = next((c for c in roles if c.role == "relay"), None)
    only_relay = [RELAY_ACCOUNT]
    relay_exports = ([{"service": subject, "accounts": only_relay} for subject, _ in _relay_services()]
                     + [{"stream": subject, "accounts": only_relay} for subject in _relay_streams()]) if relay else []
    # The placement summaries to every account that submits requests (a stream export each imports).
    placing = [RELAY_ACCOUNT] * (relay is not None) + [account_name(c.owner) for c in apps]
    out: dict[str, Any] = {TOKENPIPE_ACCOUNT: {
        "jetstream": "enabled",
        "users": [_user(c, pw.get(c.user), [a.owner for a in apps]) for c in roles if c is not relay],
        "exports": relay_exports + [e for c in apps for e in _exports(c.owner)]
        + ([{"stream": f"{PLACE_PREFIX}.>", "accounts": placing}] if placing else []),
        # The relay account's JetStream, for the admin to provision and read it (tokenpipe.relayaccount).
        **({"imports": [{"service": {"account": RELAY_ACCOUNT, "subject": f"{_JS}.>"}, "to": f"{RELAY_API}.>"}]}
           if relay else {}),
    }}
    if relay is not None:
        out[RELAY_ACCOUNT] = _relay_account(relay, pw.get(relay.user))
    for c in apps:
        out[account_name(c.owner)] = {
            # The app's own copy of its tokens (TP_TOKENS, one stream): JetStream for it alone, bounded.
            **bounds,
            "users": [_user(c, pw.get(c.user), [])],
            "imports": _imports(c.owner),
        }
    return out


def _conf_value(value: Any) -> str:
    # nats-server's config format accepts JSON values (strings quoted, lists, maps).
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_conf_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(v) for v in value) + "]"
    return json.dumps(value)


def server_config(creds: dict[str, Credential] | None, tls: TLSFiles | None = None, *,
                  include: str | None = None) -> str:
    """nats-server configuration: the accounts of ``creds`` (None: no authorization), no anonymous
    user; TLS when ``tls`` is given. ``include``: a file holding the accounts block (reloadable
    on its own, :func:`write_server_config`) instead of the block itself."""
    lines = ["# generated by tokenpipe (tokenpipe/natsconfig.py); regenerated at every start", ""]
    if include is not None:
        lines.append(f"include {json.dumps(include)}")
    elif creds is not None:
        lines.append(f"accounts {_conf_value(accounts(creds))}")
    if tls is not None:
        block: dict[str, Any] = {"cert_file": tls.cert, "key_file": tls.key}
        if tls.ca:
            block["ca_file"] = tls.ca
        lines.append("tls " + _conf_value({**block, **({"verify": True} if tls.verify else {})}))
    return "\n".join(lines) + "\n"


def write_server_config(path: str | os.PathLike[str], creds_dir: str | os.PathLike[str],
                        tls: TLSFiles | None = None, settings: Settings | None = None) -> Path:
    """Create the credentials that are missing in ``creds_dir`` (first start), write the accounts
    (bcrypt hashes) into ``creds_dir``/accounts.conf and nats-server's configuration including
    it at ``path`` (both 0600): authorization on, no anonymous user. ``tokenpipe creds add-app``
    rewrites only accounts.conf and asks the running servers to reload it. ``settings``: the
    applications' bounds (:func:`app_limits`; default: the defaults)."""
    accounts_file = write_accounts(creds_dir, settings)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # nats-server resolves an include against the including file's directory, absolute or not.
    rel = os.path.relpath(accounts_file.resolve(), out.parent.resolve())
    write_private(out, server_config(None, tls, include=rel))
    return out


def write_accounts(creds_dir: str | os.PathLike[str], settings: Settings | None = None) -> Path:
    """(Re)write ``creds_dir``/accounts.conf from the credentials there (the apps bounded by
    ``settings``); its path."""
    creds = ensure_credentials(creds_dir)
    path = Path(creds_dir) / ACCOUNTS_FILE
    write_private(path, f"accounts {_conf_value(accounts(creds, settings=settings))}\n")
    return path


def password_env(user: str) -> str:
    """The environment variable nats-server reads ``user``'s password from in the Helm chart."""
    return "TP_" + user.upper().replace("-", "_") + "_PASSWORD"


def chart_accounts() -> dict[str, Any]:
    """The ``accounts`` of deploy/helm's NATS values: the same layout, passwords read by
    nats-server from the environment (``<< $VAR >>`` is the official chart's unquoted form)."""
    creds = {u: Credential(u, "", o) for u, o in [("relay", "relay"), ("generator", "relay"),
                                                   ("admin", "relay"), (app_user("default"), "default")]}
    return accounts(creds, passwords={u: f"<< ${password_env(u)} >>" for u in creds})


# -- the documented tables -----------------------------------------------------------------------

def permission_table() -> str:
    """docs/architecture.md's permission table (markdown), rendered from :func:`permissions`."""
    def cell(subjects: tuple[str, ...]) -> str:
        return "<br>".join(f"`{s.replace('NAME', '<name>')}`" for s in subjects) or "—"

    rows = ["| role (NATS user) | account | publish allow | publish deny | subscribe allow | subscribe deny |",
            "|---|---|---|---|---|---|"]
    for role, user, account in (("relay", "relay", RELAY_ACCOUNT), ("generator", "generator", TOKENPIPE_ACCOUNT),
                                ("admin", "admin", TOKENPIPE_ACCOUNT), ("app", "app-<name>", "APP_<name>")):
        p = permissions(role, "NAME" if role == "app" else None, apps=("NAME",))
        extra = " (+ replies to requests it receives)" if p.allow_responses else ""
        rows.append(f"| {role} (`{user}`) | `{account}` | {cell(p.publish_allow)}{extra} | {cell(p.publish_deny)} "
                    f"| {cell(p.subscribe_allow)} | {cell(p.subscribe_deny)} |")
    return "\n".join(rows) + "\n"


def account_table() -> str:
    """docs/architecture.md's table of what crosses between accounts, rendered from :func:`accounts`."""
    creds = {"relay": Credential("relay", "x"), "app-NAME": Credential("app-NAME", "x", "NAME")}
    layout = accounts(creds, passwords={"relay": "", "app-NAME": ""})
    rows = ["| exported by | subject | kind | imported by | what it carries |", "|---|---|---|---|---|"]
    for account, config in layout.items():
        imports = {json.dumps(i[k]["subject"]): i.get("to") for a in layout.values() for i in a.get("imports", ())
                   for k in ("service", "stream") if k in i and i[k]["account"] == account}
        for e in config.get("exports", ()):
            kind = "service" if "service" in e else "stream"
            subject = str(e[kind])
            who = ", ".join(f"`{a}`" for a in e["accounts"]).replace("APP_NAME", "APP_<name>")
            to = imports.get(json.dumps(subject))
            what = _carries(subject) + (f"; imported as `{to}`" if to and to != subject else "")
            rows.append(f"| `{account}` | `{subject}` | {kind} | {who} | {what} |".replace("NAME", "<name>"))
    return "\n".join(rows) + "\n"


def _carries(subject: str) -> str:
    """What an export carries, for :func:`account_table`."""
    for prefix, what in (
            ("tp.req.", "the owner's requests (placed on a generator's slot or not); JetStream's PubAck comes back "
                        "as the reply, in the owner's account"),
            ("tp.cancel.", "the owner's cancels"),
            (f"tp.live.{RELAY_OWNER}.", "the relay's token batches, live, each once tokenpipe's `TP_TOKENS` stored it"),
            ("tp.live.", "the app's token batches, live, each once tokenpipe's `TP_TOKENS` stored it; kept in "
                         "the app's own `TP_TOKENS` for history"),
            (PLACE_PREFIX, "the generators' placement summaries (hashed prompt prefixes, load), for placement"),
            (ANNOUNCE_PREFIX, "the generators' announcements (load; the relay's own stream ids held)"),
            (DISCOVER_SUBJECT, "the relay's \"announce yourselves now\" to the generators"),
            (STORE_PREFIX, "the relay's questions about its own subjects, answered by the admin (tokenpipe.storeinfo)"),
            (f"{_JS}.CONSUMER.INFO.{REQUESTS_STREAM}",
             "a model's request consumer's state (queue depth, for admission)"),
            (f"{_JS}.CONSUMER.CREATE.{TOKENS_STREAM}",
             "the consumer of the relay's batches that its copy sources (made by the server's sourcing; the relay's "
             "user may not call it)"),
            (RELAY_COPY_PREFIX, "that consumer's deliveries, into the relay's copy of its batches"),
            ("$JS.FC.", "the copy's flow-control answers to that consumer (without them its deliveries stall "
                        "once its window is full)"),
            (f"{_JS}.>", "the relay account's JetStream, to the admin: it provisions and repairs the relay's copy, "
                         "registry and Batch API buckets, and reads the registry")):
        if subject.startswith(prefix):
            return what
    raise ValueError(f"no description of export {subject!r}")
