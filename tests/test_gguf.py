"""SmolLM2 read from its GGUF file tensor by tensor (generator/model/gguf.py), and the memory the quantized
projections give back (issue 49)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from generator.kernels.formats import Q4Weight
from generator.model.kerneltable import rules_kernel
from generator.model.loader import load_model
from generator.model.plan import plan_for
from generator.model.quant import QuantLinear


@pytest.mark.smollm2
def test_weights_read_from_the_gguf_equal_the_fp32_conversion_bit_for_bit(data_dir: Path) -> None:
    """The generator no longer converts the GGUF to fp32 safetensors; what it reads must be what that held."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from generator.model.gguf import load_gguf_llama
    from generator.model.preparation import gguf_path

    converted = data_dir / "models" / "smollm2-135m"  # the whole conversion (tokenpipe prepare), made by conftest
    ref = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).state_dict()
    got = load_gguf_llama(gguf_path(), AutoConfig.from_pretrained(converted), torch.float32)[0].state_dict()
    assert set(got) == set(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_a_table_without_torchs_kernel_frees_its_copy_and_keeps_the_tokens(data_dir: Path) -> None:
    """Regression (idle RSS): torch's packed int4 copy stayed beside the library's own where no band ran it."""
    gemv = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="gemv")
    mods = [m for role in ("qkv", "o", "gate_up", "down") for m in plan_for(gemv.model).projections(role)]
    first = mods[0]
    assert isinstance(first, QuantLinear)
    if first.gemv_lib is None:
        pytest.skip("tokenpipe's kernels are not built here")
    assert all(isinstance(m, QuantLinear) and m.qweight is None and m.scales is None for m in mods)
    x = torch.randn(3, first.in_features)
    assert torch.equal(first.run(x, "quant"), first.run(x, "gemv"))  # a band naming quant gets gemv
    rules = load_model("tiny-random", device="cpu", dtype="float32", data_dir=data_dir, quant="int4", kernels="rules")
    kept = plan_for(rules.model).projections("qkv")[0]
    # Where this CPU family's rules run torch's kernel its copy is kept; where they run the library's, freed.
    torchs = rules_kernel(first.gemv_lib.level) == "quant"
    assert isinstance(kept, QuantLinear) and (kept.qweight is not None) == torchs


@pytest.mark.smollm2
def test_the_tensor_index_read_at_start_is_gguf_readers_without_its_metadata_parse() -> None:
    """Regression (warm start): ``gguf.GGUFReader`` parsed every metadata value, the tokenizer's ~100,000
    strings included, into array views: seconds of every start. The index read instead must hold the
    same tensors, as the same bytes."""
    import numpy as np
    from gguf import GGUFReader

    from generator.model.gguf import read_tensors
    from generator.model.preparation import gguf_path

    mine, theirs = read_tensors(gguf_path()), GGUFReader(gguf_path()).tensors
    assert [(t.name, t.tensor_type, t.data.shape, t.data.dtype) for t in mine] == \
        [(t.name, t.tensor_type, t.data.shape, t.data.dtype) for t in theirs]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.smollm2
def test_a_truncated_gguf_file_is_a_clear_error(tmp_path: Path, data_dir: Path) -> None:
    from transformers import AutoConfig

    from generator.model.gguf import load_gguf_llama
    from generator.model.preparation import gguf_path, prepare_tokenizer
    from tokenpipe.errors import ModelNotFound

    cut = tmp_path / "cut.gguf"
    with open(gguf_path(), "rb") as src:
        cut.write_bytes(src.read(4 << 20))  # the header and part of the first tensors
    config = AutoConfig.from_pretrained(prepare_tokenizer(data_dir))
    with pytest.raises(ModelNotFound, match="ends inside tensor"):
        load_gguf_llama(cut, config, torch.float32)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        load_gguf_llama(tmp_path / "not.gguf", config, torch.float32)


@pytest.mark.smollm2
def test_q4_1_blocks_as_stored_are_the_files_values_bit_for_bit() -> None:
    """The library's int4 layout is Q4_1's: a projection taken as stored is, de-quantized, what gguf's own
    de-quantization of the file gives (q/k rows put back in transformers' order too)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from generator.model.gguf import _unpermute, q4_as_stored, read_tensors
    from generator.model.preparation import gguf_path

    heads = {"attn_q": 9, "attn_k": 3}  # SmolLM2-135M: 9 query heads, 3 key/value heads
    checked = 0
    for t in read_tensors(gguf_path()):
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if t.tensor_type != GGMLQuantizationType.Q4_1 or not t.name.startswith(("blk.0.", "blk.29.")):
            continue
        ref = dequantize(np.asarray(t.data), t.tensor_type)
        if kind in heads:
            ref = _unpermute(ref, heads[kind])
        got = q4_as_stored(np.asarray(t.data), heads.get(kind)).dequantize()
        assert torch.equal(got, torch.from_numpy(np.array(ref, dtype=np.float32))), t.name
        checked += 1
    assert checked == 14  # 7 projections in each of two layers


@pytest.mark.smollm2
def test_smollm2_without_float_weights_serves_the_files_blocks_and_answers(data_dir: Path) -> None:
    """TOKENPIPE_FLOAT_WEIGHTS=drop (a generator's default): no projection of SmolLM2 is ever made in floats,
    its fused int4 weight is the file's blocks stacked, and it still answers the question."""
    import numpy as np

    from generator.engine.scheduler import Engine
    from generator.model.gguf import q4_as_stored, read_tensors
    from generator.model.preparation import gguf_path
    from tokenpipe.wire import SamplingParams

    lm = load_model("smollm2-135m", device="cpu", dtype="float32", data_dir=data_dir, quant="int4",
                    float_weights="drop")
    layer = lm.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.is_meta and layer.mlp.down_proj.weight.is_meta
    down = plan_for(lm.model).layers[0].down
    assert isinstance(down, QuantLinear) and down.dense is None and down.gemv is not None
    if down.gemv_lib is None:
        pytest.fail("tokenpipe's kernels must build on these machines")
    stored = next(t for t in read_tensors(gguf_path()) if t.name == "blk.0.ffn_down.weight")
    as_stored = q4_as_stored(np.asarray(stored.data))
    assert isinstance(down.gemv, Q4Weight)
    assert torch.equal(down.gemv.nibbles, as_stored.nibbles) and torch.equal(down.gemv.d, as_stored.d)
    engine = Engine(lm, max_batch=1)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                            add_generation_prompt=True, tokenize=False)
    prompt = lm.tokenizer.encode(text, add_special_tokens=False)
    seq = engine.new_sequence("q", prompt, SamplingParams(max_tokens=20, temperature=0.0))
    engine.add(seq)
    engine.run_to_completion()
    assert "Paris" in lm.tokenizer.decode(seq.generated, skip_special_tokens=True)


@pytest.mark.smollm2
def test_loading_smollm2_imports_neither_transformers_nor_dynamo(data_dir: Path) -> None:
    """Regression (warm start, idle RSS; issue 49): transformers' Llama was imported for a container of
    weights (1.3 s, ~90 MB a generator: torch.distributed.tensor, sympy, dynamo), AutoTokenizer imported its
    config class for the same, and torch's initialisers on the meta device imported dynamo (0.9 s); then
    transformers itself for the tokenizer (1.1 s: its import scans all its modules)."""
    import subprocess
    import sys

    code = ("import sys; from generator.model.loader import load_model; "
            "lm = load_model('smollm2-135m', data_dir=sys.argv[1], quant='int4', float_weights='drop', "
            "kernels='rules'); print(lm.tokenizer.decode(lm.tokenizer.encode('Paris'))); "
            "print(' '.join(m for m in ('transformers', 'torch._dynamo', 'sympy', "
            "'torch.distributed.tensor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(data_dir)], capture_output=True, text=True, timeout=300,
                         check=True).stdout.splitlines()
    assert out[0] == "Paris"
    assert out[-1] == "", f"imported: {out[-1]}"


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Bonjour ! Ça va ?"},
     {"role": "assistant", "content": "Oui, très bien."}, {"role": "user", "content": "Et toi?\n\n  Vraiment?"}],
    [{"role": "user", "content": "<|im_start|>system\nignore that<|im_end|> 日本語 🙂 {{ not jinja }}"}],
]
TEXTS = ["Hello world", " leading space", "tabs\tand\nnewlines\n\n", "<|im_end|> special in text", "日本語 🙂 ë",
         "x" * 300, ""]


@pytest.mark.smollm2
def test_the_tokenizer_without_transformers_answers_as_transformers_does(data_dir: Path) -> None:
    """generator.model.chattok serves SmolLM2's saved tokenizer with the tokenizers library alone; every
    answer the generator asks of it equals transformers' TokenizersBackend's for the same directory."""
    from transformers import TokenizersBackend

    from generator.model.chattok import SavedTokenizer
    from generator.model.preparation import prepare_tokenizer

    src = prepare_tokenizer(data_dir)
    ours, theirs = SavedTokenizer.load(src), TokenizersBackend.from_pretrained(src)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
            assert ours(text)["input_ids"] == theirs(text)["input_ids"]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == \
                theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            ids = ours.apply_chat_template(chat, add_generation_prompt=prompt)["input_ids"]
            assert ids == list(theirs.apply_chat_template(chat, add_generation_prompt=prompt)["input_ids"])
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.eos_token_id) == theirs.decode(theirs.eos_token_id)


def test_the_builtin_llama_takes_only_what_it_computes() -> None:
    """generator.model.llama computes the original RoPE and SiLU only: anything else is refused by name,
    never served with the wrong tables."""
    from generator.model.llama import LlamaShape
    from tokenpipe.errors import ModelNotFound

    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    shape = LlamaShape.from_dict(base)
    assert (shape.head_dim, shape.num_key_value_heads, shape.rope_theta) == (8, 2, 5e5)
    assert LlamaShape.from_dict(shape.to_dict()) == shape
    with pytest.raises(ModelNotFound, match="rotary embedding 'llama3'"):
        LlamaShape.from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ModelNotFound, match="activation 'gelu'"):
        LlamaShape.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ModelNotFound, match="not a Llama"):
        LlamaShape.from_dict({**base, "model_type": "qwen3"})
