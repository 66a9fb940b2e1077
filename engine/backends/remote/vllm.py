"""``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions`` with token ids in and out.

Wire facts (``SERVERS_AND_MODELS.md`` §2 and §6, verified on vLLM 0.32 CPU); the sampling
values are those of :func:`engine.backends.sglang_wire.sampling_params`, under vLLM's names::

    {"model": m, "prompt": [token ids], "max_tokens": budget, "temperature": 0 if greedy else t,
     "top_p", "top_k": -1 when disabled, "min_tokens", "stop_token_ids", "stop" (if any),
     "ignore_eos", "skip_special_tokens", "frequency_penalty", "seed" (if set),
     "logprobs": 0, "return_token_ids": true, "return_tokens_as_token_ids": true,
     "request_id": "<rid>@<seq>", "stream": false}

A non-zero ``ModelRequest.priority`` is sent as ``priority`` (vLLM's own sense: lower is
served first); it orders the server's queue only with ``--scheduling-policy priority``.  vLLM
0.32 ignores it under its default ``fcfs`` policy (``tests/contract/test_remote_vllm_priority.py``);
older vLLM (the V0 engine) refused a non-zero one there with HTTP 400 ("Got priority ... but
Priority scheduling is not enabled").  So when the start-up read of ``/server_info`` (below)
shows a server with another policy, the backend stops sending priorities
(:attr:`VLLMBackend.priority_scheduling` is False; one log line says so), and a scheduling
policy relies on its own admission order.

Answer: ``choices[0].token_ids`` (the stop/EOS token included), logprobs from
``choices[0].logprobs.token_logprobs`` (``"token_id:N"`` strings in ``logprobs.tokens`` are
the fallback for ids and must agree), ``finish_reason`` ``stop``/``length``/``abort``
(``repetition`` -> ``stop``; ``error`` is a retryable server fault).

Logprob semantics: ``"processed"``, like every backend here: the log-softmax after
temperature, top-k and top-p (penalties and logit processors included), which vLLM returns
only when the server runs with ``--logprobs-mode processed_logprobs`` (its default,
``raw_logprobs``, is before all of them; SERVERS_AND_MODELS.md §6).  At start-up the backend
reads each healthy server's mode from ``GET /server_info?config_format=json``
(``vllm_config.model_config.logprobs_mode``; dev mode) and refuses to start with a server
that runs another mode, or that does not say (:class:`LogprobsModeError`;
``check_logprobs_mode=False`` trusts the servers instead).  Mixing raw and processed logprobs would silently change the numbers a PPO
ratio is built from.

Seeds (reproducibility).  A request's ``gconfig.seed`` is sent as ``seed``: vLLM samples it
with a ``torch.Generator`` of its own, so the same seed gives the same tokens whatever else
is in the batch (``tests/contract/test_remote_vllm_run.py`` checks it on CPU).  vLLM 0.32
keeps that promise across *chunked prefill* (a prompt computed over several engine steps) by
rewinding the generator after each partial step with ``set_offset``, which only CUDA's
generator has: on CPU the engine core dies (``RuntimeError: CPU Generator does not use
offset``, ``gpu_model_runner._bookkeeping_sync``) and the server exits as soon as a seeded
prompt is split -- when the prompts arriving together exceed ``max_num_batched_tokens``
(2048 on CPU; e.g. ``rollout run --dataset builtin:arith:16 --n-samples 2``: 32 prompts of
~130 tokens), or when one prompt alone does.  The client cannot keep a server from splitting
prompts (other requests share each step's budget) and dropping the seeds would lose
reproducibility, so at start-up the backend reads each server's ``/server_info`` and refuses
a CPU server with chunked prefill on (:class:`SeededSamplingError`; restart it with
``--no-enable-chunked-prefill``, after which a prompt is always computed in one step;
``check_seeded_sampling=False`` when no request carries a seed).  GPU servers are not
affected.

Abort: ``POST /abort_requests {"request_ids": ["cmpl-<request_id>-0"]}`` (the engine's
per-choice id; needs ``VLLM_SERVER_DEV_MODE=1``, else 404 and the dropped connection aborts).
A client disconnect aborts too.  Pause: ``POST /pause?mode=abort|wait|keep``, continue:
``POST /resume`` (dev mode).  Requests sent to a paused vLLM block, which is why the
backend keeps its own client-side pause.

Images: refused.  ``/v1/completions`` takes a token-id prompt and no image inputs; vLLM
accepts images only through ``/v1/chat/completions``, which renders the prompt again from
messages (AReaL's ``vision_msg_vllm`` path), so the ids trained on would not be the ids
sampled from.  A request with ``image_data`` raises :class:`InvalidRequestError` before
anything is sent; use the ``sglang`` or ``hf`` backend for vision workflows.

Weights (:class:`~engine.backends.base.WeightSync`, through ``engine.update_weights``; dev
mode, vLLM 0.32), on every server of the pool, between ``/pause?mode=abort`` and ``/resume``:
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": folder,
"is_checkpoint_format": true}}`` (every worker reloads the folder in place), ``POST
/reset_prefix_cache`` (no cached prompt KV computed by the old weights is reused; vLLM's
``/pause`` clears it today only through a deprecated default), then ``POST
/update_weight_version {"new_version": "<v>"}``.  A server without dev mode answers 404,
reported as such.

vLLM 0.32's CPU backend reloads a tied LM head wrongly (its prepacked GEMM weight keeps the
start-up weights; see ``vllm_worker/rollout_vllm_worker.py`` next to this file), so
the tokens after an update would come from neither the old nor the new weights.  The backend
reads each server's ``/server_info`` before an update: when every server runs this package's
worker extension (:data:`WORKER_EXTENSION`, files in :func:`vllm_worker_dir`) it calls the
extension's ``rollout_reload_weights`` instead, which reloads and then repacks the head; a
CPU server without the extension is refused with :class:`BackendError` before anything is
loaded (start it with ``PYTHONPATH=<vllm_worker_dir()>`` and ``--worker-extension-cls
rollout_vllm_worker.RolloutWorkerExtension``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeGuard

from ...errors import BackendError, InvalidRequestError
from ...types import ModelRequest, ModelResponse
from ..sglang_wire import sampling_params
from ._backend import RemoteBackend
from ._control import checkpoint_folder
from ._errors import RemoteCallError
from ._routing import Server
from ._wire import LoraLimits, ParsedGeneration, WireCall, WireProtocol

__all__ = ["LogprobsModeError", "PROCESSED_LOGPROBS_MODE", "SeededSamplingError", "VLLMBackend",
           "VLLMServerSetupError", "VLLMWire", "WORKER_EXTENSION", "vllm_abort_id", "vllm_worker_dir"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: the server's ``--logprobs-mode`` that gives this package's logprob semantics
PROCESSED_LOGPROBS_MODE = "processed_logprobs"



class VLLMServerSetupError(BackendError):
    """A vLLM server runs with options this package cannot work with (raised at
    start-up; the subclasses say which).

    The message is ``problem`` then ``fix``; ``fix`` defaults to the class's
    :attr:`PYTHON_FIX` (how to fix it from the Python API).  A front end without the
    Python switch (``rollout run``) words its own with :meth:`with_fix`.

    Attributes:
        url: the server's base URL.
        problem: what is wrong, without the fix.
    """

    #: the fix, from the Python API
    PYTHON_FIX = "restart the server"

    def __init__(self, url: str, problem: str, fix: str | None = None) -> None:
        self.url, self.problem, self.fix = url, problem, self.PYTHON_FIX if fix is None else fix
        super().__init__(f"{problem}: {self.fix}")

    def __reduce__(self) -> Any:  # (crosses process boundaries whole: sharded engines)
        return type(self), (self.url, self.problem, self.fix)

    def with_fix(self, fix: str) -> VLLMServerSetupError:
        """The same error with another ``fix`` (the end of the message)."""
        return type(self)(self.url, self.problem, fix)


class LogprobsModeError(VLLMServerSetupError):
    """A vLLM server does not run ``--logprobs-mode processed_logprobs``, or does not say
    (raised at start-up when ``check_logprobs_mode`` is on)."""

    PYTHON_FIX = (f"restart it with --logprobs-mode {PROCESSED_LOGPROBS_MODE} and VLLM_SERVER_DEV_MODE=1, or pass "
                  "check_logprobs_mode=False (make_remote_backend / VLLMBackend) if every server already runs "
                  "that mode")


class SeededSamplingError(VLLMServerSetupError):
    """A vLLM server on CPU runs with chunked prefill, where a seeded request crashes its
    engine (raised at start-up when ``check_seeded_sampling`` is on; see the module
    docstring, "Seeds")."""

    PYTHON_FIX = ("restart it with --no-enable-chunked-prefill, or pass check_seeded_sampling=False "
                  "(make_remote_backend / VLLMBackend) if no request carries a seed (gconfig.seed)")


#: ``--worker-extension-cls`` value of this package's vLLM worker extension (importable by the
#: server once :func:`vllm_worker_dir` is on its ``PYTHONPATH``)
WORKER_EXTENSION = "rollout_vllm_worker.RolloutWorkerExtension"

#: the extension's reload method (``POST /collective_rpc``)
_EXTENSION_RELOAD = "rollout_reload_weights"


def vllm_worker_dir() -> str:
    """The folder to put on a vLLM server's ``PYTHONPATH`` for :data:`WORKER_EXTENSION`
    (a plain module that imports only ``vllm``; see the module docstring)."""
    return str(Path(__file__).resolve().parent / "vllm_worker")

#: the sampling fields vLLM names differently from SGLang (:func:`sampling_params`)
_VLLM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop", "tool_calls": "tool_calls"}


def vllm_abort_id(request_id: str) -> str:
    """The engine id to abort for a ``/v1/completions`` call sent with ``request_id``."""
    return f"cmpl-{request_id}-0"


def _token_id(text: str) -> int:
    prefix = "token_id:"
    if not isinstance(text, str) or not text.startswith(prefix):
        raise ValueError(f"token {text!r} is not 'token_id:N' (return_tokens_as_token_ids not honoured?)")
    return int(text[len(prefix):])


class VLLMWire(WireProtocol):
    """vLLM's OpenAI-compatible API (and its dev-mode routes) as a
    :class:`~engine.backends.remote.WireProtocol`.

    Attributes:
        model: the served model name sent in every request (``None`` until known).
        send_priority: send a non-zero ``ModelRequest.priority`` (the module docstring).
    """

    generate_path = "/v1/completions"
    health_path = "/health"
    pause_modes = ("abort", "wait", "keep")
    sync_pause_modes = {"abort": "abort", "in_place": "keep"}

    def __init__(self, model: str | None = None) -> None:
        self.model = model
        self.send_priority = True

    def build_payload(self, request: ModelRequest, budget: int, wire_id: str) -> dict[str, Any]:
        params = sampling_params(request.gconfig, budget)  # SGLang's names; vLLM's below
        payload: dict[str, Any] = {"model": self.model, "prompt": list(request.input_ids)}
        payload.update((_VLLM_NAMES.get(k, k), v) for k, v in params.items())
        payload.update({"logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                        "request_id": wire_id, "stream": False})
        if request.priority and self.send_priority:
            payload["priority"] = int(request.priority)
        return payload

    def parse_generation(self, body: Any) -> ParsedGeneration:
        choices = body["choices"]
        if not isinstance(choices, list) or len(choices) != 1:
            raise ValueError(f"expected one choice, got {choices!r}")
        choice = choices[0]
        finish = choice.get("finish_reason")
        if finish == "error":
            raise RemoteCallError("the server reported finish_reason 'error'", retryable=True)
        if finish not in _FINISH:
            raise ValueError(f"unknown finish_reason {finish!r}")
        lp = choice.get("logprobs") or {}
        token_logprobs = lp.get("token_logprobs")
        named = lp.get("tokens")
        ids = choice.get("token_ids")
        if ids is None:
            if named is None:
                raise ValueError("neither choices[0].token_ids nor logprobs.tokens (return_token_ids not honoured?)")
            ids = [_token_id(t) for t in named]
        elif named is not None and len(named) == len(ids) and [_token_id(t) for t in named] != ids:
            raise RemoteCallError("choices[0].token_ids disagree with logprobs.tokens")
        if token_logprobs is None:
            if ids:
                raise ValueError("choices[0].logprobs.token_logprobs is missing (logprobs not honoured?)")
            token_logprobs = []
        logprobs = [float("nan") if x is None else x for x in token_logprobs]
        return ParsedGeneration(list(ids), logprobs, _FINISH[finish], None)

    def abort_call(self, wire_id: str) -> WireCall:
        return "POST", "/abort_requests", {"request_ids": [vllm_abort_id(wire_id)]}, None

    def pause_call(self, mode: str) -> WireCall:
        return "POST", "/pause", None, {"mode": mode}

    def continue_call(self) -> WireCall:
        return "POST", "/resume", None, None

    def weight_update_calls(self, folder: str, version: int, *, extension: bool = False) -> list[WireCall]:
        """Reload ``folder`` (stock ``reload_weights``, or :data:`WORKER_EXTENSION`'s
        ``rollout_reload_weights`` with ``extension``), drop the prefix cache, set the version."""
        rpc: dict[str, Any] = (
            {"method": _EXTENSION_RELOAD, "kwargs": {"weights_path": folder}} if extension else
            {"method": "reload_weights", "kwargs": {"weights_path": folder, "is_checkpoint_format": True}})
        return [("POST", "/collective_rpc", rpc, None),
                ("POST", "/reset_prefix_cache", None, None),
                ("POST", "/update_weight_version", {"new_version": str(version)}, None)]

    def model_info_call(self) -> tuple[str, str]:
        return "GET", "/v1/models"

    def parse_model_name(self, answer: Any) -> str | None:
        first = answer["data"][0]
        return first.get("root") or first.get("id")

    # -- LoRA (runtime loading: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora) ----------
    lora_answers_json = False  # "Success: LoRA adapter 'x' added successfully."

    def lora_load_call(self, name: str, folder: str) -> tuple[str, str, Any]:
        return "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}

    def lora_unload_call(self, name: str) -> tuple[str, str, Any]:
        return "POST", "/v1/unload_lora_adapter", {"lora_name": name}

    def lora_info_call(self) -> tuple[str, str, dict[str, Any] | None]:
        return "GET", "/server_info", {"config_format": "json"}

    def parse_lora_limits(self, answer: Any) -> LoraLimits:
        config = answer["vllm_config"]
        model = (config.get("model_config") or {}).get("model")
        if "lora_config" not in config:
            return LoraLimits(base_model=model)
        lora = config["lora_config"]
        if not isinstance(lora, dict):
            return LoraLimits(enabled=False, base_model=model)
        rank = lora.get("max_lora_rank")
        return LoraLimits(enabled=True, max_rank=int(rank) if rank is not None else None, base_model=model)

    def with_adapter(self, payload: dict[str, Any], name: str) -> dict[str, Any]:
        return {**payload, "model": name}  # a loaded adapter is a model name of its own

    def lora_enable_fix(self, rank: int) -> str:
        return (f"restart it with --enable-lora --max-lora-rank {max(rank, 8)} --max-loras 2 and the environment "
                "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")

    def explain_lora_error(self, message: str, name: str) -> str:
        if "HTTP 404" in message and "load_lora_adapter" in message and "Not Found" in message:
            return (f"{message} (vLLM serves /v1/load_lora_adapter only when started with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and --enable-lora)")
        if "already been loaded" in message:
            return (f"{message} (that name is in use on the server: another run or another client of it? "
                    f"pick another lora_name than {name!r}, or unload it)")
        return message

    def lora_not_loaded(self, message: str) -> bool:
        return "HTTP 404" in message and "cannot be found" in message


class VLLMBackend(RemoteBackend):
    """Several vLLM servers behind one backend.

    Args:
        model: the served model name; ``None`` = the first id of ``GET /v1/models``.
        check_logprobs_mode: at start-up, require every healthy server to report
            ``--logprobs-mode processed_logprobs`` (see the module docstring).
        check_seeded_sampling: at start-up, refuse a healthy server on CPU that runs with
            chunked prefill (:class:`SeededSamplingError`; the module docstring, "Seeds").
        Others: see :class:`~engine.backends.remote.RemoteBackend` (the wire protocol is
            :class:`VLLMWire`).
    """

    kind = "vllm"
    wire: VLLMWire

    def __init__(self, servers: Sequence[str] | str, *, model: str | None = None, check_logprobs_mode: bool = True,
                 check_seeded_sampling: bool = True, **kwargs: Any) -> None:
        super().__init__(servers, wire=VLLMWire(model), **kwargs)
        self.check_logprobs_mode = check_logprobs_mode
        self.check_seeded_sampling = check_seeded_sampling
        self._priority_scheduling: bool | None = None
        self._running_limit: int | None = None

    @property
    def priority_scheduling(self) -> bool | None:
        """Whether every healthy server said at start-up that it schedules by priority
        (``--scheduling-policy priority``); None: not read (no start-up check ran).  When
        False, request priorities are not sent (the module docstring)."""
        return self._priority_scheduling

    def running_sequence_limit(self) -> int | None:
        """The sum over the servers of ``scheduler_config.max_num_seqs`` (lowered to
        ``max_num_active_seqs`` where that is set), read at start-up from ``/server_info``;
        None: not read (no start-up check ran), or a server's is unknown (not healthy at
        start-up, not readable, or data-parallel: ``max_num_seqs`` counts per rank)."""
        return self._running_limit

    @property
    def model(self) -> str | None:
        """The served model name sent in every request (``None`` until discovered)."""
        return self.wire.model

    @model.setter
    def model(self, name: str | None) -> None:
        self.wire.model = name

    async def after_startup(self) -> None:
        """Name the model, then check each healthy server's configuration (``GET
        /server_info?config_format=json``, dev mode), and read its scheduling policy
        (``scheduler_config.policy``: :attr:`priority_scheduling`) and running-sequence limit
        (:meth:`running_sequence_limit`).

        Raises:
            LogprobsModeError: ``check_logprobs_mode`` and a server that runs another
                mode, or whose mode cannot be read.
            SeededSamplingError: ``check_seeded_sampling`` and a server on CPU with
                chunked prefill on (a server whose configuration cannot be read is trusted
                here).
        """
        if self.model is None:
            await self.prepare(self.pool.healthy[0])
        if not (self.check_logprobs_mode or self.check_seeded_sampling):
            return
        policies: list[Any] = []
        limits: list[int | None] = []
        for server in self.pool.healthy:
            url = server.url
            try:
                info = await self.call(url, "GET", "/server_info", params={"config_format": "json"},
                                       timeout_s=self.timeouts.health_timeout_s)
                config = info["vllm_config"]
                mode = config["model_config"]["logprobs_mode"] if self.check_logprobs_mode else None
            except (RemoteCallError, TypeError, KeyError) as exc:
                if not self.check_logprobs_mode:
                    policies.append(None)  # unknown: priorities stay on
                    limits.append(None)
                    continue
                raise LogprobsModeError(url, f"vllm backend: cannot read the logprobs mode of {url} from /server_info "
                                             f"({exc}); this package reports processed logprobs") from None
            if self.check_logprobs_mode and mode != PROCESSED_LOGPROBS_MODE:
                raise LogprobsModeError(url, f"vllm backend: {url} runs --logprobs-mode {mode}, but this package reports "
                                             "processed logprobs (after temperature, top-k, top-p)")
            if self.check_seeded_sampling:
                _check_seeded_sampling(url, config)
            scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
            policies.append(scheduler.get("policy") if isinstance(scheduler, dict) else None)
            limits.append(_running_limit(config))
        if len(limits) == len(self.pool.servers) and None not in limits:
            self._running_limit = sum(limit for limit in limits if limit is not None)
        if policies and None not in policies:
            self._priority_scheduling = self.wire.send_priority = all(p == "priority" for p in policies)
            if not self._priority_scheduling:
                logger.info("vllm backend: a server schedules %s, not by priority: request priorities are not "
                            "sent (start the servers with --scheduling-policy priority to use them)",
                            sorted({str(p) for p in policies if p != "priority"}))

    async def pause(self, mode: str = "abort") -> None:
        with _dev_mode_hint():
            await super().pause(mode)

    async def resume(self) -> None:
        with _dev_mode_hint():
            await super().resume()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """See :meth:`RemoteBackend.update_weights` and the module docstring.

        Raises:
            BackendError: as there; also when a healthy server runs on CPU without
                :data:`WORKER_EXTENSION` (vLLM 0.32 would keep its tied LM head's old
                weights), before any server loads anything.
        """
        if self.serves_adapter(source):
            await super().update_weights(source, version=version, mode=mode)
            return
        folder = checkpoint_folder(self.kind, source, mode)
        with _dev_mode_hint():
            extension = await self._reload_with_extension()
            await self.apply_weight_update(self.wire.weight_update_calls(folder, version, extension=extension),
                                           what=folder)

    async def _reload_with_extension(self) -> bool:
        """Whether every healthy server runs :data:`WORKER_EXTENSION` (read from
        ``/server_info``); raise :class:`BackendError` when one does not and some server
        of the pool runs on CPU."""
        missing, cpu = [], []
        for server in self.pool.healthy:
            info = await self.call(server.url, "GET", "/server_info", params={"config_format": "json"},
                                   timeout_s=self.timeouts.health_timeout_s)
            config = info.get("vllm_config", {}) if isinstance(info, dict) else {}
            if (config.get("parallel_config") or {}).get("worker_extension_cls") != WORKER_EXTENSION:
                missing.append(server.url)
            if (config.get("device_config") or {}).get("device") == "cpu":
                cpu.append(server.url)
        if missing and cpu:
            raise BackendError(
                f"vllm backend: update_weights refused: {', '.join(missing)} run(s) without the worker extension "
                f"{WORKER_EXTENSION}, and {', '.join(cpu)} run(s) on CPU, where vLLM 0.32's reload_weights keeps "
                "the start-up weights of a tied LM head (its prepacked CPU GEMM buffer is not rebuilt), so tokens "
                "would come from neither the old nor the new weights; start every server with "
                f"PYTHONPATH={vllm_worker_dir()} and --worker-extension-cls {WORKER_EXTENSION}")
        return not missing


    async def prepare(self, server: Server) -> None:
        if self.model is not None:
            return
        answer = await self.call(server.url, "GET", "/v1/models", timeout_s=self.timeouts.health_timeout_s)
        try:
            self.model = str(answer["data"][0]["id"])
        except (TypeError, KeyError, IndexError):
            raise BackendError(f"{server.url}/v1/models: no model id in {answer!r}") from None

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """See :meth:`RemoteBackend.generate`.

        Raises:
            InvalidRequestError: the request carries ``image_data`` (see the module docstring).
        """
        if request.image_data is not None:
            raise InvalidRequestError(
                f"request {request.rid}: image_data is not supported by the vllm backend: /v1/completions takes "
                "token ids and no images (vLLM takes images only on /v1/chat/completions, which re-renders the "
                "prompt, so it would not be token-exact); use the sglang or hf backend for image requests")
        return await super().generate(request, budget)


def _running_limit(config: Any) -> int | None:
    """One server's running-sequence limit from its ``/server_info`` ``vllm_config``
    (``scheduler_config.max_num_seqs``, or ``max_num_active_seqs`` when lower); None:
    absent, not a positive int, or data-parallel (``parallel_config.data_parallel_size``
    > 1: the limit is per rank, and whether this server routes to the others is not said)."""
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    parallel = config.get("parallel_config") if isinstance(config, dict) else None
    if not isinstance(scheduler, dict) or (isinstance(parallel, dict) and parallel.get("data_parallel_size", 1) != 1):
        return None
    seqs, active = scheduler.get("max_num_seqs"), scheduler.get("max_num_active_seqs")
    if not _positive_int(seqs):
        return None
    return min(seqs, active) if _positive_int(active) else seqs


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_seeded_sampling(url: str, config: Any) -> None:
    """Raise :class:`SeededSamplingError` when the ``vllm_config`` of ``url`` says CPU and
    chunked prefill (on unless it says ``false``: vLLM's default)."""
    def section(name: str) -> dict[str, Any]:
        value = config.get(name) if isinstance(config, dict) else None
        return value if isinstance(value, dict) else {}

    if section("device_config").get("device") != "cpu":
        return
    scheduler = section("scheduler_config")
    if scheduler.get("enable_chunked_prefill") is False:
        return
    budget = scheduler.get("max_num_batched_tokens")
    raise SeededSamplingError(url, (
        f"vllm backend: {url} is a vLLM server on CPU with chunked prefill on, where a seeded request crashes the "
        "server (vLLM 0.32 rewinds a request's CUDA-only random generator when it splits the request's prompt "
        "across steps: RuntimeError: CPU Generator does not use offset), which happens as soon as the prompts "
        f"in flight exceed max_num_batched_tokens ({budget if budget is not None else 'its per-step budget'})"))


@contextmanager
def _dev_mode_hint() -> Iterator[None]:
    """A 404 from a control route means the server runs without dev mode: say so."""
    try:
        yield
    except BackendError as exc:
        if "HTTP 404" in str(exc):
            raise BackendError(f"{exc} (vLLM serves /pause, /resume, /collective_rpc and /update_weight_version "
                               "only with VLLM_SERVER_DEV_MODE=1)") from exc
        raise
