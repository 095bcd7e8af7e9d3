"""The benchmark suite's scenarios: what ``python -m bench run`` runs, group by group.

Each scenario is one benchmark module run as ``python -m <module> <args> --out <json>`` in a process of
its own (torch's thread pools, event loops and loaded models do not carry from one to the next), with
the arguments of its full form or of its quick one. The full forms measure the figures bench/RESULTS.md
records; a quick form measures the same things smaller (fewer rounds, streams or tokens; the tiny
random model where the figure is the pipeline's and not the model's): a check that the scenario runs
and a rough figure, not one to compare. Every module also runs alone with its own options
(``python -m bench.<module> --help``).

Groups: ``system`` (processes, NATS, HTTP: the pipeline, the relay, the cluster, faults), ``engine``
(the model in process: kernels, steps, the KV cache), ``peers`` (tokenpipe against the servers users
would run instead) and ``gpu`` (CUDA only; ``bench/gpu.sh`` runs them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["GROUPS", "SCENARIOS", "Scenario", "UnknownTarget", "select"]

GROUPS = ("system", "engine", "peers", "gpu")


@dataclass(frozen=True)
class Scenario:
    """One registered benchmark: ``module``'s ``main`` with ``full`` or ``quick`` arguments."""

    name: str
    group: str
    module: str
    description: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    optional: bool = False
    """Exit status 2 means "not installed here" (a peer that is built by hand): skipped, not failed."""

    def args(self, quick: bool) -> tuple[str, ...]:
        return self.quick if quick else self.full


_TINY = ("--model", "tiny-random")

SCENARIOS: tuple[Scenario, ...] = (
    # system: whole processes over NATS and HTTP
    Scenario("pipeline", "system", "bench.pipeline",
             "HTTP -> NATS -> generator -> SSE at 32 streams against the raw forward ceiling; pipeline-added TTFT",
             quick=(*_TINY, "--dtype", "float32", "--streams", "4", "--engine-batches", "2,4", "--max-tokens", "16",
                    "--ttft-requests", "5", "--baseline-tokens", "4", "--repeats", "1")),
    Scenario("fanout", "system", "bench.fanout",
             "one relay forwarding a synthetic source: batches/s, added latency, CPU per batch, RSS per stream",
             quick=("--scenario", "200:10:50")),
    Scenario("coalesce", "system", "bench.coalesce",
             "coalescing windows (count, time) against messages/s, TTFT, inter-batch p99 and relay CPU",
             quick=("--streams", "4", "--requests", "8", "--output-len", "32")),
    Scenario("relays", "system", "bench.relays",
             "K relays each serving 1/K of the streams: capacity added, a bystander relay's cost",
             quick=("--streams", "100", "--rate", "1000", "--batches", "10", "--relays", "1,2")),
    Scenario("transports", "system", "bench.transports",
             "the relay per stream over WebSocket against SSE: CPU per batch, RSS per open stream",
             quick=("--streams", "100", "--sockets", "10", "--batches", "10", "--rate", "1000", "--repeats", "1")),
    Scenario("replication", "system", "bench.replication",
             "token batches into R1 and R3 streams on a local 3-node cluster: CPU, route and disk bytes per batch",
             quick=("--rate", "500", "--seconds", "1", "--rounds", "1", "--tokens", "1")),
    Scenario("takeover", "system", "bench.takeover",
             "kill -9 of the generator holding a stream -> the client's next token, the stream checked",
             full=("--kills", "10", "--ack-cost"), quick=("--kills", "2", "--max-tokens", "200")),
    Scenario("enginecore", "system", "bench.enginecore",
             "the engine as a thread of the generator against its own process (TOKENPIPE_ENGINE_PROCESS)",
             quick=("--models", "tiny-random", "--streams", "1,4", "--max-tokens", "16", "--singles", "2",
                    "--rounds", "1")),
    Scenario("lanes", "system", "bench.lanes",
             "a chat's TTFT idle and behind a 16-stream backlog at the default tier, as batch work (flex) and as a "
             "Batch API batch; an app's request behind another app's 200 jobs on the bus, and both apps' weighted "
             "token shares; 32 streams alone at the default tier, as flex and as a Batch API batch: tokens/s",
             quick=(*_TINY, "--dtype", "float32", "--backlog", "8", "--max-batch", "8", "--backlog-tokens", "64",
                    "--rounds", "1", "--bus-jobs", "40", "--bus-tokens", "32", "--window", "4",
                    "--rate-streams", "8", "--rate-tokens", "16")),
    Scenario("placement", "system", "bench.placement",
             "6 chats x 4 turns, each on its own document, over 1 and 2 generators: the fleet's prefix-cache hit "
             "rate, later/first-turn TTFT; 32 unrelated streams: the busiest generator's share, tokens/s; kill -9 of "
             "a conversation's generator: its next turn's wait beyond a cold prefill",
             quick=(*_TINY, "--conversations", "3", "--turns", "2", "--doc-words", "300", "--unrelated", "8",
                    "--unrelated-tokens", "16")),
    Scenario("startup", "system", "bench.startup",
             "tokenpipe up cold (fresh data dir) and warm: seconds to ready and to the final kernel tables, the "
             "generators' idle and start-up RSS; llama.cpp's server beside it where installed",
             quick=(*_TINY, "--quant", "int4", "--generators", "1", "--table-timeout", "60")),
    Scenario("chaos", "system", "bench.chaos",
             "random kills and freezes on a 3-node cluster under load; every stream checked against its replay",
             quick=("--duration", "60", "--faults", "6", "--max-stop", "6", "--rate", "0.7")),
    Scenario("takeovers", "system", "bench.chaos",
             "kill -9 of a generator, 30 times under load on a 3-node cluster: the stalls are takeovers alone",
             full=("--only", "generator kill -9", "--faults", "30", "--rate", "3", "--out", "bench/out/takeovers.json"),
             quick=("--only", "generator kill -9", "--faults", "3", "--duration", "60",
                    "--out", "bench/out/takeovers.json")),
    # engine: the model in this process
    Scenario("kernels", "engine", "bench.kernels",
             "the kernel table measured on this CPU, its start-up cost, decode steps against the hand rules",
             quick=("--rows", "1,8", "--rounds", "2", "--steps", "2")),
    Scenario("stepsplit", "engine", "bench.stepsplit",
             "a decode step's projections against the rest; the decoder stack against op by op; bandwidth share",
             quick=("--rows", "1,8", "--rounds", "2", "--steps", "4")),
    Scenario("gemvrows", "engine", "bench.gemvrows",
             "the one-row kernels' own speed, weights from cache and streamed from memory (GB/s)",
             quick=("--rounds", "1", "--cached-mb", "2", "--streamed-mb", "32")),
    Scenario("attention", "engine", "bench.attention",
             "one layer's decode attention: the torch ops against the library's kernel over the pool",
             quick=("--rows", "1,8", "--context", "128", "--rounds", "2")),
    Scenario("accuracy", "engine", "bench.accuracy",
             "each projection kernel's loss on a fixed text, teacher-forced (NLL, perplexity, greedy agreement)",
             quick=("--rows", "1", "--tokens", "32")),
    Scenario("sampling", "engine", "bench.sampling",
             "what choosing the next token costs a decode step, by sampling mode and batch size",
             quick=("--rows", "1,8", "--rounds", "2", "--calls", "10")),
    Scenario("quant", "engine", "bench.quant",
             "weight-only int8/int4 against float: decode and prefill speed, greedy agreement, log-likelihood",
             quick=("--variants", "float32/none,float32/int4", "--rounds", "1", "--prompts", "2",
                    "--new-tokens", "8")),
    Scenario("floatweights", "engine", "bench.floatweights",
             "a prefill with the quantized projections' float weights kept or dropped (TOKENPIPE_FLOAT_WEIGHTS): "
             "time by prompt length, RSS each load adds",
             quick=("--lengths", "64,256", "--rounds", "1")),
    Scenario("kvcache", "engine", "bench.kvcache",
             "the paged KV cache: memory under a mixed load, prefix-cache TTFT, decode against context",
             quick=("--quick",)),
    # peers: other servers on this machine
    Scenario("peers", "peers", "bench.peers",
             "tokenpipe against transformers serve and llama.cpp's server, same client and model",
             quick=("--concurrency", "1,8", "--sampling", "greedy", "--max-tokens", "32")),
    Scenario("llamaraw", "peers", "bench.llamaraw",
             "llama.cpp's own one-stream decode loop in process (no server), the stricter reference",
             quick=("--tokens", "32", "--rounds", "2"), optional=True),
    # gpu: CUDA only
    Scenario("cudagraphs", "gpu", "bench.cudagraphs",
             "decode with and without CUDA graphs, as ratios to the device's copy bandwidth and GEMM peak",
             full=("--models", "llama-1b-random,llama-8b-random", "--batches", "1,64"),
             quick=("--dry-run",)),
)


class UnknownTarget(ValueError):
    """A name that is neither a group nor a scenario."""


def select(targets: Iterable[str]) -> list[Scenario]:
    """The scenarios of each target (a group or a scenario's name), in registry order within a group,
    each once."""
    chosen: list[Scenario] = []
    for target in targets:
        if target in GROUPS:
            found = [s for s in SCENARIOS if s.group == target]
        else:
            found = [s for s in SCENARIOS if s.name == target]
            if not found:
                raise UnknownTarget(f"{target!r} is neither a group ({', '.join(GROUPS)}) nor a scenario "
                                    f"({', '.join(s.name for s in SCENARIOS)})")
        chosen += [s for s in found if s not in chosen]
    return chosen
