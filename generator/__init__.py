"""tokenpipe generator: a continuous-batching worker pulling requests from NATS.

In layers, each importing only itself and the layers below it: :mod:`generator.service` (NATS, the
worker, the writers) → :mod:`generator.engine` (continuous batching, its thread or process) →
:mod:`generator.model` (loading, the plan, the forward pass) → :mod:`generator.kernels` (the native
kernel library). :mod:`generator.main` is the role's entry point.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Emission, Engine, Job, Runner, Sequence, StepOutput
    from .engine.detok import IncrementalDetokenizer, StopMatcher
    from .model import LoadedModel, load_model
    from .service.coalesce import Coalescer

__all__ = ["Engine", "Sequence", "StepOutput", "Coalescer", "IncrementalDetokenizer", "StopMatcher",
           "LoadedModel", "load_model", "Runner", "Job", "Emission"]

# Each name from its module on first use: `tokenpipe up` reads generator.model.preparation (the model's
# files) without importing torch and the engine, ~1.5 s of its start.
_HOMES = {"Engine": ".engine", "Sequence": ".engine", "StepOutput": ".engine", "Runner": ".engine", "Job": ".engine",
          "Emission": ".engine", "IncrementalDetokenizer": ".engine.detok", "StopMatcher": ".engine.detok",
          "LoadedModel": ".model", "load_model": ".model", "Coalescer": ".service.coalesce"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
