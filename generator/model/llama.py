"""A Llama decoder as plain torch modules: the container the engine's own forward
(:mod:`generator.model.forward`) reads, without transformers' modeling code.

The engine never runs a model's own forward: it reads ``model.model.embed_tokens``, ``.layers`` (each
with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm`` and
``post_attention_layernorm``), ``.norm``, ``.rotary_emb`` and ``model.lm_head``, ``model.config``. Importing
transformers' Llama for that container cost every generator start 1.3 s and ~90 MB
(``torch.distributed.tensor``, sympy and dynamo come with its ``modeling_utils``). The built-in SmolLM2
(read from its GGUF file) is built on these modules instead; parameter names, shapes and the rotary
tables are transformers' (:func:`as_transformers` makes its model from this one, for references).
Other models (the random-weight ones, whose values come from transformers' initialisation, and model
directories) load through transformers as before.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from tokenpipe.errors import ModelNotFound

__all__ = ["LlamaForCausalLM", "LlamaShape", "as_transformers"]


@dataclass(frozen=True)
class LlamaShape:
    """The configuration the modules and the engine read (transformers' ``LlamaConfig`` names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaShape:
        """From a ``config.json``'s keys (or a transformers config's ``to_dict()``). Only what these modules
        compute is accepted: a Llama with the original rotary embedding."""
        if cfg.get("model_type", "llama") != "llama":
            raise ModelNotFound(f"model type {cfg.get('model_type')!r} is not a Llama")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if kind != "default":
            raise ModelNotFound(f"rotary embedding {kind!r} is not supported for a built-in model")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelNotFound(f"activation {cfg.get('hidden_act')!r} is not supported for a built-in model")
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")), bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"))

    @classmethod
    def from_file(cls, path: Path) -> LlamaShape:
        """From a model directory's ``config.json``."""
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelNotFound(f"cannot read the model configuration {path}: {exc!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        """transformers' ``LlamaConfig`` keys (:func:`as_transformers`)."""
        out = asdict(self)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": out.pop("rope_theta")}
        return out


class _Linear(nn.Linear):
    """``nn.Linear`` without its random initialisation: the weights come from a file. (On the meta device
    torch's initialisers run its Python references, whose import brings dynamo and sympy: 0.9 s.)"""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """``weight`` and ``variance_epsilon``, as :func:`generator.model.layers.rms_norm` reads them."""

    def __init__(self, size: int, eps: float, **made: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **made))
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """The original RoPE's tables, computed as transformers computes them (the same floats), on the CPU."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        dim = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[..., S, hd]`` in ``x``'s dtype for ``position_ids [..., S]``."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, **made: Any) -> None:
        super().__init__()
        d, hd, bias = shape.hidden_size, shape.head_dim, shape.attention_bias
        self.head_dim = hd
        self.scaling = hd**-0.5
        self.q_proj = _Linear(d, shape.num_attention_heads * hd, bias=bias, **made)
        self.k_proj = _Linear(d, shape.num_key_value_heads * hd, bias=bias, **made)
        self.v_proj = _Linear(d, shape.num_key_value_heads * hd, bias=bias, **made)
        self.o_proj = _Linear(shape.num_attention_heads * hd, d, bias=bias, **made)


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape, **made: Any) -> None:
        super().__init__()
        d, f, bias = shape.hidden_size, shape.intermediate_size, shape.mlp_bias
        self.gate_proj = _Linear(d, f, bias=bias, **made)
        self.up_proj = _Linear(d, f, bias=bias, **made)
        self.down_proj = _Linear(f, d, bias=bias, **made)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, **made: Any) -> None:
        super().__init__()
        self.self_attn = Attention(shape, **made)
        self.mlp = MLP(shape, **made)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **made)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **made)


class LlamaModel(nn.Module):
    def __init__(self, shape: LlamaShape, **made: Any) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(shape.vocab_size, shape.hidden_size, padding_idx=shape.pad_token_id, **made)
        self.layers = nn.ModuleList(DecoderLayer(shape, **made) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **made)
        self.rotary_emb = RotaryEmbedding(shape)


class LlamaForCausalLM(nn.Module):
    """``model`` (the decoder), ``lm_head`` and ``config``; no forward of its own (the engine's runs).
    Its weights are uninitialised (``device="meta"``: none held) until a file's are put in."""

    def __init__(self, shape: LlamaShape, *, device: str | torch.device = "meta",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        made: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = shape
        self.generation_config = SimpleNamespace(eos_token_id=shape.eos_token_id)
        self.model = LlamaModel(shape, **made)
        self.lm_head = _Linear(shape.hidden_size, shape.vocab_size, bias=False, **made)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device


def as_transformers(model: Any) -> Any:
    """transformers' model with ``model``'s weights (itself when it is one already): the reference its own
    forward and ``generate`` give, for tests and benchmarks. Needs the float weights (``keep``)."""
    if not isinstance(model, LlamaForCausalLM):
        return model
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as Reference

    with torch.device("meta"):
        ref = Reference(LlamaConfig.from_dict(model.config.to_dict()))
    ref.load_state_dict(model.state_dict(), assign=True, strict=False)
    if model.config.tie_word_embeddings:
        ref.lm_head.weight = ref.model.embed_tokens.weight
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=ref.config)  # computed, not stored: off the meta device
    ref.eval()  # its weights are this model's own tensors, in its dtype; the rotary tables stay fp32, as built
    return ref
