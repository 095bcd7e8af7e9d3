"""Tenants isolated on the bus (issue 24), through `tokenpipe up` as a user runs it.

A second application's credential (`tokenpipe creds add-app mallory`, created while the stack
runs: nats-server reloads its accounts) and the roles' own credentials attack the streams of the
relay's HTTP clients and of another application (`alice`). Every attack that worked against the
single-account layout is a test here; each checks that the attack failed and that the victims'
streams finished, what they saw live is what is stored, the registry still serves them, and new
streams are still stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import BadRequestError

from producer import Producer
from tokenpipe.bus import Bus, connect
from tokenpipe.errors import GenerationError
from tokenpipe.natsauth import load_credential
from tokenpipe.settings import Settings
from tokenpipe.storeinfo import ask_count, ask_pending
from tokenpipe.streams import cancel, history, stored_count
from tokenpipe.subjects import (
    ANNOUNCE_PREFIX,
    DISCOVER_SUBJECT,
    META_BUCKET,
    META_STREAM,
    REQUESTS_STREAM,
    TOKENS_STREAM,
    intake_stream,
)
from tokenpipe.wire import Announcement, Request
from tokenpipe_cli.upprocess import UpProcess

from .conftest import wait_until
from .test_heal import Events, read_events, start_stack

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-random"
TOKENPIPE = str(Path(sys.executable).parent / "tokenpipe")
# The relay's keepalive on this stack: a stream older than it is checked for a wiped history at its GET
# (the wiped-history test waits that long; the 15 s default would be 15 s of waiting).
KEEPALIVE_S = 3.0
BODY = {"model": MODEL, "prompt": "Tell me", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
        "coalesce": {"max_tokens": 0}}


class Client:
    """A raw nats-py connection with one of the stack's credentials; records the server's errors."""

    def __init__(self) -> None:
        self.nc = NATS()
        self.errors: list[str] = []

    @classmethod
    async def connect(cls, up: UpProcess, user: str) -> Client:
        self = cls()
        cred = load_credential(up.data / "creds" / f"{user}.json")

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        await self.nc.connect(up.status()["nats_url"], user=cred.user, password=cred.password,
                              inbox_prefix=cred.inbox_prefix, error_cb=on_error, allow_reconnect=False)
        return self

    async def denied(self, action: Awaitable[Any], what: str) -> None:
        """``action`` is refused by the server with a permissions violation naming ``what``."""
        self.errors.clear()
        task = asyncio.ensure_future(action)
        try:
            await wait_until(lambda: any(what.lower() in e.lower() for e in self.errors), 10, f"denial of {what}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert any("permissions violation" in e.lower() for e in self.errors), self.errors


def settings_for(up: UpProcess, user: str) -> Settings:
    return Settings.load(env={}, nats_url=up.status()["nats_url"], nats_creds=str(up.data / "creds" / f"{user}.json"),
                         data_dir=str(up.data))


def add_app(up: UpProcess, name: str) -> str:
    """`tokenpipe creds add-app NAME` next to the running stack; what it said."""
    out = subprocess.run([TOKENPIPE, "creds", "add-app", name], env={**os.environ, "TOKENPIPE_DATA_DIR": str(up.data)},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> AsyncIterator[UpProcess]:
    data = tmp_path_factory.mktemp("tenants")
    (data / "models").symlink_to(data_dir / "models", target_is_directory=True)
    s = start_stack(data, 1, TOKENPIPE_KEEPALIVE_S=str(KEEPALIVE_S))
    try:
        await s.wait_up()
        for app in ("alice", "mallory"):  # made while it runs: no restart
            assert "reloaded (1 running)" in add_app(s, app)
        yield s
        assert await s.stop() == 0, s.output()[-4000:]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


@pytest.fixture(scope="module")
async def admin(up: UpProcess) -> AsyncIterator[Bus]:
    bus = await connect(settings_for(up, "admin"), name="test-admin", role="admin")
    yield bus
    await bus.close()


@pytest.fixture
async def mallory(up: UpProcess) -> AsyncIterator[Client]:
    client = await connected(up, "app-mallory")
    yield client
    await client.nc.close()


async def connected(up: UpProcess, user: str) -> Client:
    """A :class:`Client` of ``user``, once its account is live (a reload is asynchronous)."""
    made: list[Client] = []

    async def connect() -> bool:
        try:
            made.append(await Client.connect(up, user))
        except Exception:  # the account may be a moment away
            return False
        return True

    await wait_until(connect, 30, f"{user}'s account to be live")
    return made[-1]


async def relay_victim(up: UpProcess, attack: Callable[[str], Awaitable[None]] | None = None) -> tuple[str, Events]:
    """An HTTP client's stream; ``attack(stream_id)`` runs after its first tokens arrived."""
    async with httpx.AsyncClient(base_url=up.url, timeout=120) as http:
        r = await http.post("/v1/streams", json=BODY)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        out: Events = []
        fired: list[bool] = []

        async def on_tokens(n: int) -> None:
            if attack is not None and not fired:
                fired.append(True)
                await attack(sid)

        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            await read_events(resp, out, on_tokens)
    return sid, out


async def assert_intact(up: UpProcess, admin: Bus, sid: str, events: Events) -> None:
    """Finished with every token, live == stored, and the registry still serves it (a replay)."""
    assert events[-1][0] == "done" and events[-1][2]["finish"] == "length", events[-1]
    live = [t for e, _, d in events if e == "tokens" for t in d["token_ids"]]
    seqs = [int(i or -1) for e, i, _ in events if e == "tokens"]
    assert seqs == list(range(len(seqs)))
    assert len(live) == BODY["max_tokens"]
    stored = [t for b in await history(admin, sid, owner="relay") for t in b.token_ids]
    assert stored == live
    async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
        out: Events = []
        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            assert resp.status_code == 200, await resp.aread()
            await read_events(resp, out)
    assert [t for e, _, d in out if e == "tokens" for t in d["token_ids"]] == live


async def assert_still_stored(up: UpProcess, admin: Bus) -> None:
    """A new stream after the attack is served and stored."""
    sid, events = await relay_victim(up)
    await assert_intact(up, admin, sid, events)


async def alice_stream(up: UpProcess, admin: Bus, request_id: str | None = None) -> str:
    async with await Producer.connect(settings=settings_for(up, "app-alice")) as p:
        handle = await p.submit(MODEL, prompt="Hi", max_tokens=12, temperature=0, ignore_eos=True,
                                request_id=request_id)
        result = await handle.result()
        assert result.finish == "length" and len(result.token_ids) == 12
        # Her own copy (in her account) and tokenpipe's store hold what she saw.
        own = [t for b in await history(p.bus, handle.id) for t in b.token_ids]
    assert own == result.token_ids
    assert [t for b in await history(admin, handle.id, owner="alice") for t in b.token_ids] == result.token_ids
    return handle.id


async def purge_relay_history(admin: Bus, sid: str) -> None:
    """The admin's wipe of an HTTP stream's history: in tokenpipe's store and in the relay's copy (a
    sourced copy keeps what its source purges, tokenpipe.relayaccount)."""
    assert admin.relay_js is not None
    for js in (admin.js, admin.relay_js):
        await js.purge_stream(TOKENS_STREAM, subject=f"tp.tok.relay.{sid}")


def nope(reply: str) -> tuple[str, bytes, str, dict[str, str]]:
    """A request publish on mallory's own subject whose PubAck is an error, sent to ``reply``."""
    return f"tp.req.{MODEL}.mallory", b"{}", reply, {"Nats-Expected-Stream": "NOPE"}


# -- reply-subject injection ------------------------------------------------------------------------

async def test_a_pub_ack_sent_to_a_cancel_subject_cancels_nothing(up: UpProcess, admin: Bus, mallory: Client) -> None:
    chosen = "alice-chosen-1"
    subject, data, reply, hdrs = nope(f"tp.cancel.alice.{chosen}")
    await mallory.nc.publish(subject, data, reply=reply, headers=hdrs)  # before alice's request exists
    await mallory.nc.flush()

    async def attack(sid: str) -> None:  # mid-stream, on the HTTP client's cancel subject
        subject, data, reply, hdrs = nope(f"tp.cancel.relay.{sid}")
        for _ in range(3):
            await mallory.nc.publish(subject, data, reply=reply, headers=hdrs)
        await mallory.nc.flush()

    sid, events = await relay_victim(up, attack)
    assert not mallory.errors, mallory.errors  # the server took the publishes: the attack was made
    await assert_intact(up, admin, sid, events)
    assert await alice_stream(up, admin, chosen) == chosen
    await assert_still_stored(up, admin)


async def test_a_direct_get_answered_onto_a_live_stream_shows_its_client_nothing(
        up: UpProcess, admin: Bus, mallory: Client) -> None:
    async with await Producer.connect(settings=settings_for(up, "app-mallory")) as p:
        own = await p.submit(MODEL, prompt="MALLORY WAS HERE", max_tokens=4, temperature=0, ignore_eos=True)
        await own.result()  # a stored batch of her own to get

    async def attack(sid: str) -> None:
        for target in (f"tp.tok.relay.{sid}", f"tp.req.{MODEL}.relay"):
            await mallory.nc.publish(f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.mallory.{own.id}", b"", reply=target)
        await mallory.nc.flush()

    sid, events = await relay_victim(up, attack)
    assert not mallory.errors, mallory.errors
    await assert_intact(up, admin, sid, events)
    await assert_still_stored(up, admin)


async def test_a_jetstream_answer_sent_to_the_registry_overwrites_nothing(
        up: UpProcess, admin: Bus, mallory: Client) -> None:
    sid, events = await relay_victim(up)
    before = await admin.meta.get(sid)
    for api in ("$JS.API.INFO", f"$JS.API.STREAM.INFO.{TOKENS_STREAM}"):
        await mallory.nc.publish(api, b"", reply=f"$KV.{META_BUCKET}.{sid}")
    await mallory.nc.flush()
    await mallory.nc.request("$JS.API.INFO", b"", timeout=5)  # answered after the ones above: they are done
    assert (await admin.meta.get(sid)).value == before.value
    await assert_intact(up, admin, sid, events)
    await assert_still_stored(up, admin)


async def test_a_wiped_history_answers_404_expired_not_endless_pings(up: UpProcess, admin: Bus) -> None:
    """A history removed after the stream ended (here the admin's purge; the wipe of the issue went
    through a relay credential, which may no longer touch the store) is 'expired': a reader waiting
    on it gets an error event and ends, and a GET once the stream is older than the keepalive
    (:data:`KEEPALIVE_S` on this stack, 15 s by default: younger ones are asked at the first ping) is a
    404 with code expired."""
    sid, events = await relay_victim(up)
    assert events[-1][0] == "done"
    await purge_relay_history(admin, sid)
    created = time.monotonic()
    async with httpx.AsyncClient(base_url=up.url, timeout=120) as http:
        async with http.stream("GET", f"/v1/streams/{sid}") as resp:
            if resp.status_code == 200:  # young: the reader is told at its first idle ping
                out: Events = []
                await asyncio.wait_for(read_events(resp, out), 60)
                assert [e for e, _, _ in out] == ["error"] and out[0][2]["code"] == "expired", out
            else:  # already older than the keepalive on a slow machine
                assert resp.status_code == 404 and json.loads(await resp.aread())["error"]["code"] == "expired"
        await wait_until(lambda: time.monotonic() - created > KEEPALIVE_S + 1, 30,
                         "the stream to be older than the keepalive")
        r = await http.get(f"/v1/streams/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "expired", r.text
    await assert_still_stored(up, admin)


# -- reconnaissance, dedup, foreign subjects ------------------------------------------------------------

async def test_an_app_lists_only_its_own_stream_ids(up: UpProcess, admin: Bus, mallory: Client) -> None:
    sid, _ = await relay_victim(up)
    await alice_stream(up, admin)
    async with await Producer.connect(settings=settings_for(up, "app-mallory")) as p:
        await (await p.submit(MODEL, prompt="x", max_tokens=2, temperature=0, ignore_eos=True)).result()
    info = await mallory.nc.jetstream(timeout=5).stream_info(TOKENS_STREAM, subjects_filter=">")
    subjects = set(info.state.subjects or {})
    assert subjects and all(s.startswith("tp.tok.mallory.") for s in subjects), subjects
    assert f"tp.tok.relay.{sid}" not in subjects


async def test_a_request_id_published_first_by_another_app_does_not_swallow_the_owners(
        up: UpProcess, admin: Bus, mallory: Client) -> None:
    chosen = "predictable-7"
    js = mallory.nc.jetstream(timeout=5)
    payload = Request.build(MODEL, prompt="squat", params={"max_tokens": 2}, request_id=chosen).encode()
    for msg_id in (f"alice:{chosen}", chosen, f"relay:{chosen}"):
        ack = await js.publish(f"tp.req.{MODEL}.mallory", payload, headers={"Nats-Msg-Id": msg_id})
        assert ack.stream == intake_stream("mallory")  # stored: her own intake, sourced into TP_REQUESTS
    assert await alice_stream(up, admin, chosen) == chosen


async def test_writing_onto_another_owners_subjects_is_denied(up: UpProcess, admin: Bus, mallory: Client) -> None:
    forged = Request.build(MODEL, prompt="forged", params={"max_tokens": 2}).encode()
    await mallory.denied(mallory.nc.publish("tp.tok.relay.anything", b"junk"), '"tp.tok.relay.anything"')
    await mallory.denied(mallory.nc.publish(f"tp.req.{MODEL}.relay", forged), f'"tp.req.{MODEL}.relay"')
    await mallory.denied(mallory.nc.publish("tp.cancel.alice.anything", b""), '"tp.cancel.alice.anything"')
    await mallory.denied(mallory.nc.publish(f"$KV.{META_BUCKET}.anything", b"{}"), f'"$KV.{META_BUCKET}.anything"')
    await assert_still_stored(up, admin)


# -- no role can destroy history ----------------------------------------------------------------------

@pytest.mark.parametrize("user,change", [("relay", {"max_age": 1.0}), ("generator", {"sealed": True}),
                                         ("app-mallory", {"max_age": 1.0})])
async def test_no_role_may_reconfigure_the_token_store(up: UpProcess, admin: Bus, user: str,
                                                        change: dict[str, Any]) -> None:
    sid, events = await relay_victim(up)
    attacker = await Client.connect(up, user)
    before = (await admin.js.stream_info(TOKENS_STREAM)).config
    try:
        cfg = before.as_dict()
        body = json.dumps({**cfg, **{k: (int(v * 1e9) if k == "max_age" else v) for k, v in change.items()}})
        subject = f"$JS.API.STREAM.UPDATE.{TOKENS_STREAM}"
        if user == "app-mallory":  # her own account's copy is hers; tokenpipe's store is not reachable
            await attacker.nc.request(subject, body.encode(), timeout=5)
        else:
            await attacker.denied(attacker.nc.request(subject, body.encode(), timeout=5), subject)
    finally:
        await attacker.nc.close()
    have = (await admin.js.stream_info(TOKENS_STREAM)).config
    assert not have.sealed and have.max_age == before.max_age
    await assert_intact(up, admin, sid, events)
    await assert_still_stored(up, admin)


async def test_a_reconfigured_token_store_is_restored_by_the_admin(up: UpProcess, admin: Bus) -> None:
    sid, events = await relay_victim(up)
    wanted = (await admin.js.stream_info(TOKENS_STREAM)).config
    await admin.js.update_stream(js_api.StreamConfig.from_response({**wanted.as_dict(), "max_age": 7200 * 10**9}))

    async def restored() -> bool:
        return (await admin.js.stream_info(TOKENS_STREAM)).config.max_age == wanted.max_age

    await wait_until(restored, 30, "tokenpipe up's admin to restore max_age")
    await assert_intact(up, admin, sid, events)
    await assert_still_stored(up, admin)


async def test_the_servers_configuration_holds_hashes_not_passwords(up: UpProcess, mallory: Client) -> None:
    """`tokenpipe up`'s nats-server configuration (and the accounts file it includes) never
    holds a password; the credential files do, for the clients (mallory just logged in with hers)."""
    conf = (up.data / "nats" / "nats-server.conf").read_text() + (up.data / "creds" / "accounts.conf").read_text()
    for path in (up.data / "creds").glob("*.json"):
        assert load_credential(path).password not in conf, path.name
    assert conf.count('"password": "$2') == len(list((up.data / "creds").glob("*.json")))


# -- ids owned by (owner, id) (issue 48) ---------------------------------------------------------------

async def test_a_stream_id_another_app_is_running_does_not_refuse_the_owners_request(up: UpProcess,
                                                                                      admin: Bus) -> None:
    """Mallory runs `job-42`; alice's own `job-42` was refused ("a stream id that is taken", logged
    only) and she got nothing, no batch, no error."""
    chosen = f"job-{secrets.token_hex(4)}"
    async with await Producer.connect(settings=settings_for(up, "app-mallory")) as m:
        squat = await m.submit(MODEL, prompt="squat", max_tokens=2000, temperature=0, ignore_eos=True,
                               request_id=chosen)
        batches = squat.__aiter__()
        await anext(batches)  # hers runs: the generator holds `chosen` for mallory now
        assert await asyncio.wait_for(alice_stream(up, admin, chosen), 30) == chosen
        await squat.cancel()
        rest = [b async for b in batches]
    assert rest[-1].finish == "cancelled"  # still running all through alice's stream


async def test_a_flood_of_another_apps_cancels_does_not_erase_the_owners_pending_cancel(up: UpProcess) -> None:
    """10,100 cancels of mallory's own ids erased alice's cancel (remembered for her request still
    to come): the memory was the last 10,000 cancels of all owners together."""
    rid = f"queued-{secrets.token_hex(4)}"
    async with (await Producer.connect(settings=settings_for(up, "app-alice")) as a,
                await Producer.connect(settings=settings_for(up, "app-mallory")) as m):
        await a.cancel(rid)  # before her request: remembered until it comes
        await a.bus.nc.flush()
        last = await m.submit(MODEL, prompt="flood", max_tokens=2000, temperature=0, ignore_eos=True)
        batches = last.__aiter__()
        await anext(batches)
        for i in range(10_100):
            await cancel(m.bus, f"flood-{i}")
        await m.cancel(last.id)  # the flood's last: once it took effect, the generator has seen them all
        assert [b async for b in batches][-1].finish == "cancelled"
        handle = await a.submit(MODEL, prompt="Hi", max_tokens=40, temperature=0, ignore_eos=True, request_id=rid)
        result = await asyncio.wait_for(handle.result(), 30)
    assert (result.finish, result.token_ids) == ("cancelled", [])


async def test_a_request_from_a_newer_wire_version_ends_its_stream_with_an_error_not_silence(up: UpProcess) -> None:
    """A request that did not decode (here: a wire version from the future) but names its id was
    terminated in silence: its client waited for ever."""
    rid = f"future-{secrets.token_hex(4)}"
    async with await Producer.connect(settings=settings_for(up, "app-mallory")) as m:
        future = msgpack.packb({"v": 99, "id": rid, "model": MODEL, "prompt": "from the future"})
        await m.bus.js.publish(f"tp.req.{MODEL}.mallory", future)
        with pytest.raises(GenerationError, match="wire version 99 is newer"):
            await asyncio.wait_for(m.stream(rid).result(), 30)


async def test_a_huge_prompt_on_the_bus_is_refused_before_tokenizing_with_an_error_batch(up: UpProcess) -> None:
    """~950 KB prompts were tokenized on the engine thread (every stream waited); now a prompt over
    `TOKENPIPE_MAX_PROMPT_CHARS` ends its stream with an error batch and is never tokenized, and the
    relay answers 400 with an OpenAI-style error for it."""
    huge = "lorem ipsum dolor sit amet " * 36_000  # 972,000 characters
    async with await Producer.connect(settings=settings_for(up, "app-mallory")) as m:
        handle = await m.submit(MODEL, prompt=huge, max_tokens=4)
        with pytest.raises(GenerationError, match="the prompt exceeds 200000 characters"):
            await asyncio.wait_for(handle.result(), 30)
        async with httpx.AsyncClient(base_url=up.url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": huge[:300_000], "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("prober", ["app-mallory", "relay"])
async def test_another_apps_request_sequence_cannot_be_read_from_a_refusal(up: UpProcess, admin: Bus,
                                                                          prober: str) -> None:
    """Mallory's own request with `Nats-Expected-Last-Subject-Sequence: 0` and
    `Nats-Expected-Last-Subject-Sequence-Subject: tp.req.<model>.alice` (or a wildcard) was refused
    with "wrong last sequence: <alice's>" while alice worked: another application's activity leaked.
    The relay's credential read it the same way, its requests stored in TP_REQUESTS itself; they now
    land in an intake stream of its own too."""
    owner = "relay" if prober == "relay" else "mallory"
    client = await connected(up, prober)
    js = client.nc.jetstream(timeout=5)
    probe = Request.build(MODEL, prompt="probe", params={"max_tokens": 1}).encode()
    answers: list[str] = []
    async with await Producer.connect(settings=settings_for(up, "app-alice")) as a:
        busy = await a.submit(MODEL, prompt="busy", max_tokens=2000, temperature=0, ignore_eos=True)
        batches = busy.__aiter__()
        await anext(batches)  # her request is in the queue now (acked only once her stream ends)
        # The wildcard first: it covers mallory's own requests too, and her first probe (accepted: it
        # is her own request) would be read by it, which is her own activity, not alice's.
        for subject in (f"tp.req.{MODEL}.*", f"tp.req.{MODEL}.alice"):
            try:
                await js.publish(f"tp.req.{MODEL}.{owner}", probe, headers={
                    "Nats-Expected-Last-Subject-Sequence": "0", "Nats-Expected-Last-Subject-Sequence-Subject": subject})
            except BadRequestError as exc:
                answers.append(str(exc))
        await busy.cancel()
        assert [b async for b in batches][-1].finish == "cancelled"
    await client.nc.close()
    assert not any("wrong last sequence" in answer for answer in answers), answers

    async def released() -> bool:  # each finished request gave its place in its owner's bound back
        counts = [(await admin.js.stream_info(intake_stream(app))).state.messages for app in ("alice", owner)]
        return counts == [0, 0]

    await wait_until(released, 10, "the intake copies of the finished requests to be deleted")


# -- the relay's credential (issue 48) --------------------------------------------------------------

# STREAM.INFO takes its ``subjects_filter`` in the request body, which no permission sees: with it on
# TP_TOKENS or TP_REQUESTS the relay's credential listed every owner's stream ids and every application
# with a request queued. The relay may no longer call it there; its leader-side counts (catch-up reads
# that must not trust a replica that is behind; whether a stream is still queued) and /readyz's store
# checks come from the admin (tokenpipe.storeinfo), which builds every filter from the relay's own
# subjects and answers only onto the relay's inboxes.

async def test_the_relays_credential_lists_no_stream_ids_and_the_admin_counts_only_its_own(
        up: UpProcess, admin: Bus) -> None:
    """The relay's ``STREAM.INFO`` with ``subjects_filter: ">"`` listed every owner's stream ids. In
    its own account it reaches only its copy, which holds the relay's batches alone."""
    chosen = f"job-{secrets.token_hex(4)}"
    await alice_stream(up, admin, request_id=chosen)
    relay = await Client.connect(up, "relay")
    try:
        await relay.denied(relay.nc.jetstream(timeout=5).stream_info(REQUESTS_STREAM, subjects_filter=">"),
                           f"$JS.API.STREAM.INFO.{REQUESTS_STREAM}")
        # The admin answers for the relay's own subject only: alice's stream of that id is not counted.
        assert await ask_count(relay.nc, chosen, 5) == 0
        async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
            r = await http.post("/v1/streams", json=BODY)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            async with http.stream("GET", f"/v1/streams/{sid}") as resp:
                events = await read_events(resp, [])
        assert events[-1][0] == "done"
        assert await ask_count(relay.nc, sid, 5) == await stored_count(admin, sid) > 0
        listed = (await relay.nc.jetstream(timeout=5).stream_info(TOKENS_STREAM, subjects_filter=">")).state.subjects
        assert f"tp.tok.relay.{sid}" in (listed or {}), sorted(listed or {})[:5]  # its copy has read the stream
        assert all(subject.startswith("tp.tok.relay.") for subject in listed or {}), sorted(listed or {})
        # A question whose id is a wildcard, or not one token, is refused.
        for bad in ("count.a.b", f"count.{'x' * 65}", "pending.a.b", "config.KV_tp_streams", "list.x"):
            reply = await relay.nc.request(f"tp.store.{bad}", b"", timeout=5)
            assert "error" in json.loads(reply.data), bad
    finally:
        await relay.nc.close()


async def test_a_store_answer_is_sent_only_to_the_relays_inbox(up: UpProcess, admin: Bus) -> None:
    """The relay chooses the reply subject of its questions: an answer sent to ``tp.tok.alice.<id>``
    would be stored in alice's history. The admin answers only onto the relay's inboxes."""
    chosen = f"job-{secrets.token_hex(4)}"
    await alice_stream(up, admin, request_id=chosen)
    before = await stored_count(admin, chosen, owner="alice")
    relay = await Client.connect(up, "relay")
    try:
        for reply in (f"tp.tok.alice.{chosen}", f"tp.live.alice.{chosen}"):
            await relay.nc.publish(f"tp.store.count.{chosen}", b"", reply=reply)
        await relay.nc.flush()
        assert await ask_count(relay.nc, chosen, 5) == 0  # answered after the two above were dropped
    finally:
        await relay.nc.close()
    assert await stored_count(admin, chosen, owner="alice") == before


async def test_the_relays_credential_sees_no_other_apps_queued_requests(up: UpProcess) -> None:
    """TP_REQUESTS' state with ``subjects_filter: ">"`` listed every application that has a request
    queued or running, and how many (an app's requests keep their subject ``tp.req.<model>.<app>``
    when TP_REQUESTS sources them). The relay's count of its own queued requests comes from the admin."""
    relay = await Client.connect(up, "relay")
    try:
        async with await Producer.connect(settings=settings_for(up, "app-alice")) as a:
            busy = await a.submit(MODEL, prompt="busy", max_tokens=2000, temperature=0, ignore_eos=True)
            batches = busy.__aiter__()
            await anext(batches)  # running: her request stays in the queue until its final batch is stored
            try:
                await relay.denied(relay.nc.jetstream(timeout=5).stream_info(REQUESTS_STREAM, subjects_filter=">"),
                                   f"$JS.API.STREAM.INFO.{REQUESTS_STREAM}")
                assert await ask_pending(relay.nc, MODEL, 5) == 0  # hers is not the relay's
            finally:
                await busy.cancel()
                assert [b async for b in batches][-1].finish == "cancelled"
    finally:
        await relay.nc.close()


async def test_the_generators_announcements_name_no_other_owners_stream_ids(up: UpProcess) -> None:
    """Every relay hears the generators' announcements, which named every stream a generator held:
    the relay's credential had a live list of every owner's running stream ids (alice's chosen
    ``job-…`` included). They now count hers and name only the relay's own (an HTTP stream's holder
    is still found by its id)."""
    chosen = f"job-{secrets.token_hex(4)}"
    heard: list[Announcement] = []

    async def on(msg: Any) -> None:
        heard.append(Announcement.decode(msg.data))

    relay = await Client.connect(up, "relay")
    await relay.nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=on)
    try:
        async with (await Producer.connect(settings=settings_for(up, "app-alice")) as a,
                    httpx.AsyncClient(base_url=up.url, timeout=60) as http):
            hers = await a.submit(MODEL, prompt="Hi", max_tokens=2000, temperature=0, ignore_eos=True,
                                  request_id=chosen)
            batches = hers.__aiter__()
            await anext(batches)  # a generator holds hers now
            r = await http.post("/v1/streams", json={**BODY, "max_tokens": 2000})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]

            async def both_held() -> bool:  # a round that holds the relay's stream and hers
                await relay.nc.publish(DISCOVER_SUBJECT, b"")  # the relay's own question: a round now
                return any(sid in ann.streams and ann.active >= 2 for ann in heard)

            try:
                await wait_until(both_held, 30, "an announcement holding both streams")
            finally:
                assert (await http.delete(f"/v1/streams/{sid}")).status_code == 200
                await hers.cancel()
                assert [b async for b in batches][-1].finish == "cancelled"
    finally:
        await relay.nc.close()
    named = {rid for ann in heard for rid in ann.streams}
    assert chosen not in named and not any(hers.id in ann.streams for ann in heard), sorted(named)


async def test_the_relays_credential_reads_no_other_owners_batch_through_a_direct_get(
        up: UpProcess, admin: Bus) -> None:
    """A direct get with its request in the body (``multi_last``, ``next_by_subj`` over ``tp.tok.>``,
    another owner's ``last_by_subj``) would list or read any owner's batches: the body form is not
    the relay's to use; the subject form (``$JS.API.DIRECT.GET.TP_TOKENS.<subject>``, the one it may
    use, for its own subjects) refuses a body, and its wildcard stays within the relay's subjects."""
    sid, _ = await relay_victim(up)
    aid = await alice_stream(up, admin)
    widen = [{"multi_last": ["tp.tok.>"]}, {"next_by_subj": "tp.tok.>", "seq": 1},
             {"last_by_subj": f"tp.tok.alice.{aid}"}]
    relay = await Client.connect(up, "relay")
    try:
        for body in widen:
            await relay.denied(relay.nc.request(f"$JS.API.DIRECT.GET.{TOKENS_STREAM}", json.dumps(body).encode(),
                                                timeout=5), f'"$JS.API.DIRECT.GET.{TOKENS_STREAM}"')
            answer = await relay.nc.request(f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.relay.{sid}",
                                            json.dumps(body).encode(), timeout=5)
            assert (answer.headers or {}).get("Status") == "408" and not answer.data, (body, answer.headers)
        answer = await relay.nc.request(f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.relay.>", b"", timeout=5)
        assert (answer.headers or {}).get("Nats-Subject", "").startswith("tp.tok.relay."), answer.headers
    finally:
        await relay.nc.close()


async def test_the_relays_credential_cannot_widen_a_history_consumer_past_its_own_subjects(up: UpProcess) -> None:
    """The relay creates ordered consumers with its own subject in the create subject; a body whose
    filter reaches further (another filter, ``filter_subjects``) is refused by the server, and
    nothing is delivered."""
    sid, _ = await relay_victim(up)
    relay = await Client.connect(up, "relay")
    delivered: list[str] = []

    async def on(msg: Any) -> None:
        delivered.append(msg.subject)

    try:
        inbox = relay.nc.new_inbox()
        await relay.nc.subscribe(inbox, cb=on)
        for n, widened in enumerate([{"filter_subject": "tp.tok.>"},
                                     {"filter_subject": f"tp.tok.relay.{sid}", "filter_subjects": ["tp.tok.>"]},
                                     {"filter_subjects": [f"tp.tok.relay.{sid}", "tp.tok.>"]}]):
            name = f"wide{n}{secrets.token_hex(4)}"
            body = {"stream_name": TOKENS_STREAM,
                    "config": {"name": name, "deliver_subject": inbox, "ack_policy": "none", **widened}}
            answer = json.loads((await relay.nc.request(
                f"$JS.API.CONSUMER.CREATE.{TOKENS_STREAM}.{name}.tp.tok.relay.{sid}", json.dumps(body).encode(),
                timeout=5)).data)
            assert answer.get("error", {}).get("code") == 400, answer
        await relay.nc.request("$JS.API.INFO", b"", timeout=5)  # answered after anything those could deliver
    finally:
        await relay.nc.close()
    assert not delivered, delivered


@pytest.mark.parametrize("api", ["STREAM.NAMES", "STREAM.LIST", f"CONSUMER.LIST.{TOKENS_STREAM}",
                                 f"CONSUMER.NAMES.{TOKENS_STREAM}", f"CONSUMER.LIST.{REQUESTS_STREAM}",
                                 f"STREAM.MSG.GET.{TOKENS_STREAM}", f"STREAM.MSG.GET.{REQUESTS_STREAM}"])
async def test_the_relays_credential_may_not_list_streams_or_consumers_or_get_anyones_message(
        up: UpProcess, api: str) -> None:
    """Listing streams or consumers names the applications and their readers; the leader's message
    get takes any subject in its body (``last_by_subj: tp.tok.alice.<id>``)."""
    relay = await Client.connect(up, "relay")
    try:
        body = json.dumps({"last_by_subj": "tp.tok.alice.x"} if "MSG.GET" in api else {}).encode()
        await relay.denied(relay.nc.request(f"$JS.API.{api}", body, timeout=5), f'"$JS.API.{api}"')
    finally:
        await relay.nc.close()


async def plant_junk(relay: Client, target: str, relay_sid: str) -> int:
    """Have the server send its own answers to ``target``, a reply subject no permission checks: a
    registry value the relay wrote, got back, a direct get's miss, error PubAcks (of its registry and of
    a request, which crosses into tokenpipe's account and is answered there), a JetStream API answer,
    the admin's store answer. Inside tokenpipe's account each one on ``tp.tok.<owner>.<id>`` was stored
    in that owner's history; in the relay's own account (tokenpipe.relayaccount) they land there. How
    many were sent; returns once the server has answered a request sent after them."""
    value = json.dumps({"last_by_subj": f"$KV.{META_BUCKET}.{relay_sid}"}).encode()
    nope = {"Nats-Expected-Stream": "NOPE"}  # refused: nothing is stored, the error PubAck is the answer
    sends: list[tuple[str, bytes, dict[str, str] | None]] = [
        (f"$JS.API.STREAM.MSG.GET.{META_STREAM}", value, None),
        (f"$KV.{META_BUCKET}.{relay_sid}", b"x", nope),
        (f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.relay.no-such-{secrets.token_hex(4)}", b"", None),
        (f"tp.req.{MODEL}.relay", b"{}", nope),
        (f"tp.store.count.{relay_sid}", b"", None),
        ("$JS.API.INFO", b"", None)]
    for subject, data, hdrs in sends:
        await relay.nc.publish(subject, data, reply=target, headers=hdrs)
    await relay.nc.flush()
    for subject, data, hdrs in sends:  # the same again, answered to the relay: the ones above are done
        await relay.nc.request(subject, data, headers=hdrs, timeout=10)
    assert not relay.errors, relay.errors  # allowed: the attack was made
    return len(sends)


async def stored_junk(admin: Bus, owner: str, stream_id: str) -> int:
    """Messages on the stream's subject that are no batch of it (its batches are contiguous from 0)."""
    return await stored_count(admin, stream_id, owner=owner) - len(await history(admin, stream_id, owner=owner))


async def test_junk_the_relay_had_stored_in_alices_running_stream_did_not_stop_it(up: UpProcess, admin: Bus) -> None:
    """Each message stored on ``tp.tok.alice.<id>`` while her stream ran refused her generator's next
    append: the stream stopped until a redelivery (ack_wait), and the third ended it with an error
    (its deliveries used up). Then the generator learnt to append after junk. Now nothing the relay
    provokes reaches her subjects at all: her stream runs on and holds only her batches."""
    sid, _ = await relay_victim(up)  # the relay's own stream: a registry value to have fetched
    relay = await Client.connect(up, "relay")
    try:
        async with await Producer.connect(settings=settings_for(up, "app-alice")) as a:
            handle = await a.submit(MODEL, prompt="Hi", max_tokens=2000, temperature=0, ignore_eos=True)
            batches = handle.__aiter__()
            seen = [await anext(batches)]
            for _ in range(3):  # the request's delivery attempts (TOKENPIPE_MAX_DELIVER): each used to cost one
                for target in (f"tp.tok.alice.{handle.id}", f"tp.live.alice.{handle.id}"):
                    await plant_junk(relay, target, sid)
                for _ in range(2):
                    seen.append(await asyncio.wait_for(anext(batches), 30))
                    assert not seen[-1].is_final, seen[-1]
            await handle.cancel()
            seen += [b async for b in batches]
            own = [t for b in await history(a.bus, handle.id) for t in b.token_ids]
            assert await stored_junk(a.bus, "alice", handle.id) == 0  # her own copy
    finally:
        await relay.nc.close()
    assert seen[-1].finish == "cancelled", seen[-1]
    assert [b.seq for b in seen] == list(range(len(seen)))
    live = [t for b in seen for t in b.token_ids]
    assert own == live
    assert [t for b in await history(admin, handle.id, owner="alice") for t in b.token_ids] == live
    assert await stored_junk(admin, "alice", handle.id) == 0  # tokenpipe's store


async def test_a_batch_and_junk_the_relay_pre_planted_for_alices_next_id_are_not_hers(
        up: UpProcess, admin: Bus) -> None:
    """The relay's own batch (a direct get of its stream) and the server's answers, stored on
    ``tp.tok.alice.job-77`` and sent to ``tp.live.alice.job-77`` before alice chose that id: her
    stream showed the relay's text, live and in replay. Then her stream learnt to run after them;
    now none of it reaches her subjects."""
    sid, events = await relay_victim(up)
    theirs = "".join(d.get("text", "") for e, _, d in events if e == "tokens")
    chosen = f"job-{secrets.token_hex(4)}"
    relay = await Client.connect(up, "relay")
    try:
        own = f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.relay.{sid}"
        assert (await relay.nc.request(own, b"", timeout=10)).data  # its copy holds the batch it sends
        for target in (f"tp.tok.alice.{chosen}", f"tp.live.alice.{chosen}"):
            await relay.nc.publish(own, b"", reply=target)
            await plant_junk(relay, target, sid)
    finally:
        await relay.nc.close()
    assert await stored_count(admin, chosen, owner="alice") == 0
    assert await alice_stream(up, admin, chosen) == chosen  # finished, her copy and the store hold what she saw
    async with await Producer.connect(settings=settings_for(up, "app-alice")) as a:
        mine = await a.stream(chosen).result()
        assert await stored_junk(a.bus, "alice", chosen) == 0
    assert theirs and theirs not in mine.text
    assert await stored_junk(admin, "alice", chosen) == 0


async def test_a_refused_request_after_the_relays_planting_attempt_still_ends_with_an_error_batch(
        up: UpProcess, admin: Bus) -> None:
    """A request the generator refuses (here a wire version from the future) ends with an error batch
    appended as the stream's first (expected last sequence 0); with junk already on the subject that
    append was refused too, logged as "a stream that has history", and the client heard nothing."""
    sid, _ = await relay_victim(up)
    rid = f"future-{secrets.token_hex(4)}"
    relay = await Client.connect(up, "relay")
    try:
        await plant_junk(relay, f"tp.tok.alice.{rid}", sid)
    finally:
        await relay.nc.close()
    assert await stored_count(admin, rid, owner="alice") == 0
    async with await Producer.connect(settings=settings_for(up, "app-alice")) as a:
        future = msgpack.packb({"v": 99, "id": rid, "model": MODEL, "prompt": "from the future"})
        await a.bus.js.publish(f"tp.req.{MODEL}.alice", future)
        with pytest.raises(GenerationError, match="wire version 99 is newer"):
            await asyncio.wait_for(a.stream(rid).result(), 30)


async def test_a_sealed_token_store_is_reported_and_the_relay_survives_a_restart(up: UpProcess, admin: Bus) -> None:
    """Last in this module: a sealed stream cannot be unsealed (the stack stays degraded)."""
    cfg = (await admin.js.stream_info(TOKENS_STREAM)).config
    await admin.js.update_stream(js_api.StreamConfig.from_response({**cfg.as_dict(), "sealed": True}))
    async with httpx.AsyncClient(base_url=up.url, timeout=10) as http:
        async def reported() -> bool:
            r = await http.get("/readyz")
            return r.status_code == 503 and "sealed" in r.text and "nats stream rm TP_TOKENS" in r.text

        await wait_until(reported, 30, "/readyz to report the sealed store")
        relay = up.role("relay")
        os.kill(relay["pid"], signal.SIGKILL)

        async def back() -> bool:
            role = up.role("relay")
            return role.get("pid") != relay["pid"] and role.get("state") == "ready"

        await wait_until(back, 60, "the relay to come back")  # it no longer crash-loops on the seal
        await wait_until(reported, 30, "/readyz to report it again")
    assert up.proc.poll() is None


