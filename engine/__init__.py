"""trio-rollout's engine: contracts, backends, the executor.

Public names are exported lazily (module ``__getattr__``) so that importing
``engine`` (which reward worker processes do) does not import torch.
"""

from __future__ import annotations


__all__ = [
    "BackendError",
    "BackendStatistics",
    "DatasetError",
    "EngineConfig",
    "EngineStatistics",
    "EpisodeResult",
    "GenerationHyperparameters",
    "HFBackend",
    "InferenceBackend",
    "InvalidRequestError",
    "MockBackend",
    "ModelRequest",
    "ModelResponse",
    "PerRequestBackend",
    "RewardError",
    "RolloutEngine",
    "RolloutEngineThread",
    "RolloutError",
    "SimBackend",
    "SimConfig",
    "TRAJECTORY_SCHEMA",
    "WeightSync",
    "WorkflowError",
    "concat_padded_tensors",
    "open_rollout_engine",
    "trajectory_from_response",
]

_LAZY = {
    "BackendError": "engine.errors",
    "BackendStatistics": "engine.backends.base",
    "DatasetError": "engine.errors",
    "EngineConfig": "engine.executor",
    "EngineStatistics": "engine.executor",
    "EpisodeResult": "engine.executor",
    "GenerationHyperparameters": "engine.types",
    "HFBackend": "engine.backends.hf",
    "InferenceBackend": "engine.backends.base",
    "InvalidRequestError": "engine.errors",
    "MockBackend": "engine.backends.base",
    "ModelRequest": "engine.types",
    "ModelResponse": "engine.types",
    "PerRequestBackend": "engine.backends.base",
    "RewardError": "engine.errors",
    "RolloutEngine": "engine.executor",
    "RolloutEngineThread": "engine.sync",
    "RolloutError": "engine.errors",
    "SimBackend": "engine.backends.sim",
    "SimConfig": "engine.backends.sim",
    "TRAJECTORY_SCHEMA": "engine.data",
    "WeightSync": "engine.backends.base",
    "WorkflowError": "engine.errors",
    "concat_padded_tensors": "engine.data",
    "open_rollout_engine": "engine.executor",
    "trajectory_from_response": "engine.data",
}


from ._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
