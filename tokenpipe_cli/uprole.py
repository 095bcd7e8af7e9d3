"""One process ``tokenpipe up`` supervises: its state, its restart policy and its entry in
``up.json``; and ``up.json`` itself, written atomically and read by scripts.

A role that exits unexpectedly is restarted after an exponential backoff
(``restart_backoff_s`` doubling up to ``restart_backoff_max_s``); after ``restart_limit``
restarts within ``restart_window_s`` it is given up. ``up.json`` looks like:

    {"pid": 4242, "state": "up", "relay_url": "http://127.0.0.1:8000", "nats_url": "nats://127.0.0.1:4222",
     "ports": {"relay": 8000, "nats": 4222, "metrics": [9101, 9102]}, "generators": "2/2",
     "roles": [{"name": "nats-server", "pid": 4243, "state": "ready", "restarts": 0, "last_exit": null}, ...]}

``state`` of a role is ``starting``, ``ready``, ``restarting`` (waiting out its backoff),
``failed`` (given up) or ``stopped``; the top-level ``state`` is ``starting``, ``up``,
``stopping``, ``stopped`` or ``failed``.
"""

from __future__ import annotations

import json
import os
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenpipe.settings import Settings

from .launch import Child

__all__ = ["Role", "RoleKind", "describe_exit", "read_status", "status_path", "write_status"]

RoleKind = Literal["nats", "generator", "relay"]


def describe_exit(code: int) -> str:
    """``exit 2`` or ``SIGKILL`` (a negative Popen status is the signal that ended it)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


@dataclass
class Role:
    """One supervised process and its restart bookkeeping."""

    name: str
    kind: RoleKind
    start: Callable[[], Child | None]  # starts the process: it, or None when it could not be started
    ready_check: Callable[[], bool]
    child: Child | None = None
    pid: int | None = None
    state: str = "starting"
    restarts: int = 0
    last_exit: int | None = None
    restart_at: float = 0.0
    recent: deque[float] = field(default_factory=deque)  # when it exited, within the window

    def exited(self, code: int, now: float, s: Settings) -> float | None:
        """Record an exit: the backoff before its restart, or None when it exited too often and is
        given up (its state is then ``failed``)."""
        self.last_exit = code
        while self.recent and self.recent[0] < now - s.restart_window_s:
            self.recent.popleft()
        self.recent.append(now)
        if len(self.recent) > s.restart_limit:
            self.state = "failed"
            return None
        delay = min(s.restart_backoff_s * 2 ** (len(self.recent) - 1), s.restart_backoff_max_s)
        self.state = "restarting"
        self.restart_at = now + delay
        return delay

    def alive(self) -> int | None:
        """None while it runs, else its exit status (-1: it did not start)."""
        return self.child.returncode if self.child is not None else -1

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "state": self.state, "restarts": self.restarts,
                "last_exit": describe_exit(self.last_exit) if self.last_exit is not None else None}


def status_path(data_dir: str | os.PathLike[str]) -> Path:
    """Where ``tokenpipe up`` keeps its status (``up.json`` in the data dir)."""
    return Path(data_dir) / "up.json"


def write_status(data_dir: str | os.PathLike[str], body: dict[str, Any]) -> None:
    path = status_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)  # readers never see half a file


def read_status(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``tokenpipe up``'s status as last written, or ``{}`` before the first write."""
    try:
        return json.loads(status_path(data_dir).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}
