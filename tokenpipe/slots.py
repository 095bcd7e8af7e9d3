"""The placement slots' consumers: one durable pull consumer per slot and model, on ``TP_REQUESTS``.

A request placed on slot ``k`` (``tp.req.<model>.<owner>.p<k>``, tokenpipe.placement) is stored in
the same work queue as every other request and delivered through ``place-<model>-<k>``, whose
filter no other consumer shares (a work queue allows no overlap). The consumer uses JetStream's
*prioritized* pull policy (nats-server 2.12): the generator holding the slot pulls at priority 0,
every other generator of the model at priority 1 and only while it has idle capacity. A waiting
pull of the holder is always served first; while the holder is not pulling (its slots are full,
or it is gone) the request goes to whoever is, at once. nats-py knows neither the policy nor the
pull fields, so these consumers are made and read through the JetStream API's JSON directly.

Like the shared consumer, they are the provisioner's: where there are users only the admin
creates or restores them; generators bind.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from nats.aio.client import Client as NATS

from .errors import TransportError
from .settings import Settings
from .subjects import REQUESTS_STREAM, slot_consumer_name, slot_filter

__all__ = ["PRIORITY_GROUP", "ensure_slot_consumers", "slot_config", "slot_drift", "slots_drift"]

log = logging.getLogger(__name__)

PRIORITY_GROUP = "tp"  # the one priority group of a slot consumer: every pull names it
_TIMEOUT_S = 5.0


def slot_config(settings: Settings, model: str, slot: int) -> dict[str, Any]:
    """The JetStream configuration of slot ``slot``'s consumer (the shared consumer's ack terms)."""
    name = slot_consumer_name(model, slot)
    return {"name": name, "durable_name": name, "filter_subject": slot_filter(model, slot),
            "ack_policy": "explicit", "ack_wait": int(settings.ack_wait_s * 1e9),
            "max_deliver": settings.max_deliver, "max_ack_pending": -1,
            "priority_groups": [PRIORITY_GROUP], "priority_policy": "prioritized"}


def slot_drift(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs in ``have`` (a consumer's configuration as the server reports it) from ``want``."""
    out = [key for key in ("filter_subject", "ack_policy", "max_deliver", "priority_policy", "priority_groups")
           if have.get(key) != want[key]]
    if abs(int(have.get("ack_wait", 0)) - want["ack_wait"]) > 1_000_000:
        out.append("ack_wait")
    return out


async def _api(nc: NATS, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        msg = await nc.request(subject, json.dumps(body).encode() if body is not None else b"", timeout=_TIMEOUT_S)
        answer: dict[str, Any] = json.loads(msg.data)
    except Exception as exc:  # nats timeouts and no-responders; malformed JSON
        raise TransportError(f"JetStream did not answer {subject.split('.')[3:5]}: {exc!r}") from exc
    return answer


async def _info(nc: NATS, prefix: str, name: str) -> dict[str, Any] | None:
    answer = await _api(nc, f"{prefix}.CONSUMER.INFO.{REQUESTS_STREAM}.{name}")
    error = answer.get("error")
    if error:
        if error.get("code") == 404:
            return None
        raise TransportError(f"consumer {name}: {error.get('description', error)}")
    config: dict[str, Any] = answer.get("config", {})
    return config


async def ensure_slot_consumers(nc: NATS, settings: Settings, models: list[str],
                                prefix: str = "$JS.API") -> list[str]:
    """Create, or restore in place, every slot consumer of ``models``; what was wrong, one line each."""
    fixed = []
    for model in models:
        for slot in range(settings.placement_slots):
            want = slot_config(settings, model, slot)
            have = await _info(nc, prefix, want["name"])
            drift = ["missing"] if have is None else slot_drift(have, want)
            if not drift:
                continue
            create = f"{prefix}.CONSUMER.CREATE.{REQUESTS_STREAM}.{want['name']}.{want['filter_subject']}"
            answer = await _api(nc, create, {"stream_name": REQUESTS_STREAM, "config": want})
            if answer.get("error"):
                raise TransportError(f"cannot create consumer {want['name']}: "
                                     f"{answer['error'].get('description', answer['error'])}")
            fixed.append(f"consumer {want['name']}: {', '.join(drift)}")
    return fixed


async def slots_drift(nc: NATS, settings: Settings, models: list[str], prefix: str = "$JS.API") -> list[str]:
    """The slot consumers of ``models`` that are missing or reconfigured, one sentence each."""
    out = []
    for model in models:
        for slot in range(settings.placement_slots):
            want = slot_config(settings, model, slot)
            have = await _info(nc, prefix, want["name"])
            if have is None:
                out.append(f"consumer {want['name']} is missing (the admin re-creates it)")
            elif drift := slot_drift(have, want):
                out.append(f"consumer {want['name']}: {', '.join(drift)} changed (the admin restores it)")
    return out
