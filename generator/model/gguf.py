"""A Llama-family GGUF file read as stored: its tensors taken (memory-mapped) one at a time, each de-quantized
straight into the model's dtype and put in its module (:mod:`generator.model.llama`: transformers' names and
shapes, without its modeling code).

The default model (SmolLM2-135M's ``Q4_1`` GGUF) used to be de-quantized as a whole to fp32 safetensors on the
first start (~20-30 s, the whole model in fp32 in memory, then on disk) and loaded from them. Here ``gguf``'s
own de-quantization (the code transformers' GGUF loader calls, so the same values the fp32 cache held, bit for
bit) runs per tensor: the largest fp32 buffer is one tensor's, and nothing is written. Where the projections
keep their float weights (``TOKENPIPE_FLOAT_WEIGHTS=keep``, and every load outside a generator) the int4
kernels quantize them from these (:mod:`generator.model.quant`). Where they do not (a generator's default),
the file's ``Q4_1`` blocks are taken as they are (``as_stored``): the library's int4 layout is theirs, so no
float weight of a projection is ever made and none is quantized. Greedy tokens then follow the file's own
4-bit values, not the ones re-quantized from their bf16 rounding (which differed in 5 of 12 streams after
16-38 tokens, measured when the float weights still stayed).

llama.cpp stores q/k rows permuted for its RoPE; they are put back (:func:`_unpermute`, transformers' own
reverse permutation).

The file's index (where each tensor is) is read here (:func:`read_tensors`), not by ``gguf.GGUFReader``: that
builds an array view for every part of every metadata value, the tokenizer's ~100,000 strings included, which
took seconds of each start; the tokenizer and config are read once, at preparation, and kept beside.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenpipe.errors import ModelNotFound

from ..kernels.formats import Q4Weight
from .llama import LlamaForCausalLM, LlamaShape

__all__ = ["GGUFTensor", "load_gguf_llama", "q4_as_stored", "read_tensors"]

# GGUF tensor name -> the transformers Llama module it fills
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_PROJECTIONS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})


_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: the scalars' struct formats; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# element types of the tensors stored as plain numbers (the rest are blocks of bytes)
_PLAIN: dict[str, type[np.generic]] = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                                        "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``data`` is what ``gguf.GGUFReader`` gives (a memory-mapped view; a quantized
    type's rows as their bytes), ready for ``gguf.quants.dequantize``."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    """Little-endian reads through the header of a memory-mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.off = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.off += n
        return bytes(self.buf[self.off - n:self.off]).decode("utf-8")

    def value(self, kind: int) -> Any:
        """A metadata value (an array's elements are skipped, not read: None)."""
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        elem, count = self.take("<I"), self.take("<Q")
        if elem == _STRING:  # each string its own length: stepped over one by one
            for _ in range(count):
                self.off += 8 + struct.unpack_from("<Q", self.buf, self.off)[0]
        elif elem in _SCALARS:
            self.off += count * struct.calcsize(_SCALARS[elem])
        else:
            for _ in range(count):
                self.value(elem)
        return None


def read_tensors(path: Path) -> list[GGUFTensor]:
    """The tensors of the (little-endian, version 2 or 3) GGUF file ``path``, memory-mapped, in file order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file")
        cur.off = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (or a big-endian file) is not supported")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.take("<I"))
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, dims, GGMLQuantizationType(cur.take("<I")), cur.take("<Q")))
        start = -(-cur.off // alignment) * alignment
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"a damaged GGUF header: {exc}") from exc
    finally:
        buf.close()
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, kind, offset in infos:
        n = int(np.prod(dims))
        shape = tuple(reversed(dims))
        plain = _PLAIN.get(kind.name)
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = n * size // block
        raw = data[start + offset:start + offset + n_bytes]
        if raw.size != n_bytes:
            raise ValueError(f"the GGUF file ends inside tensor {name!r}")
        view = raw.reshape(quant_shape_to_byte_shape(shape, kind)) if plain is None else raw.view(plain).reshape(shape)
        tensors.append(GGUFTensor(name, kind, view))  # ^ blocks: each row as its bytes
    return tensors


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


def load_gguf_llama(path: Path, config: Any, dtype: torch.dtype, *,
                    as_stored: bool = False) -> tuple[Any, dict[str, Q4Weight]]:
    """The Llama of ``config`` (:class:`~generator.model.llama.LlamaShape`, or a transformers config) with the
    weights of the GGUF file ``path``, in ``dtype``, on the CPU,
    and (``as_stored``, where every decoder projection is ``Q4_1``) those projections as stored, by module path:
    the library's int4 layout is ``Q4_1``'s (:func:`q4_as_stored`), so nothing is computed; their ``Linear``s are
    then left on the meta device (shaped, holding nothing: the model's own forward does not run)."""
    from gguf import GGMLQuantizationType

    shape = config if isinstance(config, LlamaShape) else LlamaShape.from_dict(config.to_dict())
    try:
        tensors = read_tensors(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot read the GGUF file {path}: {exc}") from exc
    model = LlamaForCausalLM(shape, device="meta", dtype=dtype)  # holding nothing until the file's weights are in
    permuted = {"attn_q": shape.num_attention_heads, "attn_k": shape.num_key_value_heads}
    projections = [t for t in tensors if _module_name(t.name)[1] in _PROJECTIONS]
    as_stored = as_stored and bool(projections) and all(t.tensor_type == GGMLQuantizationType.Q4_1
                                                        for t in projections)
    stored: dict[str, Q4Weight] = {}
    for t in tensors:
        name, kind = _module_name(t.name)
        module: Any = model.get_submodule(name)
        if as_stored and kind in _PROJECTIONS:
            stored[name] = q4_as_stored(np.asarray(t.data), permuted.get(kind))
            if stored[name].nibbles.shape[0] * stored[name].nibbles.shape[1] * 2 != module.weight.numel():
                raise ModelNotFound(f"{t.name} in {path} does not fit the model's {name}")
            continue  # its Linear keeps its meta weight
        values = _as_fp32(np.asarray(t.data), t.tensor_type)  # fp32, this tensor only
        if kind in permuted:
            values = _unpermute(values, permuted[kind])
        weight = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # a writable copy, then dtype
        if weight.numel() != module.weight.numel():
            raise ModelNotFound(f"{t.name} in {path} does not fit the model's {name}")
        module.weight = nn.Parameter(weight.reshape(module.weight.shape), requires_grad=False)
    if model.config.tie_word_embeddings or model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta and n.removesuffix(".weight") not in stored]
    if missing:
        raise ModelNotFound(f"the GGUF file {path} lacks {', '.join(missing[:3])}")
    return model, stored


def _as_fp32(data: np.ndarray, kind: Any) -> np.ndarray:
    """A tensor's values in fp32: ``Q8_0`` (SmolLM2's token embedding, a 49,152-row vocabulary) in one
    vectorized pass (gguf's own de-quantizer goes row group by row group in Python: 0.17 s of a warm start's
    model load), other types by gguf's ``dequantize``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kind != GGMLQuantizationType.Q8_0:
        return np.asarray(dequantize(data, kind))
    n = data.shape[0]
    b = torch.from_numpy(np.array(data)).view(n, -1, 34)  # a copy (a read-only map); a block: d, 32 q
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, K/32, 1]
    q = b[..., 2:].view(torch.int8)  # [n, K/32, 32]
    return (q * d).reshape(n, -1).numpy()  # int8 * fp32 is fp32: no float copy of q first


def q4_as_stored(blocks: np.ndarray, heads: int | None = None) -> Q4Weight:
    """A ``Q4_1`` tensor's rows of blocks (``[N, K/32 * 20]`` bytes: each block fp16 ``d``, fp16 ``m``, then 16
    bytes whose byte j holds q[j] low and q[j + 16] high, ``w = q * d + m``) as the library's
    :class:`~generator.kernels.formats.Q4Weight`, the same numbers laid out apart; ``heads``: q/k rows put
    back in transformers' order (:func:`_unpermute`)."""
    n = blocks.shape[0]
    if heads is not None:
        blocks = _unpermute(blocks, heads)
    b = torch.from_numpy(np.array(blocks)).view(n, -1, 20)  # a copy: the file's map is read-only
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1).float()
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1).float()
    return Q4Weight(b[..., 4:].reshape(n, -1).contiguous(), d, m)
