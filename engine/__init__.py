"""trio-rollout's engine: contracts, backends, the executor.

Public names are exported lazily (module ``__getattr__``) so that importing
``engine`` (which reward worker processes do) does not import torch.
"""

from __future__ import annotations


__all__ = [
    "BackendError",
    "DatasetError",
    "EngineConfig",
    "EngineStatistics",
    "EpisodeResult",
    "GenerationHyperparameters",
    "GenerationJob",
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
    "WorkflowError",
    "concat_padded_tensors",
    "derive_seed",
    "open_rollout_engine",
    "trajectory_from_response",
]

_LAZY = {
    "BackendError": "engine.errors",
    "DatasetError": "engine.errors",
    "EngineConfig": "engine.executor",
    "EngineStatistics": "engine.executor",
    "EpisodeResult": "engine.executor",
    "GenerationHyperparameters": "engine.types",
    "GenerationJob": "engine.backends.base",
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
    "WorkflowError": "engine.errors",
    "concat_padded_tensors": "engine.data",
    "derive_seed": "engine.types",
    "open_rollout_engine": "engine.executor",
    "trajectory_from_response": "engine.data",
}


from ._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
