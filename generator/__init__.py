"""tokenpipe generator: a continuous-batching worker pulling requests from NATS."""

from .coalesce import Coalescer
from .detok import IncrementalDetokenizer, StopMatcher
from .engine import Engine, Sequence, StepOutput
from .models import LoadedModel, load_model
from .runner import Emission, Job, Runner

__all__ = ["Engine", "Sequence", "StepOutput", "Coalescer", "IncrementalDetokenizer", "StopMatcher",
           "LoadedModel", "load_model", "Runner", "Job", "Emission"]
