"""Least privilege on the bus: per-role credentials and TLS against a real nats-server running
the configuration tokenpipe generates (tokenpipe.natsauth), with the whole pipeline on it.

Every exploit of issue 13 (an anonymous client read every tenant's tokens, read and rewrote the
stream registry, forged a request, cancelled a foreign stream, deleted TP_TOKENS) is a test here
that now fails for the attacker: with an app's credentials, with another role's, and with none
(the anonymous connection is refused outright).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import api as js_api

from generator.model.loader import load_model
from generator.service.worker import GeneratorWorker
from producer import Producer, RelayClient
from tokenpipe.bus import Bus, connect
from tokenpipe.natsauth import TLSFiles, add_app, load_credential
from tokenpipe.natsconfig import write_server_config
from tokenpipe.settings import Settings
from tokenpipe.streams import last_stored
from tokenpipe.subjects import META_BUCKET, META_STREAM, REQUESTS_STREAM, TOKENS_STREAM, cancel_subject, token_subject
from tokenpipe.wire import Request
from tokenpipe_cli.natsserver import NatsServer
from tokenpipe_cli.provisioner import Provisioner

from .conftest import RelayServer, start_relay, wait_until
from .tlsfiles import PKI, make_pki

MODEL = "tiny-random"


@dataclass
class Secure:
    server: NatsServer
    creds: Path
    pki: PKI

    def settings(self, base: Settings, user: str) -> Settings:
        return base.replace(nats_url=self.server.url, nats_creds=str(self.creds / f"{user}.json"),
                            nats_ca=self.pki.ca, nats_cert=self.pki.client_cert, nats_key=self.pki.client_key)

    def tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.pki.ca)
        ctx.load_cert_chain(self.pki.client_cert, self.pki.client_key)
        return ctx


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    """nats-server with tokenpipe's authorization and mutual TLS, apps ``alice`` and ``bob``."""
    d = tmp_path_factory.mktemp("secure-nats")
    pki = make_pki(d)
    creds = d / "creds"
    add_app(creds, "alice")
    add_app(creds, "bob")
    conf = write_server_config(d / "nats.conf", creds, TLSFiles(pki.server_cert, pki.server_key, pki.ca, verify=True))
    server = NatsServer(d / "data", config_file=conf, tls=True).start()
    secure = Secure(server, creds, pki)
    # Only the admin provisions where there are users (tokenpipe up runs the same Provisioner).
    # It serves MODEL: TP_REQUESTS takes its requests, and its generators' consumer is the admin's.
    admin = Provisioner(secure.settings(Settings.load(env={}, model=MODEL), "admin"), server.url,
                        creds / "admin.json").start()
    yield secure
    admin.stop()
    server.stop()


@pytest.fixture(scope="module")
async def stack(secure: Secure, settings: Settings, data_dir: Path) -> AsyncIterator[tuple[GeneratorWorker,
                                                                                          RelayServer]]:
    """A generator and a relay, each with its own credentials, over TLS."""
    gen_settings = secure.settings(settings, "generator")
    gen_bus = await connect(gen_settings, name="secure-generator", role="generator")
    worker = GeneratorWorker(gen_settings, load_model(MODEL, device="cpu", dtype="float32", data_dir=data_dir),
                             gen_bus)
    await worker.start()
    relay = await start_relay(secure.settings(settings, "relay"))
    yield worker, relay
    await relay.stop()
    await worker.stop(drain_timeout=1.0)
    await gen_bus.close()


class Attacker:
    """A raw nats-py connection that records the server's permission errors."""

    def __init__(self) -> None:
        self.errors: asyncio.Queue[str] = asyncio.Queue()
        self.nc = NATS()

    async def connect(self, secure: Secure, user: str) -> Attacker:
        async def on_error(exc: Exception) -> None:
            self.errors.put_nowait(str(exc))

        cred = load_credential(secure.creds / f"{user}.json")
        await self.nc.connect(secure.server.url, tls=secure.tls(), user=cred.user, password=cred.password,
                              inbox_prefix=cred.inbox_prefix, error_cb=on_error, allow_reconnect=False)
        return self

    async def denied(self, action: Awaitable[Any], what: str) -> None:
        """``action`` is refused by the server: a permissions violation naming ``what``."""
        while not self.errors.empty():
            self.errors.get_nowait()
        task = asyncio.ensure_future(action)
        try:
            err = await asyncio.wait_for(self.errors.get(), 5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # nats-py lower-cases the server's message
        assert "permissions violation" in err.lower() and what.lower() in err.lower(), (what, err)


@pytest.fixture
async def attacker(secure: Secure) -> AsyncIterator[Any]:
    made: list[Attacker] = []

    async def make(user: str) -> Attacker:
        a = await Attacker().connect(secure, user)
        made.append(a)
        return a

    yield make
    for a in made:
        await a.nc.close()


async def relay_stream(relay: RelayServer) -> tuple[str, list[dict[str, Any]]]:
    async with RelayClient(relay.url) as client:
        sid = await client.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0, ignore_eos=True)
        events = [e async for e in client.events(sid)]
    assert events[-1].event == "done", events[-1]
    return sid, [e.json() for e in events if e.event == "tokens"]


async def alice_stream(secure: Secure, settings: Settings) -> str:
    async with await Producer.connect(settings=secure.settings(settings, "app-alice")) as p:
        handle = await p.submit(MODEL, prompt="Hi", max_tokens=6, temperature=0, ignore_eos=True)
        result = await handle.result()
    assert result.finish == "length" and len(result.token_ids) == 6
    return handle.id


# -- what each role may do ---------------------------------------------------------------------

async def test_anonymous_connection_is_refused_even_with_a_client_certificate(secure: Secure) -> None:
    """With no credentials nothing at all is reachable: every exploit fails for an anonymous client."""
    with pytest.raises(Exception) as caught:
        await nats.connect(secure.server.url, tls=secure.tls(), allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=3)
    assert "authorization" in str(caught.value).lower() or isinstance(caught.value, nats.errors.NoServersError)


async def test_the_whole_pipeline_streams_over_tls_with_every_role_on_its_own_credentials(
        stack: tuple[GeneratorWorker, RelayServer], secure: Secure, settings: Settings) -> None:
    _, relay = stack
    _, tokens = await relay_stream(relay)  # relay: submit, registry, fan-out; generator: pull, publish
    assert [t["seq"] for t in tokens] == list(range(len(tokens)))
    assert sum(len(t["token_ids"]) for t in tokens) == 12
    await alice_stream(secure, settings)  # an app: its own request and stream, through JetStream


async def test_admin_may_manage_streams(secure: Secure, attacker: Any) -> None:
    admin = await attacker("admin")
    js = admin.nc.jetstream(timeout=5)
    await js.add_stream(name="TP_SCRATCH", subjects=["scratch.>"])
    assert await js.delete_stream("TP_SCRATCH")


# -- exploits of issue 13, each with an app's and another role's credentials -----------------------

@pytest.mark.parametrize("user", ["app-bob", "generator"])
async def test_reading_another_owners_tokens_live_is_denied(stack: Any, attacker: Any, user: str) -> None:
    a = await attacker(user)
    await a.denied(a.nc.subscribe("tp.tok.>"), 'Subscription to "tp.tok.>"')
    await a.denied(a.nc.subscribe("tp.tok.relay.>"), 'Subscription to "tp.tok.relay.>"')
    await a.denied(a.nc.subscribe("tp.tok.alice.s1"), 'Subscription to "tp.tok.alice.s1"')  # another app's


@pytest.mark.parametrize("user,victim", [("app-bob", "relay"), ("app-bob", "alice"), ("relay", "alice")])
async def test_reading_another_owners_tokens_from_jetstream_is_denied(
        stack: tuple[GeneratorWorker, RelayServer], secure: Secure, settings: Settings, attacker: Any,
        user: str, victim: str) -> None:
    sid = (await relay_stream(stack[1]))[0] if victim == "relay" else await alice_stream(secure, settings)
    a = await attacker(user)
    js = a.nc.jetstream(timeout=5)
    subject = token_subject(victim, sid)
    await a.denied(js.get_last_msg(TOKENS_STREAM, subject, direct=True), f"DIRECT.GET.{TOKENS_STREAM}.{subject}")
    await a.denied(js.subscribe(subject, stream=TOKENS_STREAM, ordered_consumer=True,
                                config=js_api.ConsumerConfig(name="peek")), f"CONSUMER.CREATE.{TOKENS_STREAM}.peek")
    await a.denied(js.subscribe(subject, stream=TOKENS_STREAM, ordered_consumer=True),
                   f'"$JS.API.CONSUMER.CREATE.{TOKENS_STREAM}"')
    await a.denied(js.subscribe("tp.tok.>", stream=TOKENS_STREAM, ordered_consumer=True,
                                config=js_api.ConsumerConfig(name="all")), f"CONSUMER.CREATE.{TOKENS_STREAM}.all")


@pytest.mark.parametrize("user", ["app-bob", "generator"])
async def test_the_stream_registry_can_be_neither_read_nor_rewritten(
        stack: tuple[GeneratorWorker, RelayServer], attacker: Any, user: str) -> None:
    sid, _ = await relay_stream(stack[1])
    a = await attacker(user)
    js = a.nc.jetstream(timeout=5)
    await a.denied(js.key_value(META_BUCKET), f"STREAM.INFO.{META_STREAM}")
    await a.denied(js.get_last_msg(META_STREAM, f"$KV.{META_BUCKET}.{sid}", direct=True), f"DIRECT.GET.{META_STREAM}")
    await a.denied(js.get_msg(META_STREAM, subject=f"$KV.{META_BUCKET}.{sid}"), f"STREAM.MSG.GET.{META_STREAM}")
    await a.denied(a.nc.publish(f"$KV.{META_BUCKET}.{sid}", b"rewritten tenant"), f"$KV.{META_BUCKET}.{sid}")


@pytest.mark.parametrize("user", ["app-bob", "generator"])
async def test_forging_a_request_as_the_relay_is_denied(stack: Any, attacker: Any, user: str) -> None:
    a = await attacker(user)
    forged = Request.build(MODEL, prompt="forged", params={"max_tokens": 4}).encode()
    await a.denied(a.nc.publish(f"tp.req.{MODEL}.relay", forged), f"tp.req.{MODEL}.relay")
    await a.denied(a.nc.jetstream(timeout=5).publish(f"tp.req.{MODEL}.alice", forged), f"tp.req.{MODEL}.alice")


@pytest.mark.parametrize("user", ["app-bob", "generator"])
async def test_cancelling_a_foreign_stream_is_denied(stack: tuple[GeneratorWorker, RelayServer], attacker: Any,
                                                     user: str) -> None:
    a = await attacker(user)
    await a.denied(a.nc.publish(cancel_subject("relay", "somestream"), b""), "tp.cancel.relay.somestream")
    await a.denied(a.nc.publish(cancel_subject("alice", "somestream"), b""), "tp.cancel.alice.somestream")


@pytest.mark.parametrize("user", ["app-bob", "generator", "relay"])
async def test_deleting_or_purging_the_streams_is_denied(stack: Any, attacker: Any, user: str) -> None:
    a = await attacker(user)
    js = a.nc.jetstream(timeout=5)
    await a.denied(js.delete_stream(TOKENS_STREAM), f"STREAM.DELETE.{TOKENS_STREAM}")
    await a.denied(js.purge_stream(REQUESTS_STREAM), f"STREAM.PURGE.{REQUESTS_STREAM}")
    await a.denied(js.delete_stream(META_STREAM), f"STREAM.DELETE.{META_STREAM}")


async def test_an_app_cannot_pull_the_work_queue(stack: Any, attacker: Any) -> None:
    a = await attacker("app-bob")
    js = a.nc.jetstream(timeout=5)
    await a.denied(_fetch_one(js), f"CONSUMER.MSG.NEXT.{REQUESTS_STREAM}")
    await a.denied(a.nc.subscribe(f"tp.req.{MODEL}.>"), "Subscription")


async def _fetch_one(js: Any) -> Any:
    sub = await js.pull_subscribe_bind(durable=f"gen-{MODEL}", stream=REQUESTS_STREAM)
    return await sub.fetch(1, timeout=5)


async def test_a_first_delivery_cannot_take_over_an_existing_stream_id(
        stack: tuple[GeneratorWorker, RelayServer], secure: Secure, caplog: pytest.LogCaptureFixture) -> None:
    """The relay's own namespace: a second request with a used id (past the dedup window) is refused,
    not appended to the finished stream."""
    sid, tokens = await relay_stream(stack[1])
    a = await Attacker().connect(secure, "relay")
    try:
        hijack = Request.build(MODEL, prompt="hijack", params={"max_tokens": 4}, request_id=sid).encode()
        with caplog.at_level(logging.WARNING, logger="generator.service.worker"):
            await a.nc.jetstream(timeout=5).publish(f"tp.req.{MODEL}.relay", hijack, headers={"Nats-Msg-Id": "other"})
            await wait_until(lambda: any("stream id that is taken" in r.getMessage() for r in caplog.records),
                             20, "the generator to refuse the hijack")
    finally:
        await a.nc.close()
    last = await last_stored(stack[0].bus, sid, owner="relay")
    assert last is not None and last[0].seq == tokens[-1]["seq"] and last[0].is_final


async def test_a_denial_is_logged_by_the_role_and_does_not_break_its_connection(
        stack: Any, secure: Secure, settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    bus: Bus = await connect(secure.settings(settings, "relay"), name="denied-relay")
    try:
        with caplog.at_level(logging.ERROR, logger="tokenpipe.bus"):
            await bus.nc.publish("tp.tok.relay.forged", b"x")
            await wait_until(lambda: any("permissions violation" in r.getMessage() for r in caplog.records),
                             10, "the denial to be logged")
        record = next(r for r in caplog.records if "permissions violation" in r.getMessage())
        assert "tp.tok.relay.forged" in str(record.__dict__.get("error"))
        assert bus.nc.is_connected
        await bus.meta.put("still-works", b"{}")  # an allowed operation right after
    finally:
        await bus.close()


async def test_a_generator_hears_the_placement_summaries_on_its_own_credentials(
        stack: tuple[GeneratorWorker, RelayServer]) -> None:
    """Regression (issue 47): the generator role could publish its placement summary but not subscribe to
    the model's summaries ("permissions violation for subscription to tp.gen.place.<model>.*" in every
    `tokenpipe up` log), so no generator ever knew a peer had room, and took every request placed on it."""
    worker, _ = stack
    await wait_until(lambda: worker.worker_id in {s.worker for s in worker.summary.peers.live(MODEL)}, 15,
                     "the generator's own summary heard back through its subscription")
