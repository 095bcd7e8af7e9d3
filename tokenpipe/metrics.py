"""Prometheus metrics with vLLM-like names under a ``tokenpipe_`` prefix.

Each process builds its own :class:`~prometheus_client.CollectorRegistry` (no global state),
so tests can run a relay and a generator in one process and read both.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GeneratorMetrics", "RelayMetrics", "LATENCY_BUCKETS", "render"]

# Down to 1 ms: inter-token latency on a GPU is a few ms; TTFT on a CPU is seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class GeneratorMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.ttft = hist("tokenpipe_time_to_first_token_seconds", "Request created to first token produced")
        self.itl = hist("tokenpipe_inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.inter_batch = hist("tokenpipe_inter_batch_latency_seconds", "Time between published batches of a request")
        self.e2e = hist("tokenpipe_e2e_request_latency_seconds", "Request created to final batch published")
        self.queue = hist("tokenpipe_request_queue_time_seconds", "Request created to pulled by a generator")
        self.prefill = hist("tokenpipe_request_prefill_time_seconds", "Admitted to the batch to first token")
        self.decode = hist("tokenpipe_request_decode_time_seconds", "First token to last token")
        self.prompt_tokens = Counter("tokenpipe_prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("tokenpipe_generation_tokens", "Tokens generated", m, registry=r)
        self.finished = Counter("tokenpipe_request_success", "Finished requests by finish reason",
                                [*m, "finished_reason"], registry=r)
        self.errors = Counter("tokenpipe_errors", "Errors by kind", [*m, "kind"], registry=r)
        self.running = Gauge("tokenpipe_num_requests_running", "Sequences in the running batch", m, registry=r)
        self.waiting = Gauge("tokenpipe_num_requests_waiting", "Requests queued in JetStream (consumer lag)", m,
                             registry=r)
        self.batch_size = hist("tokenpipe_batch_size", "Sequences per engine step", _COUNT_BUCKETS)
        self.tokens_per_batch = hist("tokenpipe_tokens_per_published_batch", "Tokens in each published batch",
                                     _COUNT_BUCKETS)
        self.kv_cache = Gauge("tokenpipe_kv_cache_usage_perc", "Fraction of KV-cache blocks held by sequences", m,
                              registry=r)
        self.kv_blocks = Gauge("tokenpipe_kv_cache_blocks", "KV-cache blocks by state (used: held by a sequence; "
                               "cached: unheld, reusable prefix; free: never used or unkeyed)", [*m, "state"],
                               registry=r)
        self.prefix_queries = Counter("tokenpipe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      m, registry=r)
        self.prefix_hits = Counter("tokenpipe_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(hits / queries = the prefix-cache hit rate)", m, registry=r)
        self.preemptions = Counter("tokenpipe_num_preemptions", "Sequences preempted when KV blocks ran out", m,
                                   registry=r)
        self.dropped_cancels = Counter("tokenpipe_dropped_cancels", "Messages on a cancel subject that were no "
                                       "well-formed cancel of that stream by its owner (dropped)", m, registry=r)
        self.lost_streams = Counter("tokenpipe_lost_streams", "Streams this generator stopped writing because the "
                                    "store refused an append (another generator holds them now)", m, registry=r)
        self.owner_running = Gauge("tokenpipe_num_requests_running_per_owner", "Requests this generator runs, by "
                                   "owner (a tenant behind the relay, else the application on the bus)",
                                   [*m, "owner"], registry=r)
        self.owner_waiting = Gauge("tokenpipe_num_requests_waiting_per_owner", "Requests this generator holds "
                                   "that have not started, by owner (its waiting room: fair share picks from it)",
                                   [*m, "owner"], registry=r)
        self.placed = Counter("tokenpipe_placed_requests", "Requests this generator started, by how they came: "
                              "placed on its own slot (own), placed on another generator's slot and taken over "
                              "(taken), or from the shared queue (shared)", [*m, "how"], registry=r)
        self.engine_threads = Gauge("tokenpipe_engine_threads", "torch CPU threads the engine steps with "
                                    "(TOKENPIPE_THREADS; `tokenpipe up --generators N` shares the cores out)", m,
                                    registry=r)
        self.model = model
        self._children: dict[int, Any] = {}
        self._owners: set[str] = set()

    def set_owners(self, counts: dict[str, tuple[int, int]]) -> None:
        """Each owner's (running, waiting) now; an owner seen before and absent now reads 0."""
        for owner in self._owners | counts.keys():
            running, waiting = counts.get(owner, (0, 0))
            self.owner_running.labels(model_name=self.model, owner=owner).set(running)
            self.owner_waiting.labels(model_name=self.model, owner=owner).set(waiting)
        self._owners |= counts.keys()

    def labels(self, metric: Histogram | Counter | Gauge):  # type: ignore[no-untyped-def]
        # The child is cached: prometheus_client's labels() validates and locks on every call,
        # and the generator observes several metrics per token.
        child = self._children.get(id(metric))
        if child is None:
            child = self._children[id(metric)] = metric.labels(model_name=self.model)
        return child


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenpipe_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.active_sse = Gauge("tokenpipe_sse_active_connections", "Open SSE streams", registry=r)
        self.first_batch = Histogram("tokenpipe_relay_time_to_first_batch_seconds",
                                     "Stream opened at the relay to its first batch forwarded",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.inter_batch = Histogram("tokenpipe_relay_inter_batch_latency_seconds",
                                     "Time between batches forwarded on one stream", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.batches = Counter("tokenpipe_relay_batches_forwarded", "Batches forwarded to clients", registry=r)
        self.errors = Counter("tokenpipe_errors", "Errors by kind", ["kind"], registry=r)
        self.dropped_batches = Counter("tokenpipe_dropped_batches", "Token messages a reader dropped: "
                                       "undecodable, naming another stream (wrong_stream), or written for another "
                                       "owner's (wrong_owner)", ["reason"], registry=r)
        self.waiting = Gauge("tokenpipe_num_requests_waiting", "Requests queued in JetStream (consumer lag)",
                             ["model_name"], registry=r)
        self.placements = Counter("tokenpipe_placements", "Requests submitted, by placement: on the generator "
                                  "holding their prompt's start (prefix), by their session hint (session), or to "
                                  "the shared queue (shared), and the slot chosen", ["decision", "slot"], registry=r)
