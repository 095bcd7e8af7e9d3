"""Every account bounded, every role at its least (issue 48), against a real nats-server running
the configuration tokenpipe generates, with tokenpipe's admin provisioning and repairing it.

Each attack of issue 48 that needs no generator is a test here, named after what it did: an app
reserved 52 GiB for its own token stream, opened connections without end and stored requests for
a model nobody serves; a generator re-created the shared request consumer with
``max_ack_pending=1``; the relay answered a question it asked itself onto another owner's live
subject; ``tokenpipe creds add-app relay`` was accepted. Effects are checked from outside: the
server's refusal, and what the admin then reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from producer import Producer
from tokenpipe.bus import Bus, connect
from tokenpipe.errors import ConfigError, Overloaded
from tokenpipe.natsauth import add_app, ensure_credentials, load_credential
from tokenpipe.natsconfig import accounts, write_server_config
from tokenpipe.settings import Settings
from tokenpipe.streams import history, last_batch
from tokenpipe.subjects import REQUESTS_STREAM, TOKENS_STREAM, consumer_name, intake_stream
from tokenpipe.wire import Request, TokenBatch
from tokenpipe_cli.natsserver import NatsServer
from tokenpipe_cli.provisioner import Provisioner

from .conftest import wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-random"
TOKENPIPE = str(Path(sys.executable).parent / "tokenpipe")
# Small bounds, so that reaching them is quick; the defaults are checked on their own.
BOUNDS = {"app_max_connections": 3, "app_max_store_bytes": 32 << 20, "app_max_consumers": 8,
          "request_max_per_owner": 3, "request_max_bytes": 8 << 20}


@dataclass
class Server:
    nats: NatsServer
    creds: Path
    settings: Settings  # the admin's (and the server configuration's) bounds

    def as_user(self, user: str, **changes: object) -> Settings:
        return self.settings.replace(nats_creds=str(self.creds / f"{user}.json"), **changes)

    async def raw(self, user: str, errors: list[str] | None = None) -> NATS:
        """A plain connection with ``user``'s credentials; the server's asynchronous errors go to ``errors``."""
        cred = load_credential(self.creds / f"{user}.json")
        nc = NATS()

        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        await nc.connect(self.nats.url, user=cred.user, password=cred.password, inbox_prefix=cred.inbox_prefix,
                         error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)
        return nc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("bounded-nats")
    creds = d / "creds"
    for app in ("alice", "mallory"):
        add_app(creds, app)
    settings = Settings.load(env={}, data_dir=str(d), model=MODEL, **BOUNDS)
    conf = write_server_config(d / "nats.conf", creds, settings=settings)
    nats = NatsServer(d / "data", config_file=conf).start()
    srv = Server(nats, creds, settings.replace(nats_url=nats.url))
    admin = Provisioner(srv.settings, nats.url, creds / "admin.json").start()
    yield srv
    admin.stop()
    nats.stop()


@pytest.fixture
async def admin(server: Server) -> AsyncIterator[Bus]:
    bus = await connect(server.as_user("admin"), name="test-admin", role="admin", provision_streams=False)
    yield bus
    await bus.close()


async def denied(errors: list[str], subject: str) -> None:
    await wait_until(lambda: any("permissions violation" in e.lower() and subject.lower() in e.lower()
                                 for e in errors), 5, f"the server's refusal of {subject}")


# -- item: accounts bounded ------------------------------------------------------------------------

async def test_an_app_reserved_52_gib_for_its_token_stream_and_the_next_apps_connect_failed(server: Server) -> None:
    # Mallory's SDK starts with a token size cap far over her account's budget: her copy is capped at it.
    async with await Producer.connect(settings=server.as_user("app-mallory", token_max_bytes=1 << 30)):
        pass
    nc = await server.raw("app-mallory")
    try:
        js = nc.jetstream(timeout=5)
        have = (await js.stream_info(TOKENS_STREAM)).config
        assert have.max_bytes == BOUNDS["app_max_store_bytes"]
        for size in (52 << 30, 1 << 30):  # the attack, and a size any server has room for
            with pytest.raises(APIError, match="insufficient storage"):
                await js.update_stream(js_api.StreamConfig.from_response({**have.as_dict(), "max_bytes": size}))
    finally:
        await nc.close()
    async with await Producer.connect(settings=server.as_user("app-alice")):  # the next app still connects
        pass


async def test_an_app_opened_50_extra_connections(server: Server) -> None:
    held = [await server.raw("app-mallory") for _ in range(BOUNDS["app_max_connections"])]
    try:
        with pytest.raises(Exception, match="maximum account active connections"):
            held.append(await server.raw("app-mallory"))
        held.append(await server.raw("app-alice"))  # another account's connections are its own
    finally:
        for nc in held:
            await nc.close()
    await wait_until(lambda: _connects(server), 5, "a freed place to be taken again")


async def _connects(server: Server) -> bool:
    try:
        nc = await server.raw("app-mallory")
    except Exception:  # the server has not yet counted a closed connection out
        return False
    await nc.close()
    return True


async def test_an_app_held_consumers_without_end(server: Server) -> None:
    nc = await server.raw("app-mallory")
    try:
        js = nc.jetstream(timeout=5)
        subs = []
        room = BOUNDS["app_max_consumers"] - (await js.account_info()).consumers
        with pytest.raises(APIError, match="maximum consumers"):
            for i in range(room + 1):
                subs.append(await js.subscribe(f"tp.tok.mallory.c{i}", stream=TOKENS_STREAM, ordered_consumer=True,
                                               config=js_api.ConsumerConfig(name=f"c{i}")))
        assert len(subs) == room
    finally:
        await nc.close()


def test_the_default_bounds_are_in_the_servers_configuration(tmp_path: Path) -> None:
    add_app(tmp_path / "creds", "billing")
    layout = accounts(ensure_credentials(tmp_path / "creds"))
    defaults = Settings.load(env={})
    assert layout["APP_billing"]["jetstream"] == {"max_mem": 0, "max_file": defaults.app_max_store_bytes,
                                                  "max_streams": 1, "max_consumers": defaults.app_max_consumers}
    assert layout["APP_billing"]["limits"] == {"max_connections": defaults.app_max_connections}
    assert defaults.request_max_age_s <= 3600  # a queue, not an archive of a day


async def test_requests_for_a_model_nobody_serves_were_stored_for_a_day(server: Server, admin: Bus) -> None:
    nc = await server.raw("app-mallory")
    try:
        js = nc.jetstream(timeout=5)
        big = Request.build("nomodel", prompt="x" * 1000, params={"max_tokens": 1}).encode()
        with pytest.raises(NoStreamResponseError):  # no stream takes it: stored nowhere
            await js.publish("tp.req.nomodel.mallory", big)
    finally:
        await nc.close()
    # TP_REQUESTS stores nothing itself and sources each owner's intake stream (the relay's too), which
    # takes that owner's requests for the served models only.
    assert not (await admin.js.stream_info(REQUESTS_STREAM)).config.subjects
    for stream, subject in ((REQUESTS_STREAM, None), (intake_stream("relay"), "relay"),
                            (intake_stream("mallory"), "mallory")):
        info = await admin.js.stream_info(stream, subjects_filter="tp.req.nomodel.>")
        assert not info.state.subjects
        cfg = info.config
        if subject is not None:
            assert cfg.subjects == [f"tp.req.{MODEL}.{subject}", f"tp.req.{MODEL}.{subject}.*"]  # shared, placed
        assert cfg.max_age is not None and cfg.max_age <= 3600
        assert (cfg.max_bytes, cfg.max_msgs_per_subject, cfg.discard, cfg.discard_new_per_subject) == (
            BOUNDS["request_max_bytes"], BOUNDS["request_max_per_owner"], js_api.DiscardPolicy.NEW, True)
    sources = (await admin.js.stream_info(REQUESTS_STREAM)).config.sources or []
    assert sorted(s.name for s in sources) == [intake_stream(a) for a in ("alice", "default", "mallory", "relay")]


async def test_one_app_filled_the_request_queue(server: Server, admin: Bus) -> None:
    nc = await server.raw("app-mallory")
    try:
        js = nc.jetstream(timeout=5)
        for i in range(BOUNDS["request_max_per_owner"]):
            req = Request.build(MODEL, prompt="fill", params={"max_tokens": 1}, request_id=f"fill-{i}")
            await js.publish(f"tp.req.{MODEL}.mallory", req.encode())
        one_more = Request.build(MODEL, prompt="fill", params={"max_tokens": 1}, request_id="fill-x")
        with pytest.raises(APIError, match="maximum messages per subject"):
            await js.publish(f"tp.req.{MODEL}.mallory", one_more.encode())
        async with await Producer.connect(settings=server.as_user("app-mallory")) as sdk:  # told at once, not retried
            with pytest.raises(Overloaded, match="queue is full"):
                await asyncio.wait_for(sdk.submit(MODEL, prompt="fill", max_tokens=1), 5)
        async with await Producer.connect(settings=server.as_user("app-alice")) as alice:  # her place is hers
            await (await alice.submit(MODEL, prompt="mine", max_tokens=1)).cancel()
    finally:
        await nc.close()
        await _purge_requests(admin, "mallory", "alice")  # no generator here takes them


# -- item: least privilege for the generators and the relay -------------------------------------------

async def test_a_generator_recreated_the_request_consumer_with_max_ack_pending_1(server: Server, admin: Bus) -> None:
    name = consumer_name(MODEL)
    before = (await admin.js.consumer_info(REQUESTS_STREAM, name)).config
    errors: list[str] = []
    nc = await server.raw("generator", errors)
    try:
        body = json.dumps({"stream_name": REQUESTS_STREAM, "config": {**before.as_dict(), "max_ack_pending": 1}})
        for subject in (f"$JS.API.CONSUMER.CREATE.{REQUESTS_STREAM}.{name}.tp.req.{MODEL}.>",
                        f"$JS.API.CONSUMER.CREATE.{REQUESTS_STREAM}.{name}",
                        f"$JS.API.CONSUMER.DURABLE.CREATE.{REQUESTS_STREAM}.{name}"):
            errors.clear()
            await nc.publish(subject, body.encode(), reply=nc.new_inbox())
            await denied(errors, subject)
    finally:
        await nc.close()
    assert (await admin.js.consumer_info(REQUESTS_STREAM, name)).config.max_ack_pending == before.max_ack_pending


@pytest.mark.parametrize("damage", ["reconfigured", "deleted"])
async def test_a_reconfigured_request_consumer_was_never_repaired(server: Server, admin: Bus, damage: str) -> None:
    name = consumer_name(MODEL)
    wanted = (await admin.js.consumer_info(REQUESTS_STREAM, name)).config
    if damage == "deleted":
        await admin.js.delete_consumer(REQUESTS_STREAM, name)
    else:
        await admin.js.add_consumer(REQUESTS_STREAM, js_api.ConsumerConfig.from_response(
            {**wanted.as_dict(), "max_ack_pending": 1}))

    async def restored() -> bool:
        try:
            have = (await admin.js.consumer_info(REQUESTS_STREAM, name)).config
        except Exception:  # not re-created yet
            return False
        return have.max_ack_pending == wanted.max_ack_pending and have.ack_wait == wanted.ack_wait

    await wait_until(restored, 15, "the admin to restore the request consumer")


async def test_the_relay_answered_its_own_question_onto_alices_next_stream(server: Server) -> None:
    errors: list[str] = []
    relay = await server.raw("relay", errors)
    alice = await server.raw("app-alice")
    got: list[Msg] = []
    try:
        async def arrived(msg: Msg) -> None:
            got.append(msg)

        await alice.subscribe("tp.tok.alice.>", cb=arrived)
        await alice.flush()

        async def answer(msg: Msg) -> None:
            await msg.respond(b'{"id": "job-77", "seq": 0, "text": "the relay wrote this"}')

        await relay.subscribe("tp.readers.job-77", cb=answer)
        await relay.publish("tp.readers.job-77", b"", reply="tp.live.alice.job-77")
        await denied(errors, "tp.live.alice.job-77")
        # Its answers to another relay's question still go out, to that relay's inbox.
        asker = await server.raw("relay")
        try:
            assert (await asker.request("tp.readers.job-77", b"", timeout=5)).data.startswith(b'{"id"')
        finally:
            await asker.close()
        await alice.flush()
        assert not got, [m.data for m in got]
    finally:
        await relay.close()
        await alice.close()


async def test_the_relay_had_a_generator_answer_its_discovery_onto_alices_request_queue(
        server: Server, admin: Bus) -> None:
    """A generator answered ``tp.gen.discover`` on the question's reply subject, which the asker
    chooses: the relay's credential could have its announcement stored as alice's request. A
    generator now announces on its announce subject; its credential answers nothing (and the relay's
    question, from its own account, carries a reply the server mapped, never the one it chose)."""
    errors: list[str] = []
    gen = await server.raw("generator", errors)
    relay = await server.raw("relay")
    heard: list[str] = []
    try:
        async def answer(msg: Msg) -> None:
            heard.append(msg.reply)
            await msg.respond(b'{"worker": "w", "model": "tiny-random"}')

        await gen.subscribe("tp.gen.discover", cb=answer)
        await gen.flush()
        await relay.publish("tp.gen.discover", b"", reply=f"tp.req.{MODEL}.alice")
        await wait_until(lambda: bool(errors), 5, "the server's refusal of the generator's answer")
        assert all("permissions violation" in e.lower() for e in errors), errors
    finally:
        await gen.close()
        await relay.close()
    assert heard and not any(f"tp.req.{MODEL}.alice" in reply for reply in heard), heard
    info = await admin.js.stream_info(REQUESTS_STREAM, subjects_filter=f"tp.req.{MODEL}.alice")
    assert not info.state.subjects


async def test_the_relay_had_its_own_batch_answered_onto_alices_next_stream(server: Server, admin: Bus) -> None:
    """The relay's own stream ``job-77`` (stored as a generator stores it: admin here, no generator),
    fetched by a direct get the relay may make, answered onto ``tp.live.alice.job-77``: the server
    forwarded it into alice's account, which stored it as her ``job-77`` (her reader learnt not to show
    it). Permissions cannot refuse a reply subject; the relay's own account keeps the answer there."""
    planted = TokenBatch(id="job-77", seq=0, index=0, text="the relay wrote this", finish="stop")
    await admin.js.publish("tp.tok.relay.job-77", planted.encode(), headers={"Nats-Msg-Id": "relay:job-77:0:t"})
    own = f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.tp.tok.relay.job-77"
    async with await Producer.connect(settings=server.as_user("app-alice")) as alice:
        relay = await server.raw("relay")
        try:
            async def copied() -> bool:  # the relay's copy has the batch its direct get sends
                return bool((await relay.request(own, b"", timeout=5)).data)

            await wait_until(copied, 10, "the relay's copy of job-77")
            await relay.publish(own, b"", reply="tp.live.alice.job-77")
            assert (await relay.request(own, b"", timeout=5)).data  # answered after the one above
        finally:
            await relay.close()
        info = await alice.bus.js.stream_info(TOKENS_STREAM, subjects_filter="tp.tok.alice.job-77")
        assert not info.state.subjects
        assert await history(alice.bus, "job-77") == []
        assert await last_batch(alice.bus, "job-77") is None
    assert admin.relay_js is not None
    for js in (admin.js, admin.relay_js):
        await js.purge_stream(TOKENS_STREAM, subject="tp.tok.relay.job-77")


async def test_regression_the_relays_copy_stalled_once_its_sourcing_needed_flow_control(
        server: Server, admin: Bus) -> None:
    """The relay's copy sources tokenpipe's ``TP_TOKENS`` through a consumer in tokenpipe's account,
    whose flow-control answers come from the relay's account: not exported, they never reached it, and
    once a burst filled its window the copy stalled (6,000 batches: 5,195 copied 30 s later; under
    ``tokenpipe up``, a generator killed while holding 32 streams left the relay's readers retrying a
    copy that was 100 batches behind). The copy takes the whole burst now."""
    sid = f"burst-{secrets.token_hex(4)}"
    subject, n = f"tp.tok.relay.{sid}", 8000
    for start in range(0, n, 500):
        await asyncio.gather(*(admin.js.publish(subject, b"x" * 300) for _ in range(start, min(n, start + 500))))
    relay_js = admin.relay_js
    assert relay_js is not None

    async def copied() -> bool:
        info = await relay_js.stream_info(TOKENS_STREAM, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0) == n

    await wait_until(copied, 20, f"the relay's copy of all {n} batches")
    for js in (admin.js, relay_js):
        await js.purge_stream(TOKENS_STREAM, subject=subject)


# -- item: reserved names --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["relay", "admin", "generator", "app", "Relay", "tokenpipe"])
def test_an_app_named_relay_read_and_cancelled_the_http_streams(tmp_path: Path, name: str) -> None:
    out = subprocess.run([TOKENPIPE, "creds", "add-app", name, "--creds-dir", str(tmp_path / "creds")],
                         env={**os.environ, "TOKENPIPE_DATA_DIR": str(tmp_path)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "reserved" in out.stderr, out
    assert not (tmp_path / "creds" / f"app-{name}.json").exists()
    # A file written before names were checked is not served either.
    add_app(tmp_path / "creds", "billing")
    (tmp_path / "creds" / f"app-{name}.json").write_text(
        (tmp_path / "creds" / "app-billing.json").read_text().replace('"billing"', json.dumps(name))
        .replace('"app-billing"', json.dumps(f"app-{name}")))
    with pytest.raises(ConfigError, match="reserved"):
        write_server_config(tmp_path / "nats.conf", tmp_path / "creds")


# -- item: each application's requests in a stream of their own (the sequence oracle) ----------------

async def _sourced(admin: Bus, app: str) -> bool:
    """Whether ``app``'s intake stream exists and TP_REQUESTS sources it."""
    try:
        await admin.js.stream_info(intake_stream(app))
    except NotFoundError:
        return False
    sources = (await admin.js.stream_info(REQUESTS_STREAM)).config.sources or []
    return intake_stream(app) in [s.name for s in sources]


async def _purge_requests(admin: Bus, *apps: str) -> None:
    """Empty the apps' intake streams, then TP_REQUESTS, which sources them: in the other order a request not yet
    sourced when TP_REQUESTS was purged arrived after it, and a later test found it on alice's subject (a CI run)."""
    for stream in (*map(intake_stream, apps), REQUESTS_STREAM):
        await admin.js.purge_stream(stream)


async def test_a_deleted_intake_stream_is_recreated_and_its_requests_reach_the_queue_at_once(
        server: Server, admin: Bus) -> None:
    await admin.js.delete_stream(intake_stream("alice"))
    await wait_until(lambda: _sourced(admin, "alice"), 10, "the admin to re-create alice's intake stream")
    nc = await server.raw("app-alice")
    try:
        js = nc.jetstream(timeout=5)
        ack = await js.publish(f"tp.req.{MODEL}.alice", Request.build(MODEL, prompt="again", params={"max_tokens": 1})
                               .encode())
        assert ack.stream == intake_stream("alice") and ack.seq == 1  # her own sequence, nobody else's

        async def queued() -> bool:
            info = await admin.js.stream_info(REQUESTS_STREAM, subjects_filter=f"tp.req.{MODEL}.alice")
            return (info.state.subjects or {}).get(f"tp.req.{MODEL}.alice") == 1

        # A source added while its stream was missing is retried by the server only after ~30 s.
        await wait_until(queued, 5, "alice's request to be sourced into TP_REQUESTS")
    finally:
        await nc.close()
        await _purge_requests(admin, "alice")


async def test_an_app_added_while_the_admin_runs_gets_its_intake_stream(server: Server, admin: Bus) -> None:
    add_app(server.creds, "carol")  # `tokenpipe creds add-app carol`: the admin reads the directory each round
    await wait_until(lambda: _sourced(admin, "carol"), 10, "the admin to make carol's intake stream")
    assert (await admin.js.stream_info(intake_stream("carol"))).config.subjects == [
        f"tp.req.{MODEL}.carol", f"tp.req.{MODEL}.carol.*"]
