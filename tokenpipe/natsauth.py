"""Who may do what on the bus: per-role NATS permissions, credentials, and connection options.

The permission table is data (:func:`permissions`), rendered by :mod:`tokenpipe.natsconfig`.

Roles: ``relay`` (in its own account, tokenpipe.relayaccount: publishes requests and cancels as owner
``relay``, reads its own token streams from its copy of them, the only writer of the ``tp_streams``
registry), ``generator`` (pulls its
model's work queue through the consumer the admin made, publishes any owner's tokens, hears
cancels), ``admin`` (the CLI's ``streams``/``replay``/``tail``; everything, deleting streams included) and one
``app-<name>`` per application using the producer SDK directly (its own requests, cancels
and token streams only).

Credentials are tokenpipe's own JSON files (``{"user", "password", "owner", "inbox_prefix"}``)
written 0600 into a 0700 directory, or a NATS ``.creds`` file (JWT + nkey seed) for an
operator-mode cluster, or ``nats_user``/``nats_password``.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .cluster import server_list
from .errors import ConfigError, InvalidRequest
from .settings import Settings
from .subjects import (
    ALIVE_PREFIX,
    ANNOUNCE_PREFIX,
    BATCHES_BUCKET,
    BATCHES_STREAM,
    CANCEL_WILDCARD,
    DISCOVER_SUBJECT,
    FILES_BUCKET,
    FILES_STREAM,
    HELD_PREFIX,
    LIVE_WILDCARD,
    META_BUCKET,
    META_STREAM,
    PLACE_PREFIX,
    READERS_WILDCARD,
    RELAY_OWNER,
    REQUEST_WILDCARD,
    REQUESTS_STREAM,
    STORE_PREFIX,
    TOKEN_WILDCARD,
    TOKENPIPE_API,
    TOKENS_STREAM,
    check_owner,
    intake_stream,
    owner_tokens,
)

__all__ = [
    "RESERVED_APP_NAMES",
    "ROLES",
    "TLSFiles",
    "Credential",
    "Identity",
    "Permissions",
    "add_app",
    "app_names",
    "app_user",
    "check_app_name",
    "connect_options",
    "ensure_credentials",
    "identity",
    "inbox_prefix",
    "is_permission_error",
    "load_credential",
    "permissions",
    "write_private",
]

ROLES = ("relay", "generator", "admin", "app")
# Names an application may not take: an app named "relay" was the owner of every HTTP stream (its
# account imported their live tokens and their cancel service: it read and cancelled them); the
# role names and "tokenpipe" (the roles' account) would read as tokenpipe's own users.
RESERVED_APP_NAMES = frozenset({RELAY_OWNER, *ROLES, "tokenpipe"})
_JS = "$JS.API"
_NEVER = (f"{_JS}.STREAM.DELETE.>", f"{_JS}.STREAM.PURGE.>")  # only the admin removes data


@dataclass(frozen=True)
class Permissions:
    """One NATS user's permissions (nats-server's ``permissions`` block)."""

    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False  # may answer a request it received (on the asker's inbox)

    def as_config(self) -> dict[str, Any]:
        perms: dict[str, Any] = {}
        for op, allow, deny in (("publish", self.publish_allow, self.publish_deny),
                                ("subscribe", self.subscribe_allow, self.subscribe_deny)):
            perms[op] = {"allow": list(allow), **({"deny": list(deny)} if deny else {})}
        if self.allow_responses:
            perms["allow_responses"] = True
        return perms


def app_user(name: str) -> str:
    """The NATS user (and inbox name) of application ``name``."""
    return f"app-{check_owner(name)}"


def inbox_prefix(user: str) -> str:
    """Each user's replies come to its own inboxes, so its permissions can confine them."""
    return f"_INBOX.{user}"


def _look(*streams: str) -> tuple[str, ...]:
    # Stream creation and configuration are the admin's (tokenpipe up's provisioner, the Helm
    # chart's provisioner Deployment): a role may only look. A relay that could update TP_TOKENS
    # set max_age to 1 s and wiped every owner's history; a generator that could seal it stopped
    # all storage for good.
    return tuple(f"{_JS}.STREAM.INFO.{s}" for s in streams)


def _read_tokens(tokens: str) -> tuple[str, ...]:
    """What reading ``tokens`` (``tp.tok.<owner>.>`` or all) from JetStream takes: the direct
    get of a subject's last batch, and ordered consumers whose filter is in the create subject
    (the server checks that the filter in the body is the one in the subject)."""
    return (f"{_JS}.DIRECT.GET.{TOKENS_STREAM}.{tokens}",
            f"{_JS}.CONSUMER.CREATE.{TOKENS_STREAM}.*.{tokens}",
            f"$JS.FC.{TOKENS_STREAM}.>")


def _batch_api() -> tuple[str, ...]:
    """The relay's Batch API (relay.files, relay.batches): write and read objects in ``tp_files`` (a
    file is never overwritten: that would purge, which only the admin may; retention removes it) and
    records in ``tp_batches``, read back by get and by ordered consumers."""
    return (f"$O.{FILES_BUCKET}.>", f"$KV.{BATCHES_BUCKET}.>",
            *_look(FILES_STREAM, BATCHES_STREAM),
            f"{_JS}.STREAM.MSG.GET.{FILES_STREAM}",
            f"{_JS}.DIRECT.GET.{BATCHES_STREAM}.>", f"{_JS}.STREAM.MSG.GET.{BATCHES_STREAM}",
            # nats-py's ordered consumers (watches, a file's chunks) are created unnamed, so the filter is
            # not in the subject: the relay may read all of both buckets, which are its own anyway.
            f"{_JS}.CONSUMER.CREATE.{FILES_STREAM}", f"{_JS}.CONSUMER.CREATE.{BATCHES_STREAM}",
            f"{_JS}.CONSUMER.INFO.{FILES_STREAM}.*", f"{_JS}.CONSUMER.INFO.{BATCHES_STREAM}.*",
            f"$JS.FC.{FILES_STREAM}.>", f"$JS.FC.{BATCHES_STREAM}.>")


def permissions(role: str, app: str | None = None, *, apps: Iterable[str] = ()) -> Permissions:
    """The permissions of ``role`` (``app`` needs the application's name; ``apps``, every
    application: a generator deletes a finished request's copy in its intake stream)."""
    if role == "relay":
        mine = owner_tokens(RELAY_OWNER)
        # In its own account (tokenpipe.relayaccount): requests, cancels, the generators' discovery and
        # the admin's store answers are services imported from tokenpipe's account, whose replies come
        # back into the relay's; so do its one look at TP_REQUESTS' consumers (``$JS.TP.API``) and its
        # live batches, announcements and placement summaries. Its own JetStream holds only its copy of
        # its batches, its registry and its Batch API buckets, which the admin provisions.
        return Permissions(
            # Its answer to another relay's "who reads this stream?" goes to that relay's inbox, which
            # is named here, not with ``allow_responses`` (it could answer itself with any reply subject).
            publish_allow=(f"tp.req.*.{RELAY_OWNER}", f"tp.req.*.{RELAY_OWNER}.*", f"tp.cancel.{RELAY_OWNER}.>",
                           DISCOVER_SUBJECT, f"{STORE_PREFIX}.>",
                           f"{TOKENPIPE_API}.CONSUMER.INFO.{REQUESTS_STREAM}.*",
                           READERS_WILDCARD, f"{inbox_prefix('relay')}.>",
                           f"$KV.{META_BUCKET}.>", f"{_JS}.INFO",
                           *_look(META_STREAM, TOKENS_STREAM),
                           f"{_JS}.DIRECT.GET.{META_STREAM}.>", f"{_JS}.STREAM.MSG.GET.{META_STREAM}",
                           *_read_tokens(mine), *_batch_api()),
            # Live batches come on tp.live (only what the store accepted); history from its copy.
            subscribe_allow=(f"{inbox_prefix('relay')}.>", f"tp.live.{RELAY_OWNER}.>", f"{ANNOUNCE_PREFIX}.>",
                             f"{PLACE_PREFIX}.>", READERS_WILDCARD),
            # Only the server's sourcing creates consumers in tokenpipe's account, for the relay's copy.
            publish_deny=(TOKEN_WILDCARD, LIVE_WILDCARD, f"{TOKENPIPE_API}.CONSUMER.CREATE.>", *_NEVER),
        )
    if role == "generator":
        return Permissions(
            publish_allow=(TOKEN_WILDCARD, LIVE_WILDCARD, f"{ANNOUNCE_PREFIX}.>", f"{_JS}.INFO",
                           # What each holds, and the alive probes (generator.service.rescue).
                           f"{HELD_PREFIX}.>", f"{ALIVE_PREFIX}.>", f"{PLACE_PREFIX}.>",
                           *_look(REQUESTS_STREAM, TOKENS_STREAM),
                           # Binds the admin's request consumer; never creates or configures it.
                           f"{_JS}.CONSUMER.INFO.{REQUESTS_STREAM}.*",
                           f"{_JS}.CONSUMER.MSG.NEXT.{REQUESTS_STREAM}.*", f"$JS.ACK.{REQUESTS_STREAM}.>",
                           f"{_JS}.STREAM.MSG.GET.{REQUESTS_STREAM}", f"{_JS}.STREAM.MSG.DELETE.{REQUESTS_STREAM}",
                           # A finished request's place in its owner's bound (tokenpipe.bus.release_intake).
                           *(f"{_JS}.STREAM.MSG.DELETE.{intake_stream(a)}" for a in (RELAY_OWNER, *apps)),
                           *_read_tokens(TOKEN_WILDCARD)),
            # Its peers' placement summaries: whether one of them has room (generator.service.placed).
            subscribe_allow=(f"{inbox_prefix('generator')}.>", CANCEL_WILDCARD, DISCOVER_SUBJECT,
                             f"{HELD_PREFIX}.>", f"{ALIVE_PREFIX}.>", f"{PLACE_PREFIX}.>",
                             f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{REQUESTS_STREAM}.*"),
            publish_deny=(REQUEST_WILDCARD, CANCEL_WILDCARD, "$KV.>", *_NEVER),
            subscribe_deny=(TOKEN_WILDCARD, LIVE_WILDCARD),
        )
    if role == "admin":
        return Permissions(publish_allow=(">",), subscribe_allow=(">",))
    if role == "app":
        if app is None:
            raise ValueError("the app role needs the application's name")
        user = app_user(app)
        mine = owner_tokens(app)
        # In its own account (tokenpipe.natsconfig): tp.req/tp.cancel are imported services of
        # tokenpipe's account; its JetStream API calls reach only its own copy of its tokens
        # (TP_TOKENS there), which it provisions itself.
        return Permissions(
            publish_allow=(f"tp.req.*.{app}", f"tp.req.*.{app}.*", f"tp.cancel.{app}.>", f"{_JS}.INFO",
                           *(f"{_JS}.STREAM.{op}.{TOKENS_STREAM}" for op in ("INFO", "CREATE", "UPDATE")),
                           *_read_tokens(mine)),
            subscribe_allow=(f"{inbox_prefix(user)}.>", mine, f"{PLACE_PREFIX}.>"),
            publish_deny=(TOKEN_WILDCARD, "$KV.>", f"{_JS}.CONSUMER.MSG.NEXT.>", *_NEVER),
        )
    raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")


# -- credentials --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credential:
    """A user/password credential as tokenpipe writes it (one JSON file per user)."""

    user: str
    password: str
    owner: str = RELAY_OWNER  # whose streams this user makes and reads
    inbox_prefix: str = ""

    @property
    def role(self) -> str:
        return "app" if self.user.startswith("app-") else self.user


def _ensure(d: Path, user: str, owner: str) -> Path:
    """``d``/``user``.json, written with a new password unless it exists."""
    path = d / f"{user}.json"
    if not path.exists():
        cred = Credential(user, secrets.token_urlsafe(24), owner, inbox_prefix(user))
        write_private(path, json.dumps(asdict(cred), indent=1))
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner alone (credentials, configs holding passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode on O_CREAT


def _creds_dir(path: str | os.PathLike[str]) -> Path:
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def load_credential(path: str | os.PathLike[str]) -> Credential:
    try:
        raw = json.loads(Path(path).read_text())
        return Credential(str(raw["user"]), str(raw["password"]), str(raw.get("owner") or RELAY_OWNER),
                          str(raw.get("inbox_prefix") or ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"unusable credentials file {path}: {exc}") from exc


def app_names(creds_dir: str | os.PathLike[str]) -> list[str]:
    """The applications with credentials in ``creds_dir`` (``app-*.json``; none if it does not
    exist), without creating anything; a reserved name is left out (:func:`check_app_name`)."""
    d = Path(creds_dir)
    owners = [load_credential(path).owner for path in sorted(d.glob("app-*.json"))] if d.is_dir() else []
    return sorted({o for o in owners if o.lower() not in RESERVED_APP_NAMES})


def ensure_credentials(creds_dir: str | os.PathLike[str]) -> dict[str, Credential]:
    """The credentials in ``creds_dir`` by user, creating the missing ones (first start); every
    ``app-*.json`` already there is kept (``tokenpipe creds add-app``)."""
    d = _creds_dir(creds_dir)
    for user, owner in [("relay", RELAY_OWNER), ("generator", RELAY_OWNER), ("admin", RELAY_OWNER),
                        (app_user("default"), "default")]:
        _ensure(d, user, owner)
    creds = [load_credential(path) for path in sorted(d.glob("*.json"))]
    return {cred.user: cred for cred in creds}


def check_app_name(name: str) -> str:
    """``name`` if an application may have it; :class:`ConfigError` for a reserved one (compared
    without case: ``Relay`` reads as the relay too) or one that is no valid owner."""
    check_owner(name)
    if name.lower() in RESERVED_APP_NAMES:
        raise ConfigError(f"{name!r} is reserved for tokenpipe's own roles and streams; choose another "
                          f"application name (reserved: {', '.join(sorted(RESERVED_APP_NAMES))})", param="name")
    return name


def add_app(creds_dir: str | os.PathLike[str], name: str) -> Path:
    """Create (or keep) application ``name``'s credentials file; its path. A reserved name
    (:data:`RESERVED_APP_NAMES`) raises :class:`ConfigError`."""
    return _ensure(_creds_dir(creds_dir), app_user(check_app_name(name)), name)


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    ca: str = ""
    verify: bool = False  # require client certificates signed by ``ca``


# -- a role's connection -------------------------------------------------------------------------

@dataclass(frozen=True)
class Identity:
    """How one process appears on the bus."""

    owner: str  # the owner in the subjects of the streams it makes and reads
    provisions: bool  # may create/update tokenpipe's streams (the admin; anyone on an open bus)
    registry: bool  # reads/writes the tp_streams registry (the relay, the admin)
    options: dict[str, Any]  # nats.connect keyword arguments: auth, TLS, inbox prefix
    # An app in its own account (tokenpipe.natsconfig) keeps its tokens in its own TP_TOKENS,
    # which it provisions (tokenpipe.bus.provision_copy).
    own_account: bool = False
    # The relay in its own account (tokenpipe.relayaccount): tokenpipe's user ``relay``, which
    # tokenpipe.natsconfig always puts there.
    relay_account: bool = False
    # A secret only this identity knows, for Nats-Msg-Id (Bus.msg_id): another tenant that
    # publishes first with a guessed id cannot make JetStream drop this one's request as a duplicate.
    secret: bytes = b""


def _default_creds(settings: Settings, role: str) -> str:
    """``tokenpipe up`` writes every role's credentials into the data dir: a role started by hand
    next to it (or the CLI) finds its own there, for the NATS server that ``up.json`` names. A
    client of another server (a test's or a benchmark's own, on an open bus) does not present them."""
    user = app_user(settings.app_name or "default") if role == "app" else role
    path = Path(settings.data_dir) / "creds" / f"{user}.json"
    return str(path) if path.exists() and _names_ups_server(settings) else ""


def _names_ups_server(settings: Settings) -> bool:
    """Whether ``settings.nats_url`` shares a server with the data dir's ``up.json`` (True where
    there is no readable ``up.json``: nothing says the credentials belong elsewhere)."""
    try:
        status = json.loads((Path(settings.data_dir) / "up.json").read_text(encoding="utf-8"))
        return bool(_endpoints(str(status["nats_url"])) & _endpoints(settings.nats_url))
    except (OSError, ValueError, KeyError, TypeError, ConfigError):  # ConfigError: a URL list naming no server
        return True


def _endpoints(nats_url: str) -> set[tuple[str, int]]:
    """``(host, port)`` of each server in a URL list, every loopback name spelled alike."""
    out = set()
    for url in server_list(nats_url):
        try:
            parsed = urlsplit(url if "://" in url else f"nats://{url}")
            port = parsed.port or 4222
        except ValueError:
            continue
        host = (parsed.hostname or "").lower()
        out.add(("loopback" if host in _LOOPBACK else host, port))
    return out


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", ""})


def connect_options(settings: Settings) -> dict[str, Any]:
    """TLS keyword arguments for ``nats.connect`` (a ``tls://`` URL, a CA, a client certificate)."""
    if not (settings.nats_ca or settings.nats_cert or settings.nats_url.startswith("tls://")):
        return {}
    ctx = ssl.create_default_context(cafile=settings.nats_ca or None)
    if settings.nats_cert:
        ctx.load_cert_chain(settings.nats_cert, settings.nats_key or None)
    return {"tls": ctx}


def identity(settings: Settings, role: str) -> Identity:
    """Who a process of ``role`` is on the bus, from its settings (and, failing them, the
    credentials ``tokenpipe up`` wrote into the data dir)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    options = connect_options(settings)
    owner = settings.app_name or ""
    prefix = settings.nats_inbox_prefix
    creds = settings.nats_creds or ("" if settings.nats_user else _default_creds(settings, role))
    user = ""
    secret = b""
    if creds:
        if "-----BEGIN NATS USER JWT-----" in _head(creds):
            options["user_credentials"] = creds
        else:
            cred = load_credential(creds)
            user, secret = cred.user, cred.password.encode()
            options.update(user=cred.user, password=cred.password)
            prefix = prefix or cred.inbox_prefix
            if cred.role == "app":
                owner = owner or cred.owner
    elif settings.nats_user:
        user, secret = settings.nats_user, settings.nats_password.encode()
        options.update(user=settings.nats_user, password=settings.nats_password)
    if prefix:
        options["inbox_prefix"] = prefix
    # An app with no name of its own (an open bus, no credentials) acts in the relay's namespace,
    # as the SDK did before owners existed: it then provisions and writes the registry too.
    is_app = role == "app" and bool(owner) and owner != RELAY_OWNER
    # Only the admin configures streams where users exist: tokenpipe's own users (relay,
    # generator) may not; a JWT user's rights are its operator's business (it tries).
    provisions = not is_app and (user in ("", "admin") or "user_credentials" in options)
    return Identity(owner=check_owner(owner) if is_app else RELAY_OWNER, provisions=provisions,
                    registry=(role in ("relay", "admin") or (role == "app" and not is_app)),
                    options=options, own_account=is_app and user == app_user(owner), secret=secret,
                    relay_account=role == "relay" and user == "relay")


def _head(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(64)
    except OSError as exc:
        raise InvalidRequest(f"cannot read credentials file {path}: {exc}") from exc


def is_permission_error(exc: BaseException) -> bool:
    """Whether nats-py's error callback got the server's "permissions violation" for a publish or subscribe."""
    return "permissions violation" in str(exc).lower()
