"""The paged KV cache: block bookkeeping, prefix reuse and preemption never change a greedy token."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator.engine.blocks import BlockPool, prefix_keys
from generator.engine.scheduler import Engine, Sequence
from generator.model.kvcache import BLOCK_SIZE, KVCacheTooSmall, bytes_per_position
from generator.model.loader import LoadedModel
from tokenpipe.wire import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def mb_for(lm: LoadedModel, positions: int) -> float:
    return positions * bytes_per_position(lm.model, lm.dtype) / 2**20


def alone(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    engine = Engine(lm, max_batch=1, max_seq_len=2048, kv_cache_mb=mb_for(lm, 2100), prefix_caching=False)
    seq = engine.new_sequence("ref", prompt, greedy(n))
    engine.add(seq)
    engine.run_to_completion()
    return seq.generated


def test_pool_reuses_a_chain_and_evicts_least_recently_used_first() -> None:
    pool = BlockPool(5)  # 4 usable blocks
    keys = prefix_keys(list(range(3 * BLOCK_SIZE)))
    assert len(keys) == 3 and len(set(keys)) == 3
    assert prefix_keys(list(range(2 * BLOCK_SIZE))) == keys[:2]  # a key names the whole prefix
    held = [pool.allocate() for _ in range(3)]
    for block, key in zip(held, keys, strict=True):
        pool.register(block, key)
    pool.release(held)
    assert (pool.used, pool.cached, pool.available) == (0, 3, 4)
    assert pool.match(keys[:2]) == held[:2] and pool.used == 2
    other = pool.allocate()  # a never-used block before any cached one
    assert other not in held
    spare = pool.allocate()  # now the least recently used cached block: the chain's tail
    assert spare == held[2] and pool.match(keys) == held[:2]
    with pytest.raises(MemoryError):
        pool.allocate()


def test_a_budget_below_one_full_sequence_is_refused(tiny_model: LoadedModel) -> None:
    with pytest.raises(KVCacheTooSmall, match="TOKENPIPE_KV_CACHE_MB"):
        Engine(tiny_model, max_seq_len=512, kv_cache_mb=mb_for(tiny_model, 256))


def test_kv_memory_follows_positions_held(tiny_model: LoadedModel) -> None:
    """Memory written is the blocks held, not slots x the longest sequence."""
    engine = Engine(tiny_model, max_batch=8, max_seq_len=512, kv_cache_mb=mb_for(tiny_model, 8 * 512))
    prompts = [[7] * n for n in (300, 20, 33, 64, 5, 17, 100, 48)]
    seqs = [engine.new_sequence(f"s{i}", [t + i for t in p], greedy(4)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.step()
    held = sum(len(s.tokens) for s in seqs)
    assert engine.pool.used * BLOCK_SIZE <= 1.25 * held + len(seqs) * BLOCK_SIZE
    engine.run_to_completion()
    assert engine.pool.used == 0


def test_shared_prefix_is_prefilled_once_and_gives_the_same_tokens(tiny_model: LoadedModel) -> None:
    system = list(range(100, 100 + 5 * BLOCK_SIZE + 3))
    engine = Engine(tiny_model, max_batch=4, max_seq_len=512)
    first = engine.new_sequence("a", [*system, 1, 2, 3], greedy(6))
    engine.add(first)
    engine.run_to_completion()
    assert engine.pool.hit_tokens == 0
    second = engine.new_sequence("b", [*system, 4, 5], greedy(6))
    engine.add(second)
    engine.run_to_completion()
    assert engine.pool.hit_tokens == 5 * BLOCK_SIZE
    assert second.generated == alone(tiny_model, second.prompt, 6)
    # A conversation's next turn reuses the previous turn's prompt *and* its answer.
    turn2 = engine.new_sequence("c", [*second.prompt, *second.generated, 9, 9], greedy(6))
    engine.add(turn2)
    engine.run_to_completion()
    assert engine.pool.hit_tokens == 5 * BLOCK_SIZE + (len(second.tokens) // BLOCK_SIZE) * BLOCK_SIZE
    assert turn2.generated == alone(tiny_model, turn2.prompt, 6)


def test_running_out_of_blocks_preempts_the_youngest_and_loses_no_token(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=4, max_seq_len=128, kv_cache_mb=mb_for(tiny_model, 9 * BLOCK_SIZE),
                    admit_reserve_tokens=BLOCK_SIZE)
    prompts = [[11 + i] * 30 for i in range(3)]
    seqs = [engine.new_sequence(f"p{i}", p, greedy(40)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    engine.run_to_completion()
    assert engine.preemptions > 0
    for s, p in zip(seqs, prompts, strict=True):
        assert s.generated == alone(tiny_model, p, 40), s.id
    assert engine.pool.used == 0


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, int]], list[int], int]:
    """A shared head, then per request: (tail length, new tokens, shared head blocks); which to cancel;
    a budget in blocks (small ones force preemption)."""
    head = draw(st.lists(st.integers(1, 500), min_size=3 * BLOCK_SIZE, max_size=3 * BLOCK_SIZE))
    reqs = draw(st.lists(st.tuples(st.integers(1, 2 * BLOCK_SIZE + 1), st.integers(1, 24), st.integers(0, 3)),
                         min_size=1, max_size=6))
    cancel = draw(st.lists(st.integers(0, len(reqs) - 1), max_size=2, unique=True))
    blocks = draw(st.integers(8, 24))
    return head, reqs, cancel, blocks


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_tokens_identical_with_prefix_hits_preemption_cancel_and_resume(
        tiny_model: LoadedModel, work: tuple[list[int], list[tuple[int, int, int]], list[int], int]) -> None:
    """Greedy tokens of every request equal its tokens run alone with no cache, whatever it shared,
    was preempted, ran beside a cancelled request or was resumed from carried tokens."""
    head, reqs, cancel, blocks = work
    engine = Engine(tiny_model, max_batch=4, max_seq_len=96, kv_cache_mb=mb_for(tiny_model, blocks * BLOCK_SIZE),
                    admit_reserve_tokens=BLOCK_SIZE)
    seqs: list[Sequence] = []
    for i, (tail, n, shared) in enumerate(reqs):
        prompt = [*head[: shared * BLOCK_SIZE], *[(31 * i + 7 * j) % 500 + 1 for j in range(tail)]]
        seqs.append(engine.new_sequence(f"r{i}", prompt, greedy(n)))
        engine.add(seqs[-1])
    engine.step()
    for i in cancel:
        engine.cancel(f"r{i}")
    engine.run_to_completion()
    for i, s in enumerate(seqs):
        want = alone(tiny_model, s.prompt, s.max_new)
        if i in cancel and s.finish == "cancelled":
            assert s.generated == want[: len(s.generated)]
            continue
        # a request whose last token came in the first step had finished before its cancel arrived
        assert s.generated == want, (s.id, engine.preemptions)
        # resumed elsewhere after k tokens: the rest is the same (and hits the blocks it left)
        k = len(want) // 2
        if k:
            resumed = engine.new_sequence(f"again{i}", [*s.prompt, *want[:k]], greedy(len(want) - k), carried=k)
            engine.add(resumed)
            engine.run_to_completion()
            assert resumed.generated == want[k:]
    assert engine.pool.used == 0


@pytest.mark.smollm2
def test_smollm2_prefix_hit_gives_the_same_greedy_tokens(smollm2: LoadedModel) -> None:
    system = smollm2.tokenizer.encode("You are a helpful assistant who answers briefly and precisely. " * 6)
    engine = Engine(smollm2, max_batch=2, max_seq_len=512)
    outs = []
    for q in ("What is the capital of France?", "Name a primary colour."):
        seq = engine.new_sequence(q, [*system, *smollm2.tokenizer.encode(q)], greedy(12))
        engine.add(seq)
        engine.run_to_completion()
        outs.append(seq)
    assert engine.pool.hit_tokens >= (len(system) // BLOCK_SIZE) * BLOCK_SIZE
    for seq in outs:
        ref = Engine(smollm2, max_batch=1, max_seq_len=512, prefix_caching=False)
        again = ref.new_sequence("ref", seq.prompt, greedy(12))
        ref.add(again)
        ref.run_to_completion()
        assert seq.generated == again.generated


def test_decode_reads_blocks_in_any_order(tiny_model: LoadedModel) -> None:
    """Blocks handed out after eviction and reuse are scattered; attention follows the table."""
    engine = Engine(tiny_model, max_batch=2, max_seq_len=128, kv_cache_mb=mb_for(tiny_model, 12 * BLOCK_SIZE))
    for i in range(4):  # churn: the free list ends up out of order
        s = engine.new_sequence(f"c{i}", [50 + i] * (20 + 9 * i), greedy(3))
        engine.add(s)
        engine.run_to_completion()
    prompt = [int(t) for t in torch.randint(1, 400, (70,), generator=torch.Generator().manual_seed(3))]
    seq = engine.new_sequence("x", prompt, greedy(20))
    engine.add(seq)
    engine.step()
    assert seq.blocks != sorted(seq.blocks) or seq.blocks[0] != 1
    engine.run_to_completion()
    assert seq.generated == alone(tiny_model, prompt, 20)


async def test_a_generator_short_of_kv_blocks_pulls_by_memory_and_loses_no_token(settings, data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker whose KV budget holds a few of the requests at a time (max_batch is 16): every
    stream completes with the tokens the engine gives it alone; its metrics count the prompt tokens
    looked up and its announcement the free blocks."""
    from generator.model.loader import load_model
    from generator.service.worker import GeneratorWorker
    from producer import Producer
    from tokenpipe.bus import connect
    from tokenpipe.metrics import render
    from tokenpipe_cli.natsserver import NatsServer

    from .conftest import wait_until

    loaded = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir)
    loaded.name = "tiny-small-kv"
    budget = mb_for(loaded, 160 * BLOCK_SIZE)  # 159 usable blocks; max_seq_len 2048 needs 128
    # Its own nats-server: on the session's, its announcement outlived the test and other tests'
    # model lists and readiness counts saw a second generator.
    server = NatsServer(tmp_path / "nats")
    server.start()
    settings = settings.replace(nats_url=server.url)
    bus = await connect(settings, name="kv-generator")
    worker = GeneratorWorker(settings.replace(max_batch=16, kv_cache_mb=budget), loaded, bus)
    await worker.start()
    prompts = [[(13 * i + j) % 900 + 5 for j in range(300 + 37 * i)] for i in range(10)]
    try:
        assert 0 < worker.announcer.announcement().free_blocks <= 159
        async with await Producer.connect(settings=settings) as producer:
            handles = [await producer.submit("tiny-small-kv", input_ids=p, max_tokens=24, temperature=0,
                                             ignore_eos=True) for p in prompts]
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
        for prompt, res in zip(prompts, results, strict=True):
            assert res.finish == "length" and res.token_ids == alone(loaded, prompt, 24)
        await worker.announcer._refresh_gauges()
        text = render(worker.metrics.registry).decode()
        assert f'tokenpipe_prefix_cache_queries_total{{model_name="tiny-small-kv"}} {float(sum(map(len, prompts)))}' \
            in text
        await wait_until(lambda: worker.runner.stats().blocks_used == 0, 10, "blocks to be given back")
    finally:
        await worker.stop(drain_timeout=1.0)
        await bus.close()
        server.stop()


async def test_a_loop_whose_cancel_is_swallowed_by_a_finished_wait_for_still_stops() -> None:
    """The mechanism of the stop hang (gh-86296): on Python 3.11 ``asyncio.wait_for`` returns the
    result when the awaited future completed in the same loop iteration as the cancel, and the
    cancelled loop carries on. Stopped through :func:`stop_loops`, it ends at its next pause."""
    from tokenpipe.background import pause, stop_loops

    stopping = asyncio.Event()
    reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    rounds: list[str] = []

    async def loop() -> None:
        while await pause(stopping, 0):
            rounds.append(await asyncio.wait_for(reply, 30))  # as nats-py awaits a request's reply

    task = asyncio.create_task(loop())
    await wait_until_waiting(task)
    reply.set_result("reply")  # the reply lands ...
    stopper = asyncio.create_task(stop_loops(stopping, [task]))  # ... as the stop cancels the loop
    await asyncio.wait_for(stopper, 10)
    assert task.done()
    if sys.version_info < (3, 12):
        assert rounds == ["reply"]  # the cancel was swallowed: the round finished with the reply


async def wait_until_waiting(task: asyncio.Task[None]) -> None:
    """Until ``task`` is suspended in its ``wait_for``."""
    for _ in range(100):
        await asyncio.sleep(0)
        if any(f.f_code.co_name == "wait_for" for f in _awaiting(task)):
            return
    raise AssertionError("the task never waited")


def _awaiting(task: asyncio.Task[None]) -> list[Any]:
    """The frames of ``task``'s await chain, outermost first."""
    frames, coro = [], task.get_coro()
    while coro is not None:
        if getattr(coro, "cr_frame", None) is not None:
            frames.append(coro.cr_frame)
        coro = getattr(coro, "cr_await", None)
    return frames


async def test_a_generator_stops_when_a_nats_request_swallows_the_cancel_of_its_loops(  # type: ignore[no-untyped-def]
        settings, tiny_model: LoadedModel, tmp_path, monkeypatch) -> None:
    """Regression: ``GeneratorWorker.stop`` hung for ever (most runs of the short-of-KV-blocks test)
    when the announcer's or the repair loop's NATS request swallowed the loop's cancel (nats-py
    awaits replies with ``asyncio.wait_for``; on 3.11 a reply landing with the cancel wins): the
    loop went on to its next round and ``stop`` waited for it. Here both loops sit in a request
    that swallows its cancel, deterministically; ``stop`` must still return."""
    import generator.service.worker as worker_module
    from generator.service.worker import GeneratorWorker
    from tokenpipe.bus import connect
    from tokenpipe_cli.natsserver import NatsServer

    entered = {"announce": asyncio.Event(), "repair": asyncio.Event()}

    def swallowing(name: str):  # type: ignore[no-untyped-def]
        async def request(*args, **kwargs):  # type: ignore[no-untyped-def]
            entered[name].set()
            try:
                await asyncio.Event().wait()  # the reply, never here before the cancel
            except asyncio.CancelledError:
                return []  # ... and the cancel lost, as wait_for loses it when the reply is in
        return request

    server = NatsServer(tmp_path / "nats")  # its own: nothing of this worker lingers on the session's
    server.start()
    settings = settings.replace(nats_url=server.url, announce_interval_s=0.05)
    bus = await connect(settings, name="swallowing-generator")
    monkeypatch.setattr(worker_module, "REPAIR_INTERVAL_S", 0.05)
    monkeypatch.setattr(worker_module, "repair", swallowing("repair"))
    worker = GeneratorWorker(settings, tiny_model, bus)
    worker.announcer._refresh_gauges = swallowing("announce")  # type: ignore[method-assign]
    await worker.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in entered.values())), 30)
        await asyncio.wait_for(worker.stop(drain_timeout=0.1), 30)
    finally:
        await bus.close()
        server.stop()
