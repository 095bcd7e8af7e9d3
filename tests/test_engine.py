"""The continuous-batching engine against transformers' own generate()."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from generator.engine.runner import encode_prompt
from generator.engine.sampling import RowSampler, sample
from generator.engine.scheduler import Engine
from generator.model.llama import as_transformers
from generator.model.loader import LoadedModel
from tokenpipe.errors import InvalidRequest
from tokenpipe.settings import Settings
from tokenpipe.wire import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def hf_greedy(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    out = as_transformers(lm.model).generate(input_ids=torch.tensor([prompt]), attention_mask=mask,
                                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_all(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    seqs = {k: engine.new_sequence(k, p, params) for k, p in prompts.items()}
    for s in seqs.values():
        engine.add(s)
    engine.run_to_completion()
    return {k: s.generated for k, s in seqs.items()}


def prompts_of(lm: LoadedModel, texts: list[str]) -> dict[str, list[int]]:
    return {f"r{i}": lm.tokenizer.encode(t) for i, t in enumerate(texts)}


TEXTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1, 2, 3,", "Paris is"]


def test_greedy_matches_hf_generate_tiny(tiny_model: LoadedModel) -> None:
    prompts = prompts_of(tiny_model, TEXTS)
    got = run_all(Engine(tiny_model, max_batch=8), prompts, GREEDY)
    for key, prompt in prompts.items():
        assert got[key] == hf_greedy(tiny_model, prompt, GREEDY.max_tokens), key


@pytest.mark.smollm2
def test_greedy_matches_hf_generate_smollm2(smollm2: LoadedModel) -> None:
    prompts = prompts_of(smollm2, TEXTS[:3])
    got = run_all(Engine(smollm2, max_batch=4), prompts, GREEDY)
    for key, prompt in prompts.items():
        assert got[key] == hf_greedy(smollm2, prompt, GREEDY.max_tokens), key


def test_requests_joining_and_leaving_mid_batch_keep_their_outputs(tiny_model: LoadedModel) -> None:
    """Continuous batching: sequences admitted between steps, of different lengths, leaving early."""
    prompts = prompts_of(tiny_model, TEXTS)
    longest = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = {k: run_all(Engine(tiny_model, max_batch=1), {k: p}, longest)[k] for k, p in prompts.items()}
    engine = Engine(tiny_model, max_batch=3)  # fewer slots than requests: the 4th waits for a free slot
    seqs = {}
    for i, (k, p) in enumerate(prompts.items()):
        params = SamplingParams(max_tokens=8 + 6 * i, temperature=0.0, ignore_eos=True)
        seqs[k] = engine.new_sequence(k, p, params)
    engine.add(seqs["r0"])
    engine.step()
    engine.step()
    engine.add(seqs["r1"])  # joins a running batch
    engine.step()
    engine.add(seqs["r2"])
    engine.add(seqs["r3"])
    max_rows = 0
    while not engine.idle:
        engine.step()
        max_rows = max(max_rows, len(engine.rows))
    assert max_rows == 3
    for i, (k, s) in enumerate(seqs.items()):
        assert s.generated == alone[k][: 8 + 6 * i], k
        assert s.finish == "length"


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = tiny_model.tokenizer.encode("Seeds should repeat")
    a = run_all(Engine(tiny_model, max_batch=4), {"a": prompt}, params)["a"]
    others = {f"o{i}": tiny_model.tokenizer.encode(f"noise {i}") for i in range(3)}
    b = run_all(Engine(tiny_model, max_batch=4), {"a": prompt, **others}, params)["a"]
    c = run_all(Engine(tiny_model, max_batch=4), {"a": prompt},
                SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))["a"]
    assert a == b
    assert a != c


def test_seeded_request_ignores_mixed_batch_companions(tiny_model: LoadedModel) -> None:
    """Sampling is vectorised across rows: a seeded request's tokens must not depend on which
    other rows (greedy, temperature-only, top-k, top-p, other seeds) are sampled with it.

    The forward's logits differ in the last bits between batch sizes (GEMM blocking, ~2e-7
    here), and tiny-random's distribution is nearly uniform (a 0.9 nucleus of ~42k tokens, where
    such a difference moves the inverse CDF), so the request keeps a small set with top_k as
    well: a trained model's distribution is peaked."""
    params = SamplingParams(max_tokens=16, temperature=0.7, top_k=40, top_p=0.9, seed=7, ignore_eos=True)
    prompt = tiny_model.tokenizer.encode("Seeds should repeat")
    alone = run_all(Engine(tiny_model, max_batch=1), {"a": prompt}, params)["a"]
    engine = Engine(tiny_model, max_batch=6)
    companions = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=0.8, top_k=5, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=1.3, top_p=0.5, ignore_eos=True)]
    seqs = [engine.new_sequence(f"o{i}", tiny_model.tokenizer.encode(f"noise {i}"), p)
            for i, p in enumerate(companions)]
    for s in seqs[:2]:
        engine.add(s)
    engine.step()  # the seeded request joins a batch that is already running
    a = engine.new_sequence("a", prompt, params)
    engine.add(a)
    for s in seqs[2:]:
        engine.add(s)
    engine.run_to_completion()
    assert a.generated == alone


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    samplers = [RowSampler.from_params(dataclasses.replace(params, seed=i), torch.device("cpu")) for i in range(draws)]
    tokens = sample(logits.expand(draws, -1), samplers)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / draws


def test_vectorised_sampling_follows_the_filtered_distribution() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    probs = (logits[0] / 0.8).softmax(-1)
    freq = _frequencies(logits, SamplingParams(temperature=0.8), 6000)
    assert (freq - probs).abs().max() < 0.03
    top3 = probs[:3] / probs[:3].sum()
    freq = _frequencies(logits, SamplingParams(temperature=0.8, top_k=3), 6000)
    assert freq[3:].sum() == 0 and (freq[:3] - top3).abs().max() < 0.03
    # top_p 0.6 keeps the smallest prefix reaching 0.6 of the mass: tokens 0 and 1 here
    kept = probs[:2] / probs[:2].sum()
    assert probs[0] < 0.6 <= probs[:2].sum()
    freq = _frequencies(logits, SamplingParams(temperature=0.8, top_p=0.6), 6000)
    assert freq[2:].sum() == 0 and (freq[:2] - kept).abs().max() < 0.03


def test_flat_nucleus_beyond_the_candidates_is_sampled_exactly() -> None:
    """A nucleus wider than the candidate set falls back to the whole sorted vocabulary."""
    logits = torch.zeros(1, 2000)
    logits[0, 1000:] = -30.0  # 1000 equally likely tokens; top_p 0.5 keeps 500 of them
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.5), 4000)
    assert freq[1000:].sum() == 0
    assert 450 <= int((freq > 0).sum()) <= 501  # every kept token is reachable, none outside the nucleus


def test_cancel_frees_the_slot_next_step(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=4)
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    a = engine.new_sequence("a", [1, 2, 3], params)
    b = engine.new_sequence("b", [4, 5, 6, 7], params)
    engine.add(a)
    engine.add(b)
    engine.step()
    engine.step()
    assert len(engine.rows) == 2
    generated_before = len(b.generated)
    engine.cancel("a")
    outs = engine.step()
    assert [o.finish for o in outs if o.seq is a] == ["cancelled"]
    assert engine.rows == [b] and b.row == 0
    assert len(b.generated) == generated_before + 1
    # b keeps decoding correctly from its moved cache row
    alone = run_all(Engine(tiny_model, max_batch=1), {"b": [4, 5, 6, 7]},
                    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))["b"]
    while len(b.generated) < 20:
        engine.step()
    assert b.generated[:20] == alone


def test_eos_stops_unless_ignored(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=2)
    prompt = [5, 6, 7]
    first = run_all(Engine(tiny_model, max_batch=1), {"x": prompt},
                    SamplingParams(max_tokens=1, temperature=0.0))["x"][0]
    # Pretend that first greedy token is EOS: the engine must stop right there.
    object.__setattr__(engine.loaded, "eos_ids", frozenset({first}))
    try:
        s = engine.new_sequence("x", prompt, SamplingParams(max_tokens=10, temperature=0.0))
        engine.add(s)
        engine.run_to_completion()
        assert s.generated == [first] and s.finish == "stop"
        s2 = engine.new_sequence("y", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engine.add(s2)
        engine.run_to_completion()
        assert len(s2.generated) == 3 and s2.finish == "length"
    finally:
        object.__setattr__(engine.loaded, "eos_ids", frozenset({tiny_model.tokenizer.eos_token_id}))


def test_prompt_longer_than_context_is_refused(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, max_batch=2, max_seq_len=64)
    with pytest.raises(InvalidRequest, match="context"):
        engine.new_sequence("x", list(range(1, 70)), GREEDY)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.new_sequence("x", [10**9], GREEDY)
    s = engine.new_sequence("y", list(range(1, 60)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert s.max_new == 5  # capped by the context


def test_chat_template_is_applied(tiny_model: LoadedModel) -> None:
    req = Request.create("tiny-random", messages=({"role": "user", "content": "hi"},))
    text = tiny_model.tokenizer.decode(encode_prompt(tiny_model.tokenizer, req))
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_bf16_decode_step_tracks_hf_forward(data_dir) -> None:  # type: ignore[no-untyped-def]
    """The CPU default is bf16 where the CPU has it: our attention must agree with transformers'."""
    from generator.model.forward import decode_step, prefill
    from generator.model.kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
    from generator.model.loader import load_model

    lm = load_model("smollm2-135m", device="cpu", dtype="bfloat16", data_dir=data_dir)
    ids = torch.tensor([lm.tokenizer.encode("The history of the printing press")])
    n = ids.shape[1]
    cache = PagedKVCache(lm.model, 8 * BLOCK_SIZE * bytes_per_position(lm.model, torch.bfloat16), lm.device,
                         torch.bfloat16, min_positions=64)
    table = torch.tensor([[5, 3, 6, 1]])  # blocks out of order: positions go through the table
    slot = lambda p: int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE  # noqa: E731
    with torch.inference_mode():
        logits = prefill(lm.model, cache, ids, torch.arange(n)[None], torch.tensor([[slot(p) for p in range(n)]]),
                         torch.tensor([n]), None)
        nxt = logits.float().argmax(-1)
        step = decode_step(lm.model, cache, nxt, torch.tensor([n]), torch.tensor([slot(n)]), table).float()
        ref = as_transformers(lm.model)(torch.cat([ids, nxt[:, None]], 1)).logits[0, -1].float()
    assert torch.nn.functional.cosine_similarity(step[0], ref, dim=0) > 0.999
    assert step[0].argmax() == ref.argmax()


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (3, 3), (4, 3), (16, 15)])
def test_engine_threads_leave_a_core_only_where_it_is_cheap(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                            expected: int) -> None:
    """Regression: "one fewer than the cores" ran a quiet 2-core machine's engine at 0.62x."""
    from generator.model.loader import resolve_threads

    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert resolve_threads(0) == expected
    assert resolve_threads(5) == 5  # an explicit TOKENPIPE_THREADS wins


@pytest.mark.parametrize(("cores", "generators", "expected"), [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 7), (16, 4, 3)])
def test_generators_of_one_machine_share_its_cores(cores: int, generators: int, expected: int) -> None:
    """Regression: `tokenpipe up --generators 2` on 2 cores ran two engines of 2 threads each."""
    from tokenpipe.settings import engine_threads

    assert engine_threads(0, cores=cores, generators=generators) == expected
    assert engine_threads(3, cores=cores, generators=generators) == 3  # TOKENPIPE_THREADS wins


def test_two_generators_loading_at_once_on_a_small_machine_do_not_spin_on_each_others_cores(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 49, warm start): `tokenpipe up --generators 2` on 2 cores loaded each model with 2
    OpenMP threads, whose spinning at every barrier took the other process's core (14.6 s each against
    5.0 s): a small machine reads and quantizes the weights on one thread, and the engine thread steps,
    and keys its kernel table (a warm start found no cached table while the key said 1 thread), with its
    own count."""
    from generator.engine.runner import torch_thread
    from generator.model import loader
    from generator.model.loader import load_for, load_threads

    assert [load_threads(2, cores) for cores in (1, 2, 4)] == [1, 1, 1]
    assert load_threads(15, 16) == 15
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    during: list[int] = []
    build = loader.build_plan

    def counting_build(*args: Any, **kw: Any) -> Any:
        during.append(torch.get_num_threads())
        return build(*args, **kw)

    monkeypatch.setattr(loader, "build_plan", counting_build)
    (tmp_path / "models").symlink_to(Path(settings.data_dir) / "models", target_is_directory=True)
    fresh = dataclasses.replace(settings, threads=2, quant="int4", kernels="auto", data_dir=str(tmp_path))

    def load_then_count() -> tuple[int, Any]:
        lm = load_for(fresh)
        return torch.get_num_threads(), lm.tuning

    engine = torch_thread()
    try:
        after, tuning = engine.submit(load_then_count).result()
    finally:
        engine.shutdown()
    assert during == [1] and after == 2
    assert tuning is not None and tuning.key["threads"] == 2  # the table the engine's steps will use


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_decode_attention_in_fp32_for_few_rows_agrees_with_bf16(rows: int) -> None:
    """Few rows of a bf16 cache are attended in fp32 (faster there); either path must give the
    attention an fp32 reference gives, in the caller's dtype."""
    from generator.model.attention import FP32_ATTENTION_ROWS, attention_bias
    from generator.model.attention import decode_attention as _decode_attention

    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, *shape, generator=g).to(torch.bfloat16) for shape in ((9, 1, 64), (3, 40, 64),
                                                                                        (3, 40, 64)))
    mask = torch.ones(rows, 40, dtype=torch.bool)
    mask[0, 30:] = False
    # K/V as gathered: [G, B, T, hd]
    got = _decode_attention(q, k.transpose(0, 1), v.transpose(0, 1), attention_bias(mask), 0.125)
    qf, kf, vf = (t.float().repeat_interleave(3, 1) if t is not q else t.float() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[:, None, None, :], scale=0.125)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 9, 1, 64)
    assert torch.allclose(got.float(), ref, atol=0.03), (rows, FP32_ATTENTION_ROWS)


def test_a_burst_of_prompts_is_prefilled_in_steps_of_the_time_bound_and_keeps_its_tokens(
        tiny_model: LoadedModel) -> None:
    """Regression (issue 46, a 2-core AVX2 CPU): 32 short chats created at once were one prefill step of
    2.9 s, and a person's chat arriving meanwhile waited for all of it (13x its idle TTFT). On a CPU a
    step now takes what the measured cost allows in ``prefill_step_s``: the burst is admitted a few at
    a time, the first prefill before any cost is known takes at most 512 tokens, a prompt wider than
    the bound still runs (alone), and every sequence gets the tokens of an unbounded engine."""
    prompts = {f"r{i}": [5 + i, *range(10, 50)] for i in range(32)}  # 41 tokens each
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    unbounded = run_all(Engine(tiny_model, max_batch=32), prompts, params)
    engine = Engine(tiny_model, max_batch=32, prefill_step_s=0.25)
    seqs = {k: engine.new_sequence(k, p, params) for k, p in prompts.items()}
    for s in seqs.values():
        engine.add(s)
    engine.step()
    assert len(engine.rows) == 512 // 41  # no cost measured yet: the first step's bound
    assert engine.prefill_token_s is not None and engine.prefill_token_s > 0
    engine.prefill_token_s = 0.25 / 100  # as if a padded token cost 2.5 ms: 100 tokens a step
    before = len(engine.rows)
    engine.step()
    assert len(engine.rows) - before == 100 // 41  # padded: two prompts of 41 in 100 tokens
    engine.run_to_completion()
    assert {k: s.generated for k, s in seqs.items()} == unbounded
    wide = Engine(tiny_model, max_batch=4, prefill_step_s=0.25)
    wide.prefill_token_s = 0.25 / 64  # 64 tokens a step
    long = wide.new_sequence("long", list(range(3, 203)), params)  # 200 tokens: wider than the bound
    wide.add(long)
    wide.step()
    assert wide.rows == [long] and len(long.generated) == 1
