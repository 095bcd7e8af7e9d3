"""One settings object per process, read once from ``TOKENPIPE_*`` and the CLI.

Every field can be set as ``TOKENPIPE_<FIELD>`` (upper case); explicit keyword
overrides (the CLI's flags) win over the environment. The object is frozen and
passed explicitly; nothing reads the environment after start-up.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

from .errors import InvalidRequest

__all__ = ["Settings", "default_data_dir"]

ENV_PREFIX = "TOKENPIPE_"


def default_data_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "tokenpipe")


@dataclass(frozen=True)
class Settings:
    # transport
    # One server, or a cluster's seed list "nats://a:4222,nats://b:4222,nats://c:4222".
    nats_url: str = "nats://127.0.0.1:4222"
    # Replicas of the streams and the KV bucket: "auto" (3 on a cluster of three or more JetStream
    # servers, else 1) or 1..5. Existing streams are scaled up in place; auto never scales down.
    replicas: str = "auto"
    data_dir: str = dataclasses.field(default_factory=default_data_dir)
    token_max_age_s: float = 3600.0
    token_max_bytes: int = -1
    request_max_age_s: float = 24 * 3600.0
    # generator
    model: str = "smollm2-135m"
    model_path: str = ""
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 32
    max_seq_len: int = 2048
    max_prompt_tokens: int = 0
    prefill_token_budget: int = 4096
    # An idle engine waits at most this long for the rest of a burst the worker fetched at
    # once, to prefill it as one batch; a lone request is never held.
    admission_hold_ms: float = 10.0
    coalesce_max_tokens: int = 8
    coalesce_max_delay_ms: float = 20.0
    ack_wait_s: float = 30.0
    drain_timeout_s: float = 10.0
    max_deliver: int = 3
    announce_interval_s: float = 2.0
    threads: int = 0
    metrics_port: int = 9101
    metrics_host: str = "127.0.0.1"
    # relay
    host: str = "127.0.0.1"
    port: int = 8000
    keepalive_s: float = 15.0
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 200_000
    max_tokens_cap: int = 4096
    generator_wait_s: float = 0.0
    api_keys: str = ""
    api_keys_file: str = ""
    max_streams_per_key: int = 64
    max_queue_depth: int = 256
    slow_client_timeout_s: float = 30.0
    # "stream": one core subscription per stream read here (a relay gets only its streams' traffic,
    # so relays scale out; JetStream for catch-up); "shared": one wildcard subscription for all
    # streams (every relay receives every batch: ~15 % cheaper for a lone relay, a ceiling for
    # many; see docs/scaling.md); "consumer": one ordered JetStream consumer per SSE stream.
    relay_fanout: str = "stream"
    # process
    log_level: str = "INFO"
    log_json: bool = False

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build from ``env`` (default ``os.environ``) then apply non-None overrides."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f.name, hints[f.name], raw)
        for key, value in overrides.items():
            if key not in hints:
                raise TypeError(f"unknown setting {key!r}")
            if value is not None:
                values[key] = value
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _parse(name: str, typ: Any, raw: str) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        return raw
    except ValueError as exc:
        raise InvalidRequest(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {typ.__name__}") from exc
