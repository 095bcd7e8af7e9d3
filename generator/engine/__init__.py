"""The engine layer: continuous batching over a loaded model (the scheduler, the KV blocks'
bookkeeping, sampling, detokenizing, CUDA graphs), run on a thread of its own (:class:`Runner`) or in a
process of its own (:class:`EngineProcess`), both seen by the service layer as an :class:`EngineHandle`.
No transport here."""

from .handle import Emission, EngineHandle, EngineStats, Job
from .process import EngineProcess
from .runner import Runner
from .scheduler import Engine, Sequence, StepOutput

__all__ = ["Emission", "Engine", "EngineHandle", "EngineProcess", "EngineStats", "Job", "Runner", "Sequence",
           "StepOutput"]
