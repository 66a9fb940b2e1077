"""trio-rollout as OpenRLHF's ``llm_engine``: OpenRLHF's own agent executors generate on our engine.

Tested with **OpenRLHF 0.11.2** (PyPI).  The seam (``openrlhf/trainer/ray/vllm_engine.py``,
``RolloutRayActor``): OpenRLHF's executors (``openrlhf/utils/agent.py``:
``AgentExecutorBase.execute(prompt, label, sampling_params, max_length, hf_tokenizer,
llm_engine, images=None)``, ``MultiTurnAgentExecutor``, ``SingleTurnAgentExecutor``) call
``await llm_engine.generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` and read
a vLLM ``RequestOutput``; OpenRLHF's trainer calls the actor's ``generate_responses`` and its
weight-sync methods.  :class:`OpenRLHFEngine` is that object over our engine::

    import asyncio
    from engine import EngineConfig, HFBackend, RolloutEngineThread
    from engine.integrations.openrlhf import OpenRLHFEngine, SamplingParams
    from openrlhf.utils.agent import MultiTurnAgentExecutor

    with RolloutEngineThread(HFBackend(path), EngineConfig(max_concurrent_rollouts=64)) as thread:
        llm = OpenRLHFEngine(thread, tokenizer, executor=MultiTurnAgentExecutor(MyAgent))
        params = SamplingParams(temperature=1.0, max_tokens=None, logprobs=1)   # or vllm.SamplingParams
        rows = asyncio.run(llm.generate_responses("prompt", "label", params, 1024, tokenizer, num_samples=8))

In OpenRLHF's Ray trainer: :func:`install` (:mod:`engine.integrations._openrlhf_ray`) makes
``create_vllm_engines`` build Ray actors over this class (see ``docs/guide/trainers/openrlhf.md``).

What the adapter does:

* **Generation.** ``generate`` turns ``sampling_params`` into our config (:func:`to_gconfig`:
  an unsupported vLLM setting is one error naming it) and awaits ``AsyncioEngine.agenerate``:
  each call is its own trio task in the engine's loop (no thread per call, so no cap on
  requests in flight), with partial rollout across weight updates.  The reply is vLLM-shaped
  (:func:`request_output`: vLLM's text rules, ``logprobs[i][token_id].logprob`` of the
  *processed* distribution, as OpenRLHF requests with ``logprobs_mode="processed_logprobs"``),
  with ``outputs[0].token_versions`` added.
* **Rows.** ``generate_responses`` runs ``num_samples`` ``execute`` calls concurrently, as
  OpenRLHF's actor does, but a sample that raises, times out (``execute_timeout_s``) or comes
  back without a reward (``SingleTurnAgentExecutor`` turns a failing reward into ``None`` and
  logs it at INFO) is run again, up to ``max_attempts``; then the call raises
  :class:`IncompleteGroupError` naming the prompt and the reasons.  Never a short group:
  OpenRLHF's group baselines reshape rewards by ``n_samples_per_prompt``.  Each row also gets
  ``rollout_versions`` (per token of ``observation_tokens``: -1 outside the action ranges).
* **Weights.** OpenRLHF's per-parameter broadcast (``init_process_group`` once, then
  ``update_weight(name, dtype, shape, empty_cache)`` per parameter, ``empty_cache=True`` on the
  last) is received, staged, and loaded in one ``engine.update_weights`` at the last parameter
  (version + 1): generation never sees half the new weights.  See
  :mod:`engine.integrations._openrlhf_weights` for what each transport needs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError
from ..lazy import lazy_exports
from ._openrlhf_params import CompletionOutput, Logprob, RequestOutput, SamplingParams, request_output, to_gconfig
from ._openrlhf_weights import WeightReceiver

__all__ = ["CompletionOutput", "IncompleteGroupError", "Logprob", "OpenRLHFConfig", "OpenRLHFEngine",
           "OpenRLHFRayOptions", "OpenRLHFStatistics", "RequestOutput", "SamplingParams", "TrioRolloutActor",
           "create_engines", "install", "load_executor", "openrlhf_missing"]

logger = logging.getLogger(f"rollout.{__name__}")

#: the one line a user sees when OpenRLHF is not installed
_MISSING = ("OpenRLHF is not installed in this environment: build its venv with "
            "`bash tests/integrations/openrlhf/venv.sh .venv-openrlhf` (or pip install openrlhf==0.11.2)")


def openrlhf_missing() -> str | None:
    """None when ``openrlhf.utils.agent`` imports, else the one-line reason naming the venv target."""
    try:
        import openrlhf.utils.agent  # noqa: F401
    except ImportError as exc:
        return f"{_MISSING} ({exc})"
    return None


def _require_openrlhf() -> None:
    why = openrlhf_missing()
    if why is not None:
        raise ImportError(why)


class IncompleteGroupError(RuntimeError):
    """A prompt did not get ``num_samples`` rows within ``max_attempts`` per sample.

    Attributes: ``prompt``; ``reasons``: the last failure of each sample that gave up."""

    def __init__(self, prompt: Any, reasons: list[str]) -> None:
        super().__init__(f"generate_responses: {len(reasons)} sample(s) of prompt {str(prompt)[:80]!r} failed "
                         f"every attempt: {'; '.join(reasons)}")
        self.prompt, self.reasons = prompt, reasons


@dataclass(frozen=True, kw_only=True)
class OpenRLHFConfig:
    """Settings of :class:`OpenRLHFEngine` (validated; a ``ValueError`` names the field).

    Attributes:
        max_model_len: prompt + completion tokens at most (vLLM's ``max_model_len``; OpenRLHF
            passes ``--data.max_len``); the budget of a request with ``max_tokens=None``.
        max_attempts: ``execute`` attempts per sample in ``generate_responses`` (>= 1).
        execute_timeout_s: bound of one ``execute`` attempt (seconds, > 0).
        require_reward: a row whose ``reward`` is None is a failed attempt.  None: only when
            the executor is a ``SingleTurnAgentExecutor`` with reward endpoints.
    """

    max_model_len: int = 32768
    max_attempts: int = 3
    execute_timeout_s: float = 3600.0
    require_reward: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        t = self.execute_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
            raise ValueError(f"execute_timeout_s must be a number of seconds > 0, got {t!r}")


@dataclass(frozen=True)
class OpenRLHFStatistics:
    """A snapshot of an :class:`OpenRLHFEngine`.

    Attributes:
        generate_calls: ``generate`` calls started; ``generating``: of which still running.
        samples: rows returned by ``generate_responses``; ``attempts_failed``: ``execute``
            attempts that failed and were run again or gave up; ``samples_given_up``: samples
            that used ``max_attempts`` (each raised :class:`IncompleteGroupError`).
        weight_syncs: completed weight loads through this adapter; ``version``: the version of
            the last one (-1: none yet; :meth:`OpenRLHFEngine.get_version` reads the engine's).
    """

    generate_calls: int
    generating: int
    samples: int
    attempts_failed: int
    samples_given_up: int
    weight_syncs: int
    version: int


#: the versions of each generate call made by the current ``execute`` attempt
_RECORD: contextvars.ContextVar[list[list[int]] | None] = contextvars.ContextVar("openrlhf_versions", default=None)


def load_executor(agent_func_path: str | None = None, remote_rm_url: Any = None) -> Any:
    """The executor OpenRLHF's ``RolloutRayActor`` would use: ``AgentExecutor()`` from the
    ``--train.agent_func_path`` file (``vllm_engine._load_agent_executor``'s checks), else
    ``SingleTurnAgentExecutor(remote_rm_url)``.  Imports no vLLM.

    Raises:
        ImportError: OpenRLHF is not installed (one line naming the venv target).
        InvalidRequestError: the path is not a ``.py`` file, lacks ``AgentExecutor``, or its
            ``AgentExecutor`` does not subclass ``AgentExecutorBase``.
    """
    _require_openrlhf()
    import importlib.util

    from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor

    if not agent_func_path:
        return SingleTurnAgentExecutor(remote_rm_url)
    if not str(agent_func_path).endswith(".py"):
        raise InvalidRequestError(f"agent_func_path must be a Python file, got {agent_func_path!r}")
    spec = importlib.util.spec_from_file_location("agent_module", agent_func_path)
    if spec is None or spec.loader is None:
        raise InvalidRequestError(f"agent_func_path: cannot load {agent_func_path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, "AgentExecutor", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise InvalidRequestError(f"agent_func_path {agent_func_path!r} must define class AgentExecutor"
                                  "(openrlhf.utils.agent.AgentExecutorBase)")
    return cls()


class OpenRLHFEngine:
    """OpenRLHF's ``llm_engine`` and rollout actor API over our engine (module docstring).

    Args:
        engine: a started :class:`engine.RolloutEngineThread`, or an
            :class:`engine.aio.AsyncioEngine` over one.
        tokenizer: the model's Hugging Face tokenizer (decodes ``text``; its EOS ids stop
            generation unless ``ignore_eos``, as in vLLM).
        config: :class:`OpenRLHFConfig`.
        executor: the ``AgentExecutorBase`` that ``generate_responses`` runs (default:
            :func:`load_executor` ``()``: OpenRLHF's ``SingleTurnAgentExecutor``).

    Call its coroutines from an asyncio loop (OpenRLHF's Ray actor, ``asyncio.run``).
    """

    def __init__(self, engine: Any, tokenizer: Any, config: OpenRLHFConfig | None = None, *,
                 executor: Any = None) -> None:
        from ..aio import AsyncioEngine

        self.config = config or OpenRLHFConfig()
        self.aio = engine if isinstance(engine, AsyncioEngine) else AsyncioEngine(engine)
        self.tokenizer = tokenizer
        self.executor = executor if executor is not None else load_executor()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = frozenset() if eos is None else frozenset([int(eos)])
        self._weights = WeightReceiver()
        self._version = -1
        self._counts = {"generate_calls": 0, "generating": 0, "samples": 0, "attempts_failed": 0,
                        "samples_given_up": 0, "weight_syncs": 0}

    # -- what the executors call ---------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        """One completion of ``prompt_token_ids`` (vLLM ``RequestOutput``; see the module docstring).

        Raises:
            InvalidRequestError: ``multi_modal_data`` given (not supported here yet), an
                unsupported sampling setting, or no budget left (``max_tokens <= 0`` or the
                prompt fills ``max_model_len``).
            BackendError: the backend failed (after the engine's own retries).
        """
        from ..types import ModelRequest

        if multi_modal_data:
            raise InvalidRequestError("multi_modal_data: images are not supported by the trio-rollout OpenRLHF "
                                      "adapter yet (use a text-only agent)")
        ids = [int(t) for t in prompt_token_ids]
        gconfig = to_gconfig(sampling_params, prompt_len=len(ids), max_model_len=self.config.max_model_len)
        self._counts["generate_calls"] += 1
        self._counts["generating"] += 1
        try:
            resp = await self.aio.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig))
        finally:
            self._counts["generating"] -= 1
        record = _RECORD.get()
        if record is not None:
            record.append([int(v) for v in resp.output_versions])
        return request_output(resp, sampling_params, self.tokenizer, eos_token_ids=self._eos)

    def get_num_unfinished_requests(self) -> int:
        """``generate`` calls in flight (OpenRLHF balances prompts across engines with it)."""
        return self._counts["generating"]

    # -- what OpenRLHF's trainer calls -------------------------------------------------------
    async def generate_responses(self, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict[str, Any]]:
        """``num_samples`` rows of ``self.executor.execute(...)`` for one prompt, in sample order
        (``RolloutRayActor.generate_responses``), each with ``rollout_versions`` added.

        Raises:
            IncompleteGroupError: a sample failed ``max_attempts`` times.
        """
        results = await asyncio.gather(*(self._sample(prompt, label, sampling_params, max_length, hf_tokenizer,
                                                      images) for _ in range(num_samples)))
        failed = [r for r in results if isinstance(r, str)]
        if failed:
            self._counts["samples_given_up"] += len(failed)
            raise IncompleteGroupError(prompt, failed)
        self._counts["samples"] += len(results)
        return [r for r in results if isinstance(r, dict)]

    async def _sample(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      images: Any) -> dict[str, Any] | str:
        """One row, or the last failure's reason after ``max_attempts`` (runs as its own task)."""
        reason = ""
        for attempt in range(1, self.config.max_attempts + 1):
            record: list[list[int]] = []
            _RECORD.set(record)
            try:
                row = await asyncio.wait_for(self.executor.execute(
                    prompt=prompt, label=label, sampling_params=sampling_params, max_length=max_length,
                    hf_tokenizer=hf_tokenizer, llm_engine=self, images=images), self.config.execute_timeout_s)
            except asyncio.TimeoutError:
                reason = f"execute timed out after {self.config.execute_timeout_s} s"
            except Exception as exc:  # the executor and the agent are user code: attributed, run again
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if self._requires_reward() and row.get("reward") is None:
                    reason = "the row has no reward (the executor's reward call failed)"
                else:
                    row["rollout_versions"] = _versions(row, record)
                    return dict(row)
            self._counts["attempts_failed"] += 1
            logger.warning("openrlhf: attempt %s/%s of a sample failed: %s", attempt, self.config.max_attempts,
                           reason)
        return reason

    def _requires_reward(self) -> bool:
        if self.config.require_reward is not None:
            return self.config.require_reward
        return bool(getattr(self.executor, "reward_endpoints", None))

    # -- weights ------------------------------------------------------------------------
    async def get_version(self) -> int:
        """The engine's policy version (one more per completed weight load)."""
        async def read() -> int:
            return int(self.aio.engine.version)

        return await self.aio.run(read)

    async def update_weights(self, source: Any, *, version: int | None = None) -> int:
        """Load ``source`` (a state dict, or a folder for server backends) as ``version``
        (default: the current version + 1); generations in flight resume on the new weights,
        their later tokens tagged with it.  Returns the new version.

        Raises:
            BackendError: the weights do not fit; the old ones and the version stay.
        """
        async def load() -> int:
            engine = self.aio.engine
            new = engine.version + 1 if version is None else int(version)
            await engine.update_weights(source, version=new)
            return int(new)

        new = await self.aio.run(load)
        self._counts["weight_syncs"] += 1
        self._version = new
        return new

    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        """Join OpenRLHF's weight-broadcast group as rank ``rank_offset`` (this engine is one rank).
        See :class:`~engine.integrations._openrlhf_weights.WeightReceiver` for the transports."""
        await asyncio.to_thread(self._weights.init_group, master_address, master_port, rank_offset, world_size,
                                group_name, backend, use_ray)

    async def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
        """Receive parameter ``name`` from OpenRLHF's broadcast; at the last one (OpenRLHF sets
        ``empty_cache=True`` there) load the staged set as version + 1."""
        await asyncio.to_thread(self._weights.receive, name, dtype, shape)
        if empty_cache:
            await self.update_weights(self._weights.take())

    async def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Any = None,
                                     empty_cache: bool = False) -> None:
        """Not supported: see :meth:`WeightReceiver.receive_cuda_ipc` (raises)."""
        self._weights.receive_cuda_ipc(name)

    async def reset_prefix_cache(self) -> None:
        """Nothing to do: the engine keeps no cache across requests that outlives a weight load
        (an interrupted request is re-sent whole)."""

    async def pause_generation(self) -> None:
        """OpenRLHF's async trainer around a weight broadcast: no new generation segment starts
        (``engine.pause``); segments in flight finish."""
        async def pause() -> None:
            self.aio.engine.pause()

        await self.aio.run(pause)

    async def resume_generation(self) -> None:
        """Undo :meth:`pause_generation`."""
        async def resume() -> None:
            self.aio.engine.resume()

        await self.aio.run(resume)

    async def sleep(self, level: int = 1) -> None:
        """A no-op: the engine's backends do not offload their weights (``--vllm.enable_sleep``
        frees no memory here)."""

    async def wake_up(self, tags: Any = None) -> None:
        """A no-op (see :meth:`sleep`)."""

    def statistics(self) -> OpenRLHFStatistics:
        """A frozen snapshot (sync, cheap)."""
        return OpenRLHFStatistics(**self._counts, version=self._version)


def _versions(row: dict[str, Any], record: list[list[int]]) -> list[int] | None:
    """Per token of ``row["observation_tokens"]``: the version of each action token (from the
    generate calls, in order, matched to ``action_ranges``), -1 elsewhere; None when the
    executor's ranges do not match its generate calls (a custom executor)."""
    tokens, ranges = row.get("observation_tokens"), row.get("action_ranges")
    if tokens is None or ranges is None or len(ranges) != len(record):
        return None
    out = [-1] * len(tokens)
    for (start, end), versions in zip(ranges, record):
        if end - start != len(versions):
            return None
        out[start:end] = versions
    return out


# the Ray plug-in, resolved on first access (its module imports this one; Ray only when called)
_LAZY = {name: "engine.integrations._openrlhf_ray"
         for name in ("OpenRLHFRayOptions", "TrioRolloutActor", "create_engines", "install")}
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

if TYPE_CHECKING:
    from ._openrlhf_ray import OpenRLHFRayOptions, TrioRolloutActor, create_engines, install
