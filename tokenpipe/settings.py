"""One settings object per process, read once from ``TOKENPIPE_*`` and the CLI.

Every field can be set as ``TOKENPIPE_<FIELD>`` (upper case); explicit keyword
overrides (the CLI's flags) win over the environment. The object is frozen and
passed explicitly; nothing reads the environment after start-up.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from .cluster import parse_replicas, server_list
from .errors import ConfigError
from .quota import parse_weights

__all__ = ["CudaGraphs", "Dtype", "EngineProcess", "FloatWeights", "Kernels", "Quant", "Settings", "default_data_dir",
           "engine_threads"]

ENV_PREFIX = "TOKENPIPE_"
_T = TypeVar("_T")

Dtype = Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]
Quant = Literal["auto", "none", "int8", "int4"]
Kernels = Literal["auto", "rules", "quant", "dense", "packed", "gemv", "gemm8", "amx"]
EngineProcess = Literal["auto", "on", "off"]
CudaGraphs = Literal["auto", "on", "off"]
FloatWeights = Literal["drop", "keep"]


def default_data_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "tokenpipe")


def engine_threads(threads: int, *, cores: int | None = None, generators: int = 1) -> int:
    """torch's thread count for one engine: ``threads`` if set; else every core on a machine of up
    to 3 cores, one fewer than the cores on a larger one, shared out between the ``generators`` that
    one machine runs (at least one each).

    Every parallel region of an OpenMP team waits for its slowest thread, so a team as wide as
    the machine stalls when a busy, un-niced process (the relay and nats-server of ``tokenpipe
    up`` under load) takes a core. Leaving a core free costs 1/cores of the compute: cheap on 16
    cores, much on 2. Two generators each as wide as the machine spin on each other's cores at
    every barrier (libgomp waits actively before it sleeps)."""
    if threads > 0:
        return threads
    cores = cores or os.cpu_count() or 1
    usable = cores - 1 if cores >= 4 else cores
    return max(1, usable // max(generators, 1))


def _setting(default: _T, doc: str, *, shown: str | None = None) -> _T:
    """A field with its documentation: what it means, and its default as README.md shows it
    (``shown``, where ``repr`` of the value would say less or depend on the machine). Ruff's RUF009
    cannot tell that this returns a ``Field`` like ``field()``: the ``Literal`` fields say ``noqa``."""
    return field(default=default, metadata={"doc": doc} if shown is None else {"doc": doc, "shown": shown})


@dataclass(frozen=True)
class Settings:
    """Every knob of every role. Each field's ``metadata["doc"]`` is its one documentation:
    README.md's configuration table is rendered from it (:mod:`tokenpipe.settings_doc`)."""

    # transport
    nats_url: str = _setting("nats://127.0.0.1:4222", "NATS server (every role), or a cluster's seed list "
                                                      "`nats://a:4222,nats://b:4222,...`: clients reconnect across its "
                                                      "servers")
    replicas: str = _setting("auto", "replicas of the streams and the KV bucket: `auto` (3 on a cluster of three or "
                                     "more JetStream servers, else 1) or 1..5; existing streams are scaled up in "
                                     "place, `auto` never scales down")
    nats_creds: str = _setting("", "NATS credentials file: tokenpipe's user/password JSON (`tokenpipe creds`) or a JWT "
                                   "`.creds` file (default: the role's file in `<data dir>/creds/` when `tokenpipe up` "
                                   "wrote one, for the NATS server its `up.json` names)")
    nats_user: str = _setting("", "NATS user (instead of `TOKENPIPE_NATS_CREDS`)")
    nats_password: str = _setting("", "NATS password for `TOKENPIPE_NATS_USER`")
    nats_ca: str = _setting("", "CA file to verify a `tls://` NATS server with")
    nats_cert: str = _setting("", "client certificate for NATS TLS (mutual TLS)")
    nats_key: str = _setting("", "client certificate key for NATS TLS")
    nats_inbox_prefix: str = _setting("", "reply inbox prefix (tokenpipe's credential files carry their own, e.g. "
                                          "`_INBOX.relay`; permissions confine each role's replies to it)")
    app_name: str = _setting("", "the producer SDK's application name on the bus: the owner in its subjects "
                                 "(`tp.req.<model>.<app>`, `tp.tok.<app>.<id>`); app credentials carry it")
    data_dir: str = field(
        default_factory=default_data_dir,
        metadata={"doc": "nats-server's JetStream store (`tokenpipe up`, `tokenpipe nats`) and the converted model "
                         "cache",
                  "shown": "`$XDG_STATE_HOME/tokenpipe`, else `~/.local/state/tokenpipe`"},
    )
    token_max_age_s: float = _setting(
        3600.0, "how long token streams are kept in JetStream (replay, resume, redelivery)")
    token_max_bytes: int = _setting(
        -1, "size cap of all token streams together, oldest batches dropped first (-1: none)")
    request_max_age_s: float = _setting(
        600.0, "how long a queued request waits for a generator before JetStream drops it (a queue, not an "
               "archive: a client has long given up on a request older than this)")
    request_max_bytes: int = _setting(
        1 << 30, "size cap of the request queue (`TP_REQUESTS`) for all models and owners together, and of each "
                 "application's intake stream (`TP_REQ_<app>`); a request beyond it is refused, never an older one "
                 "dropped (an app's request past the queue's cap waits in its intake stream until there is room)",
        shown="1073741824 (1 GiB)")
    request_max_per_owner: int = _setting(
        4096, "requests one owner (an application, or the relay for every HTTP client) may have queued or running "
              "per model (`tp.req.<model>.<owner>`; an application's counted in its intake stream `TP_REQ_<app>`); "
              "one more is refused (429 at the relay, `Overloaded` in the SDK). "
              "Keep it above the requests running at once (generators × `TOKENPIPE_MAX_BATCH`) plus "
              "`TOKENPIPE_MAX_QUEUE_DEPTH`; -1: no bound")
    models: str = _setting(
        "", "the models served, comma-separated (the admin's provisioner; empty: `TOKENPIPE_MODEL`): `TP_REQUESTS` "
            "takes requests for these only (one for any other model is stored nowhere), and the admin makes each "
            "one's generator consumer, which generators only bind to (on an open bus, with no admin: any model, "
            "each generator makes its own consumer)")
    apps: str = _setting(
        "", "the applications, comma-separated, for the admin's provisioner where no credentials directory tells it "
            "(the Helm chart; `tokenpipe up` reads its `creds/app-*.json`): each gets an intake stream `TP_REQ_<app>` "
            "that `TP_REQUESTS` sources, so that its requests are checked against its own alone")
    app_max_store_bytes: int = _setting(
        1 << 30, "JetStream file storage one application's account may use (its copy of its token streams; a "
                 "stream asking for more is refused)", shown="1073741824 (1 GiB)")
    app_max_consumers: int = _setting(
        1024, "JetStream consumers one application's account may hold (each reader of a stream holds one)")
    app_max_connections: int = _setting(64, "NATS connections one application's account may hold at once")
    # generator
    model: str = _setting("smollm2-135m", "model served (generator) / default model (relay): `smollm2-135m`, "
                                          "`tiny-random`, `llama-1b-random` (random weights, for benchmarks), or the "
                                          "name for `TOKENPIPE_MODEL_PATH`")
    model_path: str = _setting(
        "", "a local Llama-family transformers directory served under the name `TOKENPIPE_MODEL`")
    device: str = _setting("auto", "`auto` (CUDA when present, else CPU), `cpu`, `cuda`, `cuda:1`, …")
    dtype: Dtype = _setting(  # noqa: RUF009
        "auto", "`auto`: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32; or `float32`, "
                "`bfloat16`, `float16`")
    quant: Quant = _setting(  # noqa: RUF009
        "auto", "weight-only quantization of the projections: `auto` (int4 for the default model, whose GGUF is 4-bit, "
                "on CPUs; else none), `none`, `int8`, `int4`; which kernel serves each batch size: `TOKENPIPE_KERNELS`")
    float_weights: FloatWeights = _setting(  # noqa: RUF009
        "drop", "the float copy of the quantized projections' weights: `drop` (where tokenpipe's kernels serve: "
                "a matmul beyond the kernel table's quantized rows, a prefill, de-quantizes each weight for the call, "
                "~13 ms a forward for SmolLM2, and the generator holds ~200 MB less in bf16, ~400 MB less in fp32; "
                "SmolLM2's GGUF blocks then serve as stored) or `keep` (prefills of 64-128 tokens 14-29 % faster, "
                "from 512 within 5 %, for that memory: `python -m bench.floatweights`)")
    kernels: Kernels = _setting(  # noqa: RUF009
        "auto", "which kernel serves a quantized projection at each decode batch size: `auto` times torch's quantized "
                "kernel, the float weight, the oneDNN pre-packed float weight and tokenpipe's own kernels (`gemv` "
                "with int16 rows, `gemm8` with int8 rows, `amx`: gemm8 on AMX tiles where the CPU has them; built by "
                "`tokenpipe build-kernels`, or with `$CC`/`$CXX` at the first start) on the engine's thread while it "
                "has nothing to step, in the background: the rules serve from the start until the measured table "
                "replaces them (logged); once per machine and model: cached in `<data dir>/kernels/` per CPU, "
                "threads, torch and model, measured by one process while the others serve the rules and then read its "
                "table; a table measured while other processes held over a quarter of the CPUs is not trusted: "
                "measured again a minute later, at most 3 times in a row) and switches from the rule only on a ≥ 10 % "
                "win; `rules` (the quantized kernel up to 16 rows with native bf16, else 32); `quant`, `dense`, "
                "`packed`, `gemv`, `gemm8`, `amx`: that one for every decode step")
    engine_process: EngineProcess = _setting(  # noqa: RUF009
        "auto", "run the engine (steps, sampling, detokenizing) in its own engine-core process, fed and drained over a "
                "local pipe, so the generator's NATS I/O cannot stall a step through the GIL: `auto` (on with CUDA; "
                "off on CPU, where the process showed no consistent win on 2 cores and lost throughput with SmolLM2: "
                "`python -m bench.enginecore`), `on`, `off` (the engine thread in the generator's process)")
    cuda_graphs: CudaGraphs = _setting(  # noqa: RUF009
        "auto", "capture the decode step as CUDA graphs, one per batch-size bucket (1, 2, 4, … 64), replayed each "
                "step: `auto` (on with CUDA, off on CPU), `on` (refused without a CUDA device), `off`")
    cancel_memory: int = _setting(10_000, "a generator remembers each owner's (app's, the relay's) latest this many "
                                          "cancelled stream ids, so that a cancel that arrives before its request "
                                          "still cancels it; per owner: one owner's cancels never make it forget "
                                          "another's")
    max_batch: int = _setting(32, "most concurrent sequences per generator; free KV-cache blocks decide below it")
    waiting_room: int = _setting(
        256, "requests a generator whose slots are full holds beyond them, waiting (kept alive by progress acks): it "
             "admits from them by fair share between owners, so another owner's request behind one owner's backlog "
             "is found and started at once as long as fewer than this many requests are ahead of it; what a "
             "generator holds waiting another one cannot take (0: pull only for free slots, FIFO)")
    owner_weights: str = _setting(
        "", "fair-share weights, `owner=weight,…` (an owner: a tenant behind the relay, else the application on the "
            "bus; not named: 1): within a class of service, owners with work get a generator's slots in proportion, "
            "a row of the owner most over its share preempted for one under it")
    owner_max_running: int = _setting(
        0, "sequences one owner may run at once on a generator (its others wait; 0: no cap beyond fair share, which "
           "gives way to another owner's work at once and leaves no slot idle)")
    owner_tokens_per_min: int = _setting(
        0, "tokens per minute per owner (`max_tokens` plus the prompt at ~4 characters a token, counted when a request "
           "is accepted, by each relay for its tenants and each generator for the applications on the bus): one more "
           "is refused naming the quota and when to retry (429 `rate_limit_exceeded` with `Retry-After`; an `error` "
           "batch on the bus); 0: none")
    kv_cache_mb: float = _setting(0, "KV-cache budget in MiB, one pool of 16-position blocks, written only as used (0: "
                                     "a quarter of available RAM on CPU, 60 % of free GPU memory on CUDA, at most "
                                     "`TOKENPIPE_MAX_BATCH` × `TOKENPIPE_MAX_SEQ_LEN` positions)")
    prefix_caching: bool = _setting(True, "reuse the KV blocks of a prompt's cached prefix (shared system prompts, "
                                          "chat turns, redelivered requests) instead of prefilling it again")
    max_seq_len: int = _setting(2048, "prompt + output limit per sequence (at most the model's context)")
    max_prompt_tokens: int = _setting(
        0, "longest prompt in tokens, else an `error` event (0: `TOKENPIPE_MAX_SEQ_LEN` − 1)")
    prefill_token_budget: int = _setting(
        4096, "padded tokens one prefill step may process; a larger admission wave is split")
    prefill_step_ms: float = _setting(
        250.0, "on a CPU, a prefill step takes at most about this long (as measured on earlier steps): a larger "
               "admission wave is split, so that a request arriving meanwhile waits at most one such step; "
               "0: `TOKENPIPE_PREFILL_TOKEN_BUDGET` alone")
    admission_hold_ms: float = _setting(10.0, "an idle engine waits at most this long for the rest of a burst it "
                                              "fetched, to prefill it as one batch (a lone request is never held)")
    first_batch_hold_ms: float = _setting(
        1.5, "on a CPU, after a step that produced streams' first tokens, the engine waits until their first batches "
             "went out live (at most 5 ms), then this long more: the relay and NATS get the cores to carry them to the "
             "client (on 2 cores pipeline-added TTFT p50 2 ms lower, no throughput lost); 0: no wait. The engine "
             "thread only, not the engine-core process")
    coalesce_max_tokens: int = _setting(8, "count window: tokens per published batch (with the 20 ms window ~6x "
                                           "fewer messages for ~+11 ms inter-batch p99: `python -m bench.coalesce`; "
                                           "a request's `coalesce` overrides it)")
    coalesce_max_delay_ms: float = _setting(20.0, "time window: the longest a token waits to be published")
    ack_wait_s: float = _setting(2.0, "a request whose generator stops acknowledging progress is redelivered after "
                                      "this: how soon a frozen worker's streams move on, and a dead one's that no "
                                      "peer could hand back (measured by `python -m bench.takeover`)")
    progress_interval_s: float = _setting(0.5, "how often a generator acknowledges progress on every request it holds; "
                                               "a worker stalled longer than `TOKENPIPE_ACK_WAIT_S` minus this loses "
                                               "its requests to another worker")
    peer_check_interval_s: float = _setting(
        0.25, "how often a generator asks NATS whether each peer holding requests is still connected (a request to "
              "the peer's `tp.gen.alive` subject: \"no responders\" is the server's word that its connection is gone)")
    peer_gone_after_s: float = _setting(
        1.0, "a peer the server has seen gone this long (0: at once) has its held requests handed back (NAK) by one "
             "surviving generator, so they move on before `TOKENPIPE_ACK_WAIT_S`; the wait rides out a client moving "
             "to another NATS node; negative: off (a dead worker's requests then wait out `ack_wait`)")
    drain_timeout_s: float = _setting(
        10.0, "on SIGTERM, how long running requests may finish before they are handed back")
    max_deliver: int = _setting(3, "delivery attempts per request; after the last, the stream ends with an `error`")
    announce_interval_s: float = _setting(
        2.0, "how often a generator announces its model and load (lapses after 3 intervals)")
    placement_slots: int = _setting(
        8, "placement slots per model (a durable consumer each, made by the provisioner): a request whose prompt "
           "prefix or `user` a generator announced is published onto that generator's slot, which it pulls first "
           "and every other generator pulls once it has idle capacity; 0: no placement, one shared queue")
    placement_slot: int = _setting(
        -1, "the placement slot this generator holds (`tokenpipe up` gives its n-th generator slot n; -1: the "
            "slot numbered at the end of the host name, as a StatefulSet's pods are, else none: the generator then "
            "takes only unplaced requests and others' overflow)")
    threads: int = _setting(0, "torch CPU threads for the engine (0: every core up to 3 cores, one fewer from 4 cores "
                               "on, left to the relay and nats-server, and shared out between the generators of "
                               "`tokenpipe up --generators N`; 1 on a small machine shared with busy un-niced work, "
                               "whose OpenMP team would wait at every barrier for a core lent to it)")
    metrics_port: int = _setting(9101, "generator `/metrics` port (`tokenpipe up` counts up from it; 0: off; one "
                                       "found taken when the generator binds it gives way to a free one, logged)")
    metrics_host: str = _setting("127.0.0.1", "generator `/metrics` bind address")
    # tokenpipe up (the supervisor)
    fork_generators: bool = _setting(
        True, "`tokenpipe up`: fork each generator (and each restart) from one process that imported torch and the "
              "engine once, instead of each starting its own interpreter (about 1.4 s of CPU each on 2 cores)")
    restart_backoff_s: float = _setting(
        0.5, "`tokenpipe up`: first delay before restarting a role that exited; doubles per restart within the window")
    restart_backoff_max_s: float = _setting(10.0, "`tokenpipe up`: longest restart delay")
    restart_limit: int = _setting(5, "`tokenpipe up`: restarts of one role within `TOKENPIPE_RESTART_WINDOW_S` before "
                                     "it is given up (the stack stops when it was the relay, NATS or the last "
                                     "generator)")
    restart_window_s: float = _setting(60.0, "`tokenpipe up`: the crash-loop window")
    ready_file: str = _setting("", "a generator writes its pid and metrics port here once it serves, and removes it "
                                   "when it stops (`tokenpipe up` sets it per generator)")
    start_gate: str = _setting("", "a generator loads its model, then waits for this file before it connects "
                                   "(`tokenpipe up` creates it once the streams exist, so its generators load "
                                   "while NATS is set up)")
    # relay
    host: str = _setting("127.0.0.1", "relay bind address")
    port: int = _setting(8000, "relay port")
    keepalive_s: float = _setting(15.0, "SSE ping interval while a stream is idle")
    max_body_bytes: int = _setting(1 << 20, "largest request body (413)", shown="1048576 (1 MiB)")
    max_prompt_chars: int = _setting(200_000, "longest prompt in characters (all messages together): the relay "
                                               "answers 400, a generator ends the stream with an `error` batch "
                                               "before tokenizing it (a request published on the bus)")
    max_tokens_cap: int = _setting(4096, "largest `max_tokens` a request may ask for (400)")
    generator_wait_s: float = _setting(0.0, "how long a request waits for a generator of its model to announce before "
                                            "404/503 (0: answer at once; a generator whose announcements just lapsed "
                                            "is always given 10 s: it may be reconnecting after its NATS node hung)")
    api_keys: str = _setting("", "API keys → tenants, `key:tenant,…` (none, and no file: keys off)")
    api_keys_file: str = _setting("", "a file with one `key tenant` per line, added to `TOKENPIPE_API_KEYS`")
    max_streams_per_key: int = _setting(64, "unfinished streams per tenant, shared by all its keys (429)")
    max_queue_depth: int = _setting(256, "JetStream consumer lag for the model (429)")
    slow_client_timeout_s: float = _setting(
        30.0, "drop a client whose socket stays full this long (the generation goes on)")
    header_timeout_s: float = _setting(10.0, "a connection's request headers must be complete this long after it "
                                             "opened (or after its previous response), else 408 and closed (slowloris)")
    expected_generators: int = _setting(0, "generators the relay expects (`tokenpipe up` sets it): `/readyz` says "
                                           "`degraded` while fewer are live (0: unknown)")
    submit_retry_s: float = _setting(30.0, "how long the relay retries enqueueing a request while NATS is unavailable "
                                           "before answering 503 (idempotent by request id); covers a nats-server "
                                           "restart and, on a cluster, a frozen node: the relay's connection to it "
                                           "declared dead (~8 s), then a stream leader's re-election (4-9 s)")
    cancel_grace_s: float = _setting(2.0, "after the last live reader of a running stream (on any relay) disconnects, "
                                          "wait this long for one to re-attach (`Last-Event-ID`) before cancelling the "
                                          "generation")
    unread_stream_release_s: float = _setting(30.0, "a stream no reader is attached to stops counting against its "
                                                    "tenant's `max_streams_per_key` after this long (it is freed at "
                                                    "once when it finishes or is deleted)")
    batch_file_max_bytes: int = _setting(50 << 20, "largest file `POST /v1/files` takes (413)",
                                         shown="52428800 (50 MiB)")
    batch_retention_s: float = _setting(
        7 * 86400.0, "how long the Batch API's files (JetStream object store `tp_files`) and batch records (KV "
                     "`tp_batches`) are kept", shown="604800 (7 days)")
    batch_window_s: float = _setting(
        86400.0, "a batch's completion window (OpenAI's `24h`, the only one it names): past its `expires_at` the lines "
                 "in flight are cancelled, the ones not done go to the error file as `batch_expired`, and the batch "
                 "ends `expired`", shown="86400 (24 h)")
    batch_concurrency: int = _setting(32, "batch lines one relay keeps in flight at once, all its batches together "
                                          "(each a `flex` request; the generators serve interactive work first)")
    metrics_auth: bool = _setting(False, "`/metrics` requires an API key too (when keys are on)")
    trace_url: str = _setting("", "link template for a stream's trace in a tracing UI, `{trace_id}` filled in (Jaeger: "
                                  "`http://localhost:16686/trace/{trace_id}`); the inspector page (`/inspect`) links "
                                  "each stream's trace with it (empty: it shows the trace id only)")
    # process
    log_level: str = _setting("INFO", "log level")
    log_json: bool = _setting(False, "JSON log lines instead of `key=value`")

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

    def __post_init__(self) -> None:
        """Every choice is checked once, here, at start-up: a bad value is a :class:`ConfigError`
        naming the variable, not a failure later in whichever module reads it first."""
        for name, typ in get_type_hints(type(self)).items():
            choices = _choices(typ)
            value = getattr(self, name)
            if choices and value not in choices:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={value!r}: use one of {', '.join(choices)}",
                                  param=name)
        parse_replicas(self.replicas)
        server_list(self.nats_url)
        parse_weights(self.owner_weights)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values a ``Literal`` setting accepts (empty for any other)."""
        return _choices(get_type_hints(cls)[name])


def _choices(typ: Any) -> tuple[str, ...]:
    return tuple(get_args(typ)) if get_origin(typ) is Literal else ()


def _parse(name: str, typ: Any, raw: str) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return typ(raw) if typ in (int, float) else raw
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {typ.__name__}", param=name) from exc

