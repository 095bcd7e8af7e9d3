"""The relay's native stream API over HTTP (httpx) or one WebSocket: create a stream, read its
events, cancel it.

    async with RelayClient("http://127.0.0.1:8000") as relay:    # transport="websocket": /v1/ws
        sid = await relay.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
        async for event in relay.events(sid):
            if event.event == "tokens":
                print(event.json()["text"], end="", flush=True)

With ``transport="websocket"`` every call goes over one ``/v1/ws`` socket (:class:`RelaySocket`),
opened on first use: the events are the same :class:`SSEEvent` objects with the same data.
For a process that cannot reach NATS: :class:`producer.Producer` is the same over NATS.
Failures raise the :mod:`tokenpipe.errors` family: the relay's error ``code`` picks the class,
and an unreachable relay or a connection lost mid-stream is a :class:`TransportError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from tokenpipe.errors import TransportError

from .relay_socket import RelaySocket, relay_error
from .sse import SSEEvent, SSEParser

__all__ = ["RelayClient", "aiter_sse"]

_FINAL_EVENTS = frozenset({"done", "error"})


async def aiter_sse(response: httpx.Response) -> AsyncIterator[SSEEvent]:
    """The events of a streaming httpx response (opened with ``client.stream(...)``), as they arrive."""
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield event


class RelayClient:
    """A small client of ``/v1/streams`` (``transport="sse"``, the default) or ``/v1/ws``
    (``transport="websocket"``: many streams over one socket). Pass ``http`` to share an
    ``httpx.AsyncClient`` (its base URL must be the relay's); otherwise one is made from ``url``
    and closed with this one."""

    def __init__(self, url: str | None = None, *, api_key: str | None = None, timeout: float = 600.0,
                 http: httpx.AsyncClient | None = None, transport: str = "sse") -> None:
        if transport not in ("sse", "websocket"):
            raise ValueError(f"transport must be 'sse' or 'websocket', not {transport!r}")
        self.transport = transport
        self._socket: RelaySocket | None = None
        self._owned = http is None
        if http is None:
            if url is None:
                raise ValueError("RelayClient needs the relay's url or an httpx client")
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            http = httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers)
        self.http = http
        auth = http.headers.get("authorization", "")
        self._api_key = api_key or (auth.partition(" ")[2] or None)

    async def __aenter__(self) -> RelayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _ws(self) -> RelaySocket:
        if self._socket is None:
            self._socket = RelaySocket(str(self.http.base_url), api_key=self._api_key)
        return self._socket

    async def aclose(self) -> None:
        if self._socket is not None:
            await self._socket.aclose()
        if self._owned:
            await self.http.aclose()

    async def create(self, body: Mapping[str, Any] | None = None, **fields: Any) -> str:
        """``POST /v1/streams`` with ``body`` and ``fields`` (model, prompt or messages or
        input_ids, sampling parameters, coalesce); returns the new stream's id."""
        if self.transport == "websocket":
            return await self._ws().create(body, **fields)
        resp = await self._send("POST", "/v1/streams", json={**(body or {}), **fields})
        return str(resp.json()["id"])

    async def events(self, stream_id: str, *, last_event_id: int | None = None) -> AsyncIterator[SSEEvent]:
        """The stream's SSE events (``tokens``, ``gap``, then ``done`` or ``error``), from the
        start or after batch ``last_event_id``; ends after the final event."""
        if self.transport == "websocket":
            async for event in self._ws().events(stream_id, after_seq=last_event_id):
                yield event
            return
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else None
        try:
            async with self.http.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as resp:
                if not resp.is_success:
                    await resp.aread()
                    _raise_for_error(resp)
                async for event in aiter_sse(resp):
                    yield event
                    if event.event in _FINAL_EVENTS:
                        return
        except httpx.HTTPError as exc:
            raise _transport(exc) from exc
        raise TransportError(f"the stream {stream_id} ended before its final event")

    async def cancel(self, stream_id: str) -> None:
        """``DELETE /v1/streams/{id}``: stop generating (the stream then ends with ``cancelled``)."""
        if self.transport == "websocket":
            await self._ws().cancel(stream_id)
            return
        await self._send("DELETE", f"/v1/streams/{stream_id}")

    async def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request whose answer is read whole: an error answer raises, as a failed transport does."""
        try:
            resp = await self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise _transport(exc) from exc
        _raise_for_error(resp)
        return resp


def _transport(exc: httpx.HTTPError) -> TransportError:
    return TransportError(f"relay request failed: {exc!r}")


def _raise_for_error(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        err = resp.json()["error"]
        message, code, param = str(err["message"]), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        message, code, param = resp.text or resp.reason_phrase, None, None
    raise relay_error(message, code, param, status=resp.status_code, retry_after=resp.headers.get("retry-after", "1"))
