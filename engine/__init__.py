"""trio-rollout's engine: contracts, backends, the executor.

Public names are exported lazily (module ``__getattr__``) so that importing
``engine`` (which reward worker processes do) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


__all__ = [
    "AsyncioEngine",
    "BackendError",
    "BackendStatistics",
    "DatasetError",
    "EngineConfig",
    "EngineStatistics",
    "EpisodeEngine",
    "EpisodeResult",
    "EpisodeStatus",
    "FailReason",
    "GenerationHyperparameters",
    "HFBackend",
    "InferenceBackend",
    "Injected",
    "InvalidRequestError",
    "MessageDelta",
    "MockBackend",
    "ModelRequest",
    "ModelResponse",
    "PerRequestBackend",
    "RejectReason",
    "RewardError",
    "RolloutEngine",
    "RolloutEngineThread",
    "RolloutError",
    "RolloutWorkflow",
    "Sampled",
    "SimBackend",
    "SimConfig",
    "TRAJECTORY_PAD_VALUES",
    "TRAJECTORY_SCHEMA",
    "TokenConversation",
    "WeightSync",
    "WorkflowError",
    "build_trajectory",
    "collect_drift_events",
    "concat_padded_tensors",
    "derive_seed",
    "import_object",
    "message_delta",
    "open_rollout_engine",
    "resolve_reward_fn",
    "trajectory_from_response",
]

_LAZY = {
    "BackendError": "engine.errors",
    "BackendStatistics": "engine.backends.base",
    "DatasetError": "engine.errors",
    "EngineConfig": "engine.executor",
    "EngineStatistics": "engine.executor",
    "EpisodeEngine": "engine.workflow",
    "EpisodeResult": "engine.executor",
    "EpisodeStatus": "engine._records",
    "FailReason": "engine.errors",
    "GenerationHyperparameters": "engine.types",
    "HFBackend": "engine.backends.hf",
    "InferenceBackend": "engine.backends.base",
    "Injected": "engine.trajectory",
    "InvalidRequestError": "engine.errors",
    "MessageDelta": "engine.chat",
    "MockBackend": "engine.backends.base",
    "ModelRequest": "engine.types",
    "ModelResponse": "engine.types",
    "AsyncioEngine": "engine.aio",
    "PerRequestBackend": "engine.backends.base",
    "RejectReason": "engine._records",
    "RewardError": "engine.errors",
    "RolloutEngine": "engine.executor",
    "RolloutEngineThread": "engine.sync",
    "RolloutError": "engine.errors",
    "RolloutWorkflow": "engine.workflow",
    "Sampled": "engine.trajectory",
    "SimBackend": "engine.backends.sim",
    "SimConfig": "engine.backends.sim",
    "TRAJECTORY_PAD_VALUES": "engine.data",
    "TRAJECTORY_SCHEMA": "engine.data",
    "TokenConversation": "engine.chat",
    "WeightSync": "engine.backends.base",
    "WorkflowError": "engine.errors",
    "build_trajectory": "engine.trajectory",
    "collect_drift_events": "engine.chat",
    "concat_padded_tensors": "engine.data",
    "derive_seed": "engine.types",
    "import_object": "engine.imports",
    "message_delta": "engine.chat",
    "open_rollout_engine": "engine.executor",
    "resolve_reward_fn": "engine.imports",
    "trajectory_from_response": "engine.trajectory",
}


if TYPE_CHECKING:  # what type checkers see; at run time each name resolves on first access
    from ._records import EpisodeStatus as EpisodeStatus, RejectReason as RejectReason
    from .backends.base import (
        BackendStatistics as BackendStatistics,
        InferenceBackend as InferenceBackend,
        MockBackend as MockBackend,
        PerRequestBackend as PerRequestBackend,
        WeightSync as WeightSync,
    )
    from .backends.hf import HFBackend as HFBackend
    from .backends.sim import SimBackend as SimBackend, SimConfig as SimConfig
    from .chat import (
        MessageDelta as MessageDelta,
        TokenConversation as TokenConversation,
        collect_drift_events as collect_drift_events,
        message_delta as message_delta,
    )
    from .data import (
        TRAJECTORY_PAD_VALUES as TRAJECTORY_PAD_VALUES,
        TRAJECTORY_SCHEMA as TRAJECTORY_SCHEMA,
        concat_padded_tensors as concat_padded_tensors,
    )
    from .errors import (
        BackendError as BackendError,
        DatasetError as DatasetError,
        FailReason as FailReason,
        InvalidRequestError as InvalidRequestError,
        RewardError as RewardError,
        RolloutError as RolloutError,
        WorkflowError as WorkflowError,
    )
    from .executor import (
        EngineConfig as EngineConfig,
        EngineStatistics as EngineStatistics,
        EpisodeResult as EpisodeResult,
        RolloutEngine as RolloutEngine,
        open_rollout_engine as open_rollout_engine,
    )
    from .imports import import_object as import_object, resolve_reward_fn as resolve_reward_fn
    from .aio import AsyncioEngine as AsyncioEngine
    from .sync import RolloutEngineThread as RolloutEngineThread
    from .trajectory import (
        Injected as Injected,
        Sampled as Sampled,
        build_trajectory as build_trajectory,
        trajectory_from_response as trajectory_from_response,
    )
    from .types import (
        GenerationHyperparameters as GenerationHyperparameters,
        ModelRequest as ModelRequest,
        ModelResponse as ModelResponse,
        derive_seed as derive_seed,
    )
    from .workflow import EpisodeEngine as EpisodeEngine, RolloutWorkflow as RolloutWorkflow

from .lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
