"""The remote backends (``sglang``, ``vllm``): a pool of inference servers over HTTP.

::

    backend = make_remote_backend("sglang", ["http://10.0.0.1:30000", "http://10.0.0.2:30000"],
                                  request_timeout_s=900, max_attempts=5)
    async with open_rollout_engine(backend) as engine:
        ...
        await engine.update_weights("/ckpt/step3", version=3)  # pause, load on every server, resume

One call of :meth:`RemoteBackend.generate` serves one segment the engine sends:

1. wait while the client-side pause is on (:meth:`~RemoteBackend.pause_generation` ..
   :meth:`~RemoteBackend.continue_generation`), so nothing is sent to a paused server;
2. pick a server (:class:`ServerPool`): the sticky one of the request's routing key
   (``request.metadata["routing_key"]``, else ``request.rid``; later segments and turns reuse
   its prefix cache) when it is healthy and has not failed this request, otherwise the healthy
   server with the fewest outstanding tokens (``prompt_len + budget`` summed over its requests
   in flight); wait for a re-admission when every server is ejected, at most
   ``no_server_timeout_s`` from the moment the last healthy server was lost: then the waiting
   requests, and every new one until a server is re-admitted, fail with
   :class:`~engine.errors.BackendUnavailableError` (reason ``"backend_unavailable"``);
3. POST once, non-streaming, under a unique wire id ``<rid>@<seq>`` (an sglang-router URL is
   one server; see :mod:`engine.backends.remote.sglang` for what it forwards);
4. on a transient failure (refused or lost connection, HTTP 408/429/5xx, malformed JSON,
   ``attempt_timeout_s`` (default 1800 s: a server that accepts and never answers), the
   server ejected under it) try again: at once on a healthy server
   this request has not tried yet (failover), otherwise after a capped exponential backoff
   with jitter (:class:`RetryPolicy`); ``max_attempts`` attempts in all;
5. HTTP 401/403 (access denied: our credentials) is permanent and server-level: the server is
   ejected for good and the request fails over at once; when every server refuses, requests
   fail at once, and start-up (:meth:`~RemoteBackend.wait_ready`) fails at once;
6. anything else (another 4xx, a body of the wrong shape) fails the request with a
   :class:`RemoteCallError` (a :class:`~engine.errors.BackendError`) naming request, server
   and cause.  The whole call, waits and backoff included, is bounded by
   ``request_timeout_s``; a request whose last attempt timed out, or past that deadline,
   fails with a :class:`~engine.errors.BackendTimeoutError` (reason ``"backend_timeout"``).

Failover and resumption (documented choice).  A non-streaming call returns nothing when its
server dies, so a failed attempt is re-sent whole to another server.  Its ``input_ids``
already hold every token of earlier segments, so those are never regenerated: the engine's
interruptible loop (``RolloutEngine.agenerate``) owns resumption.  A server that answers
``abort`` *with* partial tokens (pause, abort, drain) hands them to the engine as stop reason
``"abort"``; the engine re-sends prompt + partial output with a lowered budget, and that
segment is routed like any other (back to the same server unless it was ejected).  An
``abort`` with *no* token is retried here (after the pause, if we paused), never returned, so
the engine loop cannot spin on it.  Evidence (logprob counts, NaN, -9999) is checked by the
engine's ``validate_response``.

API keys.  For servers started with ``--api-key`` (vLLM, SGLang, ``rollout serve``),
``api_key=`` sends ``Authorization: Bearer <key>`` on every call; :class:`ApiKey` keeps it out
of reprs and messages.  vLLM guards only ``/v1/...`` and SGLang everything but ``/health``, so
start-up also asks every healthy server for its model (a guarded route): a missing or wrong
key fails :meth:`~RemoteBackend.wait_ready` at once (``backend.pool.all_denied``), before any
request.

Health.  Every ``health_interval_s`` each server's health route is probed.  A server is
ejected after ``eject_after_failures`` consecutive failed probes or attempts, and at once when
it refuses a connection; an ejection by probes (the server stopped answering: presumed hung)
cancels its attempts in flight, which fail over (on a dead server they fail on their own).  A
successful probe re-admits it (after replaying a weight update it missed, see
:meth:`RemoteBackend.update_weights`).  While no server is healthy a warning names each
server and its last error, at once and then at least every 30 s.

Weight updates (:class:`~engine.backends.base.WeightSync`).  :meth:`RemoteBackend.pause`
pauses client-side (nothing is sent while paused) and on every healthy server (mode
``"abort"``: in-flight requests come back ``abort`` with their partial tokens, which the
engine re-sends after the update); :meth:`RemoteBackend.update_weights` sends the wire
protocol's update calls (``WireProtocol.weight_update_calls``) to every healthy
server, in order; a server that fails a step (or is ejected at the time) is ejected and
marked stale, and the same calls are replayed to it before it is re-admitted, so no
server serves old weights under the new version; :meth:`RemoteBackend.resume` continues
every server, then the client.  Only mode ``"abort"``: after an in-place swap a server
does not report at which token the weights changed, so tokens could not carry the right
version.

Cancellation.  When an attempt is cancelled (its episode cancelled, the deadline or the
attempt timeout passed) the server is told to abort the wire id, inside a shielded scope
bounded by ``abort_timeout_s``; the dropped connection also makes SGLang and vLLM stop.
Wire errors are classified in one place, :func:`map_exceptions`.

Versions.  Tokens carry ``self.version`` (the engine's, told by ``set_version``) read just
before their attempt is sent (AReaL PR #1569); the server's own ``weight_version`` (SGLang ``meta_info``) is recorded per server in
:meth:`statistics`, and a numeric one that disagrees is counted as ``weight_version_mismatches``.

Modules, one concept each: ``_config`` (:class:`RemoteTimeouts`, :class:`RetryPolicy`),
``_errors`` (:class:`RemoteCallError`, the transport and HTTP status mapping), ``_routing``
(:class:`ServerPool`: least outstanding tokens, stickiness, ejection), ``_health`` (start-up
and probes), ``_control`` (the pause gate, control calls, weight-update replay), ``_http``
(the pooled client), ``_wire`` (:class:`WireProtocol`: what a kind of server looks like on
the wire), ``_backend`` (:class:`RemoteBackend`: the request machine), ``_stats``
(:class:`RemoteStatistics`); the protocols :mod:`~engine.backends.remote.sglang` and
:mod:`~engine.backends.remote.vllm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

from ...errors import InvalidRequestError
from ._backend import RemoteBackend
from ._config import ApiKey, RemoteTimeouts, RetryPolicy
from ._errors import RemoteCallError, RemoteTimeoutError, map_exceptions
from ._routing import ServerPool, ServerStatistics
from ._startup import choose_tokenizer, open_remote_backend
from ._stats import RemoteStatistics
from ._wire import ParsedGeneration, WireCall, WireProtocol
from .sglang import SGLangBackend, SGLangWire
from .vllm import WORKER_EXTENSION, VLLMBackend, VLLMWire, vllm_abort_id, vllm_worker_dir

__all__ = [
    "ApiKey",
    "ParsedGeneration",
    "RemoteBackend",
    "RemoteCallError",
    "RemoteStatistics",
    "RemoteTimeoutError",
    "RemoteTimeouts",
    "RetryPolicy",
    "SGLangBackend",
    "SGLangWire",
    "ServerPool",
    "ServerStatistics",
    "VLLMBackend",
    "VLLMWire",
    "WORKER_EXTENSION",
    "WireCall",
    "WireProtocol",
    "choose_tokenizer",
    "make_remote_backend",
    "map_exceptions",
    "open_remote_backend",
    "vllm_abort_id",
    "vllm_worker_dir",
]

_KINDS: dict[str, type[RemoteBackend]] = {"sglang": SGLangBackend, "vllm": VLLMBackend}


def make_remote_backend(kind: str, servers: Sequence[str], **opts: Any) -> RemoteBackend:
    """Build the ``sglang`` or ``vllm`` backend for ``servers``.

    ``opts`` may mix constructor arguments (``max_concurrency``, ``api_key``, ``model`` for
    vLLM, ...)
    with any field of :class:`RemoteTimeouts` or :class:`RetryPolicy` given flat
    (``request_timeout_s=600, max_attempts=4``); ``None`` values are ignored.

    Raises:
        InvalidRequestError: unknown kind, no server, or an invalid option value.
    """
    if kind not in _KINDS:
        raise InvalidRequestError(f"remote backend kind must be one of {sorted(_KINDS)}, got {kind!r}")
    opts = {k: v for k, v in opts.items() if v is not None}
    timeout_names = {f.name for f in fields(RemoteTimeouts)}
    retry_names = {f.name for f in fields(RetryPolicy)}
    t_opts = {k: opts.pop(k) for k in list(opts) if k in timeout_names}
    r_opts = {k: opts.pop(k) for k in list(opts) if k in retry_names}
    if t_opts:
        base = opts.pop("timeouts", None) or RemoteTimeouts()
        opts["timeouts"] = RemoteTimeouts(**{**asdict(base), **t_opts})
    if r_opts:
        base = opts.pop("retry", None) or RetryPolicy()
        opts["retry"] = RetryPolicy(**{**asdict(base), **r_opts})
    return _KINDS[kind](list(servers), **opts)
