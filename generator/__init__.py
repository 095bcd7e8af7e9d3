"""tokenpipe generator: a continuous-batching worker pulling requests from NATS.

In layers, each importing only itself and the layers below it: :mod:`generator.service` (NATS, the
worker, the writers) → :mod:`generator.engine` (continuous batching, its thread or process) →
:mod:`generator.model` (loading, the plan, the forward pass) → :mod:`generator.kernels` (the native
kernel library). :mod:`generator.main` is the role's entry point.
"""

from .engine import Emission, Engine, Job, Runner, Sequence, StepOutput
from .engine.detok import IncrementalDetokenizer, StopMatcher
from .model import LoadedModel, load_model
from .service.coalesce import Coalescer

__all__ = ["Engine", "Sequence", "StepOutput", "Coalescer", "IncrementalDetokenizer", "StopMatcher",
           "LoadedModel", "load_model", "Runner", "Job", "Emission"]
