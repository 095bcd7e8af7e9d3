"""The admin on the bus: provisions tokenpipe's streams and keeps them as provisioned.

Only the admin identity may create or configure streams (tokenpipe.natsauth): ``tokenpipe up``
(and ``tokenpipe nats --auth``) run one of these next to nats-server, in a thread with its own
event loop. It provisions before the roles start, then checks every
:data:`~tokenpipe.bus.REPAIR_INTERVAL_S` seconds and re-creates or restores whatever was deleted
or reconfigured, the request consumers of the served models included (a sealed stream cannot be
restored: it logs what the admin must do). The applications are those with credentials next to
the admin's (``app-*.json``, read again each round: ``tokenpipe creds add-app`` while it runs);
each gets its intake stream, which ``TP_REQUESTS`` sources (tokenpipe.bus.intake_config). It also
answers the relay's questions about its own subjects (tokenpipe.storeinfo), which the relay may not
ask JetStream itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from tokenpipe.background import pause
from tokenpipe.bus import REPAIR_INTERVAL_S, Bus, connect, repair
from tokenpipe.errors import TokenpipeError, TransportError
from tokenpipe.natsauth import app_names, check_app_name
from tokenpipe.settings import Settings
from tokenpipe.storeinfo import StoreAnswers

__all__ = ["Provisioner"]

log = logging.getLogger(__name__)


class Provisioner:
    """Provision with ``admin_creds`` against ``nats_url`` now, repair in the background."""

    def __init__(self, settings: Settings, nats_url: str | None = None, admin_creds: str | Path | None = None) -> None:
        """``admin_creds`` None: ``settings``' own credentials (``TOKENPIPE_NATS_USER=admin`` and its
        password: the Helm chart's provisioner)."""
        # The admin makes each served model's request consumer, and TP_REQUESTS takes only their
        # requests: TOKENPIPE_MODELS, else the one model of these settings (tokenpipe up's).
        self.settings = settings.replace(nats_url=nats_url or settings.nats_url, app_name="",
                                         models=settings.models or settings.model)
        if admin_creds is not None:
            self.settings = self.settings.replace(nats_creds=str(admin_creds), nats_user="")
        # Where the applications' credentials are (None: not known here, e.g. the Helm chart's
        # user and password, which names them in TOKENPIPE_APPS).
        self._creds_dir = Path(self.settings.nats_creds).parent if self.settings.nats_creds else None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self, timeout: float = 60.0) -> Provisioner:
        """Returns once the streams are provisioned; raises :class:`TransportError` if they could not be
        within ``timeout`` seconds."""
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(timeout),), name="provisioner", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout + 15):
            self.stop()
            raise TransportError(f"tokenpipe's streams were not provisioned within {timeout:g} s")
        if self._error is not None:
            self.stop()
            raise TransportError(f"cannot provision tokenpipe's streams: {self._error}") from self._error
        return self

    def wait(self) -> None:
        """Block while it runs (``tokenpipe provision --watch``); returns after :meth:`stop`."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(1.0)

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    async def _run(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        bus = await self._provision(timeout)
        if bus is None:  # the error is start()'s to report
            self._ready.set()
            return
        # The relay's leader-side counts and store checks, which it may not ask JetStream for.
        answers = StoreAnswers(bus.nc, bus.js)
        try:
            await answers.start()
        except Exception as exc:  # reported to start()'s caller, in the other thread
            self._error = exc
            await bus.close()
            return
        finally:
            self._ready.set()
        try:
            while await pause(self._stop, REPAIR_INTERVAL_S):
                await self._repair(bus)
        finally:
            await answers.stop()
            await bus.close()

    async def _provision(self, timeout: float) -> Bus | None:
        """Connect and provision (``connect`` does, as the admin), retrying while a cluster is still
        forming (no meta leader yet, fewer peers than the replicas asked for); None after an error
        that ``start`` reports."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await connect(self.settings, name="tokenpipe-admin", role="admin", apps=self.apps())
            except TokenpipeError as exc:
                if time.monotonic() > deadline or self._stop is None or self._stop.is_set():
                    self._error = exc
                    return None
                log.info("provisioning not possible yet; retrying", extra={"error": exc.message})
            except BaseException as exc:  # reported to start()'s caller, in the other thread
                self._error = exc
                return None
            await pause(self._stop, 0.5)  # the cluster forming: no event to wait for

    def apps(self) -> list[str] | None:
        """The applications whose intake streams the admin keeps: those with credentials next to the
        admin's, else ``TOKENPIPE_APPS``; None where neither tells (TP_REQUESTS is then left as it is)."""
        if self._creds_dir is not None:
            return app_names(self._creds_dir)
        named = [check_app_name(a.strip()) for a in self.settings.apps.split(",") if a.strip()]
        return sorted(set(named)) or None

    async def _repair(self, bus: Bus) -> None:
        if not bus.nc.is_connected:
            return  # nats-server restarting: the next round asks again
        try:
            await repair(bus.js, self.settings, restore_limits=True, apps=self.apps(), relay_js=bus.relay_js)
        except TokenpipeError as exc:  # JetStream recovering, or a change NATS refuses: said, retried
            log.warning("JetStream repair failed", extra={"error": exc.message})
