"""``tokenpipe up`` as a child process, read through its ``up.json`` and the generators'
announcements: for scripts that kill its roles (``python -m bench.takeover``, the heal tests).

It connects to the stack's NATS with the admin credentials ``tokenpipe up`` wrote (NATS runs
with authorization on) and keeps each generator's last announcement, which names the streams
it holds, so a caller can find (and kill) the generator holding a stream.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

from tokenpipe.cluster import server_list
from tokenpipe.natsauth import load_credential
from tokenpipe.subjects import ANNOUNCE_PREFIX
from tokenpipe.wire import Announcement

from .launch import LaunchError, free_port, spawn
from .uprole import read_status

__all__ = ["UpProcess"]

_POLL_S = 0.05  # up.json is a file another process writes: polled


class UpProcess:
    """``tokenpipe up --port <free> --data-dir <data> *args`` started at once (NATS on a free port too
    unless ``args`` name one); output in ``up.log``.

    ``command`` is how ``tokenpipe`` is run (default: this interpreter's ``-m tokenpipe_cli``;
    tests pass the installed console script, as a user runs it)."""

    def __init__(self, data: Path, *args: str, env: Mapping[str, str] | None = None,
                 command: Sequence[str] = (sys.executable, "-m", "tokenpipe_cli")) -> None:
        self.data = Path(data)
        self.port = free_port()
        self.log = self.data / "up.log"
        self.announcements: dict[int, Announcement] = {}  # generator pid -> its last announcement
        self.nc: nats.NATS | None = None
        if not {"--nats-port", "--nats-url"} & set(args):
            # a free port, not up's 4222-unless-taken: stacks started side by side (the tests' workers)
            # both found 4222 free, and the second nats-server then could not bind it
            args = ("--nats-port", str(free_port()), *args)
        cmd = [*command, "up", "--port", str(self.port), "--data-dir", str(self.data), *args]
        self.child = spawn("tokenpipe up", cmd, env=env, log=self.log)
        self.proc = self.child.proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        return read_status(self.data)

    def role(self, name: str) -> dict[str, Any]:
        return next((r for r in self.status().get("roles", []) if r["name"] == name), {})

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_up(self, timeout: float = 300) -> None:
        """Until up.json says ``up`` with every role ready; then watch the announcements."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise LaunchError(f"tokenpipe up exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            st = self.status()
            if st.get("state") == "up" and all(r["state"] == "ready" for r in st.get("roles", [])):
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"tokenpipe up not ready within {timeout:g} s; see {self.log}")
            await asyncio.sleep(_POLL_S)
        if self.nc is None:
            admin = load_credential(self.data / "creds" / "admin.json")
            # A local cluster's URL is its seed list (`--nats-cluster`).
            self.nc = await nats.connect(servers=server_list(st["nats_url"]), max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.2, user=admin.user, password=admin.password,
                                         inbox_prefix=admin.inbox_prefix)

            async def on(msg: Msg) -> None:
                ann = Announcement.decode(msg.data)
                self.announcements[ann.pid] = ann

            await self.nc.subscribe(f"{ANNOUNCE_PREFIX}.>", cb=on)

    async def holder(self, stream_id: str, timeout: float = 30) -> int:
        """The pid of the running generator whose announcement names ``stream_id``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gens = {r["pid"] for r in self.status().get("roles", []) if r["name"].startswith("generator")}
            pid = next((p for p, a in self.announcements.items() if stream_id in a.streams and p in gens), None)
            if pid is not None:
                return pid
            await asyncio.sleep(0.02)  # the holder's next announcement names the stream
        raise LaunchError(f"no generator announced {stream_id} within {timeout:g} s")

    async def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the ordered shutdown), killed after ``timeout``; the exit code."""
        if self.nc is not None:
            await self.nc.close()
        self.child.terminate()
        return await asyncio.to_thread(self.child.wait_or_kill, timeout)
