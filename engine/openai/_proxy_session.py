"""The proxy's records: :class:`ProxyConfig` (settings), :class:`ProxySession` (one agent
session) and :class:`ProxyStatistics`; shared by :mod:`engine.openai.proxy` (sessions) and
:mod:`engine.openai._proxy_http` (routes)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters
from .cache import InteractionCache
from .interaction import EXPORT_STYLES

__all__ = ["ProxyConfig", "ProxySession", "ProxyStatistics"]


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Proxy settings (units in the names); validated on construction.

    Attributes:
        host, port: where to listen (port 0: any free port).  Only a loopback
            host is accepted: the proxy has no TLS and its keys are bearer tokens.
        model: the model name ``/v1/models`` lists and completions carry.
        gconfig: base sampling parameters of every session's client.
        tool_parser, chat_template_kwargs: as :class:`~engine.openai.EngineOpenAI`.
        session_idle_timeout_s: a session with no request in flight and none for
            this long is abandoned.
        admission_timeout_s: how long ``start_session`` waits for the engine to
            admit the episode before answering 503 (``None``: as long as the
            client waits).
        admin_api_key: when set, ``start_session`` needs it as bearer key (left out of ``repr``).
        export_style, turn_discount, drop_retry_orphans: ``end_session``'s
            defaults (``turn_discount`` 1.0 leaves rewards as set).
        graceful_timeout_s: on close, how long requests in flight may finish.
        backlog: the listening socket's queue of connections not yet accepted
            (hundreds of agents connect at once).
        keep_alive_timeout_s: how long an idle connection stays open (hypercorn's
            5 s default races agents that think between calls: a request sent as
            the server closes the connection fails with "server disconnected").
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "default"
    gconfig: GenerationHyperparameters | None = None
    tool_parser: Any = "hermes"
    chat_template_kwargs: Mapping[str, Any] | None = None
    session_idle_timeout_s: float = 300.0
    admission_timeout_s: float | None = None
    admin_api_key: str | None = field(default=None, repr=False)  # a secret: never printed
    export_style: str = "individual"
    turn_discount: float = 1.0
    drop_retry_orphans: bool = False
    graceful_timeout_s: float = 1.0
    backlog: int = 4096
    keep_alive_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host must be a loopback address (127.0.0.1, localhost, ::1), got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("session_idle_timeout_s", "graceful_timeout_s", "keep_alive_timeout_s"):
            _positive(name, getattr(self, name))
        if self.admission_timeout_s is not None:
            _positive("admission_timeout_s", self.admission_timeout_s)
        if isinstance(self.backlog, bool) or not isinstance(self.backlog, int) or self.backlog < 1:
            raise ValueError(f"backlog must be an int >= 1, got {self.backlog!r}")
        if self.export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style must be one of {EXPORT_STYLES}, got {self.export_style!r}")
        _discount(self.turn_discount)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _discount(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidRequestError(f"discount must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ProxyStatistics:
    """Counters of the proxy; ``started == active + ended + abandoned + starting``."""

    starting: int
    active: int
    ended: int
    abandoned: int
    started: int
    requests: int
    request_errors: int
    requests_in_flight: int


@dataclass(eq=False)
class ProxySession:
    """One agent session: an episode of the engine and its interaction cache.

    Attributes:
        session_id: the session's name (in answers and log lines; not a credential).
        api_key: the session's credential: every request about the session sends it
            as bearer key (left out of ``repr``).
        task_id: the engine task id of its episode.
        data: the episode's dataset item.
        cache: its :class:`InteractionCache`.
        client: the :class:`~engine.openai.EngineOpenAI` that serves its requests.
        state: ``"starting"``, ``"active"``, ``"ending"``, ``"ended"`` or ``"abandoned"``.
        abandon_reason: why it was abandoned, if it was.
        exported: interactions handed to the engine at its end.
        attached: made by :meth:`~engine.openai.OpenAIProxy.attach_session` (a
            workflow's session: no episode of its own, no ``end_session``).
    """

    session_id: str
    api_key: str = field(repr=False)  # the session's one credential: never printed
    data: Any
    cache: InteractionCache = field(default_factory=InteractionCache)
    client: Any = None
    task_id: int = -1
    state: str = "starting"
    abandon_reason: str | None = None
    exported: int | None = None
    end_params: dict[str, Any] | None = None
    active_requests: int = 0
    last_activity: float = 0.0
    drift_details: list[str] = field(default_factory=list)
    attached: bool = False  # made by attach_session: a workflow's, not an episode of its own
    request_scopes: set[trio.CancelScope] = field(default_factory=set)  # its requests in flight
    admitted: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    _wake: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)

    def touch(self) -> None:
        self.last_activity = trio.current_time()
        self._wake.unpark_all()
