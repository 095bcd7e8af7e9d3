"""The continuous-batching engine against transformers' own generate()."""

from __future__ import annotations

import pytest
import torch

from generator.engine import Engine
from generator.models import LoadedModel
from generator.runner import encode_prompt
from tokenpipe.errors import InvalidRequest
from tokenpipe.wire import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def hf_greedy(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    out = lm.model.generate(input_ids=torch.tensor([prompt]), attention_mask=mask,
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
    from generator.forward import SlotKVCache, decode_step, prefill
    from generator.models import load_model

    lm = load_model("smollm2-135m", device="cpu", dtype="bfloat16", data_dir=data_dir)
    ids = torch.tensor([lm.tokenizer.encode("The history of the printing press")])
    cache = SlotKVCache(lm.model, 2, 256, lm.device, torch.bfloat16)
    with torch.inference_mode():
        logits = prefill(lm.model, cache, ids, torch.tensor([ids.shape[1]]), 0)
        nxt = logits.float().argmax(-1)
        step = decode_step(lm.model, cache, nxt, torch.tensor([ids.shape[1]]), 64).float()
        ref = lm.model(torch.cat([ids, nxt[:, None]], 1)).logits[0, -1].float()
    assert torch.nn.functional.cosine_similarity(step[0], ref, dim=0) > 0.999
    assert step[0].argmax() == ref.argmax()
