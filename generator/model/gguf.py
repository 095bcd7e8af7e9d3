"""A Llama-family GGUF file read as stored: its tensors taken (memory-mapped) one at a time, each de-quantized
straight into the model's dtype and put in the transformers model's module.

The default model (SmolLM2-135M's ``Q4_1`` GGUF) used to be de-quantized as a whole to fp32 safetensors on the
first start (~20-30 s, the whole model in fp32 in memory, then on disk) and loaded from them. Here ``gguf``'s
own de-quantization (the code transformers' GGUF loader calls, so the same values the fp32 cache held, bit for
bit) runs per tensor: the largest fp32 buffer is one tensor's, and nothing is written. The int4 kernels then
quantize the projections from these float weights as before (:mod:`generator.model.quant`): the file's
``Q4_1`` blocks could be taken as they are, but on a bf16 model that changed greedy tokens against the
weights quantized from the bf16 values (measured: 5 of 12 streams after 16-38 tokens), and the float weights
stay anyway (a prefill's many rows use them).

llama.cpp stores q/k rows permuted for its RoPE; they are put back (:func:`_unpermute`, transformers' own
reverse permutation).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenpipe.errors import ModelNotFound

__all__ = ["load_gguf_llama"]

# GGUF tensor name -> the transformers Llama module it fills
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _module_name(gguf_name: str) -> tuple[str, str]:
    """``(module path, GGUF kind)`` of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj``, ``attn_q``)."""
    m = _LAYER.fullmatch(gguf_name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}", m[2]
    base = gguf_name.removesuffix(".weight")
    if base not in _TOP_NAMES:
        raise ModelNotFound(f"unexpected tensor {gguf_name!r} in the GGUF file")
    return _TOP_NAMES[base], base


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to transformers' (``rows [N, ...]``)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def load_gguf_llama(path: Path, config: Any, dtype: torch.dtype) -> Any:
    """The transformers Llama of ``config`` with the weights of the GGUF file ``path``, in ``dtype``, on the CPU."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot read the GGUF file {path}: {exc}") from exc
    with torch.device("meta"):  # no random initialisation of weights about to be replaced
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # the rotary tables are computed, not stored: made again off the meta device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    permuted = {"attn_q": int(config.num_attention_heads), "attn_k": int(config.num_key_value_heads)}
    for t in reader.tensors:
        name, kind = _module_name(t.name)
        module = model.get_submodule(name)
        values = dequantize(np.asarray(t.data), t.tensor_type)  # fp32, this tensor only
        if kind in permuted:
            values = _unpermute(values, permuted[kind])
        weight = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # a writable copy, then dtype
        if weight.numel() != module.weight.numel():
            raise ModelNotFound(f"{t.name} in {path} does not fit the model's {name}")
        module.weight = nn.Parameter(weight.reshape(module.weight.shape), requires_grad=False)
    if model.config.tie_word_embeddings or model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotFound(f"the GGUF file {path} lacks {', '.join(missing[:3])}")
    return model
