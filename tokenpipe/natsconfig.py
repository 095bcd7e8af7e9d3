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

- ``TOKENPIPE``: the relay, the generators and the admin; JetStream with ``TP_REQUESTS``,
  ``TP_TOKENS``, the ``tp_streams`` registry and, per app, the intake stream ``TP_REQ_<app>``
  where its requests land, which ``TP_REQUESTS`` sources (tokenpipe.bus.intake_config: a
  publisher's ``Nats-Expected-Last-Subject-Sequence-Subject`` header is then evaluated against
  the app's own requests alone, never another app's; the generators may delete a finished
  request's copy there). For each app it exports, to that app's account
  only, the services ``tp.req.*.<app>`` (its requests; JetStream's PubAck is the reply) and
  ``tp.cancel.<app>.>`` (its cancels), and the stream ``tp.live.<app>.>`` (its tokens, live: each
  batch once tokenpipe's ``TP_TOKENS`` accepted it, never one it refused, tokenpipe.append).
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
from .subjects import PLACE_PREFIX, check_owner, owner_tokens

__all__ = [
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
    out: dict[str, Any] = {TOKENPIPE_ACCOUNT: {
        "jetstream": "enabled",
        "users": [_user(c, pw.get(c.user), [a.owner for a in apps]) for c in roles],
        # The placement summaries to every application (a stream export each app imports; none: no apps).
        "exports": [e for c in apps for e in _exports(c.owner)]
        + ([{"stream": f"{PLACE_PREFIX}.>", "accounts": [account_name(c.owner) for c in apps]}] if apps else []),
    }}
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
    for role, user, account in (("relay", "relay", TOKENPIPE_ACCOUNT), ("generator", "generator", TOKENPIPE_ACCOUNT),
                                ("admin", "admin", TOKENPIPE_ACCOUNT), ("app", "app-<name>", "APP_<name>")):
        p = permissions(role, "NAME" if role == "app" else None, apps=("NAME",))
        extra = " (+ replies to requests it receives)" if p.allow_responses else ""
        rows.append(f"| {role} (`{user}`) | `{account}` | {cell(p.publish_allow)}{extra} | {cell(p.publish_deny)} "
                    f"| {cell(p.subscribe_allow)} | {cell(p.subscribe_deny)} |")
    return "\n".join(rows) + "\n"


def account_table() -> str:
    """docs/architecture.md's table of what crosses between accounts, rendered from :func:`accounts`."""
    layout = accounts({"app-NAME": Credential("app-NAME", "x", "NAME")}, passwords={"app-NAME": ""})
    rows = ["| exported by `TOKENPIPE` | kind | imported by | what it carries |", "|---|---|---|---|"]
    what = {"tp.req": "the app's requests (placed on a generator's slot or not); JetStream's PubAck comes back as "
                      "the reply, in the app's account",
            "tp.gen": "the generators' placement summaries (hashed prompt prefixes, load), for the SDK's placement",
            "tp.cancel": "the app's cancels",
            "tp.live": "the app's token batches, live, each once tokenpipe's `TP_TOKENS` stored it; imported "
                       "as `tp.tok.<name>.>` and kept in the app's own `TP_TOKENS` for history"}
    for e in layout[TOKENPIPE_ACCOUNT]["exports"]:
        kind = "service" if "service" in e else "stream"
        subject = str(e[kind]).replace("NAME", "<name>")
        who = "every `APP_<name>`" if subject.startswith(PLACE_PREFIX) else "`APP_<name>` only"
        rows.append(f"| `{subject}` | {kind} | {who} | {what['.'.join(subject.split('.')[:2])]} |")
    return "\n".join(rows) + "\n"
