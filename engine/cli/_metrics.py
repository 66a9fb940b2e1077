"""A run's metrics: a Prometheus text endpoint, and :func:`observe_run`, which opens
everything that watches a ``rollout run`` (monitor, live view, recorder, endpoint).

The endpoint (``prometheus-client``'s own HTTP server, on a registry of its own,
so nothing process-wide changes) serves the numbers of
:class:`~engine.cli._monitor.RunSnapshot` under the ``rollout_`` prefix; each scrape
takes a fresh snapshot on the trio thread (``trio.from_thread``), or the last one
once the run has ended.  Counters end in ``_total``:

==========================================  =====================================================
``rollout_episodes_submitted_total``        episodes submitted
``rollout_episodes_ended_total{status,reason}``  ended episodes by status (accepted/rejected/failed)
``rollout_episodes_in_flight``              episodes running
``rollout_episodes_waiting``                episodes queued (not admitted yet)
``rollout_results_waiting``                 ended episodes not yet taken by the consumer
``rollout_generated_tokens_total``          generated tokens
``rollout_tokens_per_second``               generated tokens per second, last 10 s
``rollout_policy_version``                  current policy version
``rollout_admission_capacity``              episodes that may start now
``rollout_generation_ahead_versions``       how far generation runs ahead of consumption (absent without a consumer)
``rollout_max_head_offpolicyness``          the bound on that (absent when unbounded)
``rollout_consumed_staleness_mean``/``_max``  staleness of consumed trajectories (versions)
``rollout_longest_running_episode_seconds`` running time of the oldest episode in flight
``rollout_reward_workers_busy``/``_max``    reward worker processes busy / at most
``rollout_reward_workers_starting``         reward worker processes being started
``rollout_reward_calls_total``, ``..._timeouts_total``, ``..._workers_killed_total``,
``..._worker_deaths_total``, ``..._fallbacks_total``, ``..._errors_total``  the reward pool's counters
==========================================  =====================================================
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from ._monitor import RunMonitor, RunSnapshot

__all__ = ["observe_run", "open_metrics_server", "snapshot_metrics"]

logger = logging.getLogger(f"rollout.{__name__}")


def snapshot_metrics(s: RunSnapshot) -> list[Any]:
    """The metric families of ``s`` (``prometheus_client.core`` objects)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, doc: str, value: float) -> Any:
        return GaugeMetricFamily(f"rollout_{name}", doc, value=value)

    def counter(name: str, doc: str, value: float) -> Any:
        return CounterMetricFamily(f"rollout_{name}", doc, value=value)

    ended = CounterMetricFamily("rollout_episodes_ended", "Ended episodes by status and reason",
                                labels=["status", "reason"])
    ended.add_metric(["accepted", ""], s.accepted)
    for status, by in (("rejected", s.rejected_by_reason), ("failed", s.failed_by_reason)):
        for reason, n in sorted(by.items()):
            ended.add_metric([status, reason], n)
    out = [
        counter("episodes_submitted", "Episodes submitted", s.submitted),
        ended,
        gauge("episodes_in_flight", "Episodes running", s.running),
        gauge("episodes_waiting", "Episodes queued, not admitted yet", s.queued),
        gauge("results_waiting", "Ended episodes not yet taken", s.results_waiting),
        counter("generated_tokens", "Generated tokens", s.generated_tokens),
        gauge("tokens_per_second", "Generated tokens per second over the last 10 s", s.tokens_per_s),
        gauge("policy_version", "Current policy version", s.version),
        gauge("admission_capacity", "Episodes that may start now", s.capacity),
        gauge("consumed_staleness_mean", "Mean staleness of consumed trajectories (versions)",
              s.consumed_staleness_mean),
        gauge("consumed_staleness_max", "Largest staleness of a consumed trajectory (versions)",
              s.consumed_staleness_max),
        gauge("longest_running_episode_seconds", "Running time of the oldest episode in flight",
              s.stragglers[0].seconds if s.stragglers else 0.0),
        gauge("reward_workers_busy", "Reward worker processes busy", s.reward_workers_busy),
        gauge("reward_workers_max", "Reward worker processes at most", s.reward_max_workers),
        gauge("reward_workers_starting", "Reward worker processes being started", s.reward_workers_starting),
        counter("reward_calls", "Reward calls", s.reward_calls),
        counter("reward_timeouts", "Reward attempts that timed out", s.reward_timeouts),
        counter("reward_workers_killed", "Reward workers killed (timeout or cancel)", s.reward_workers_killed),
        counter("reward_worker_deaths", "Reward workers that died", s.reward_worker_deaths),
        counter("reward_fallbacks", "Reward calls that ended with the fallback value", s.reward_fallbacks),
        counter("reward_errors", "Reward calls that raised", s.reward_errors),
    ]
    if s.consumer:
        out.append(gauge("generation_ahead_versions", "How far generation runs ahead of consumption, in versions",
                         s.ahead_versions))
    if s.eta is not None:
        out.append(gauge("max_head_offpolicyness", "Bound on generation ahead (eta)", s.eta))
    return out


class _Collector:
    """A prometheus collector reading the monitor from the HTTP server's thread."""

    def __init__(self, monitor: RunMonitor, token: trio.lowlevel.TrioToken) -> None:
        self._monitor = monitor
        self._token = token

    def collect(self) -> Any:
        snap: RunSnapshot | None
        try:
            snap = trio.from_thread.run_sync(self._monitor.snapshot, trio_token=self._token)
        except (trio.RunFinishedError, RuntimeError):  # the run has ended: its last numbers
            snap = self._monitor.last
        return snapshot_metrics(snap) if snap is not None else []


@asynccontextmanager
async def open_metrics_server(monitor: RunMonitor, port: int, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """Serve ``monitor``'s metrics at ``http://host:port/metrics`` in this scope;
    yields the bound port (``port=0``: a free one).

    Raises:
        OSError: the address cannot be bound (in use, not allowed).
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(monitor, trio.lowlevel.current_trio_token()))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: cannot serve metrics on {host}:{port} ({exc.strerror or exc})") \
            from None
    bound = server.server_port
    logger.info("metrics at http://%s:%d/metrics", host, bound)
    try:
        yield bound
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)  # (a scrape waiting for this thread can finish)
            server.server_close()
            thread.join(timeout=5)


@asynccontextmanager
async def observe_run(engine: Any, *, total: int, out: Path | None, append: bool = False, view: str = "off",
                      interval_s: float = 5.0, consumer: bool = True,
                      metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                      console: Any = None, stream: Any = None) -> AsyncIterator[RunMonitor]:
    """Watch a run in this scope: a :class:`RunMonitor` (yielded; wrap the workflow
    with ``monitor.track`` and feed ``monitor.on_results``), its recorder writing
    ``metrics.jsonl``/``episodes.jsonl`` into ``out`` (appended to with ``append``,
    as a resumed run does), the live view (``view``:
    ``"rich"``, ``"plain"`` or ``"off"``, :func:`engine.cli._live.run_view`) and, with
    ``metrics_port``, the Prometheus endpoint.  ``consumer``: a consumer takes batches
    and bumps the version (False: the views leave "generation ahead" out).  Leaving
    the scope writes the last sample and shows the final state."""
    from ._live import run_view

    monitor = RunMonitor(engine, total=total, consumer=consumer)
    async with trio.open_nursery() as nursery:
        if out is not None:
            await nursery.start(lambda task_status: monitor.run_recorder(out, append=append, task_status=task_status))
        nursery.start_soon(lambda: run_view(monitor, view, interval_s=interval_s, console=console, stream=stream))
        if metrics_port is None:
            yield monitor
        else:
            async with open_metrics_server(monitor, metrics_port, metrics_host) as bound:
                monitor.metrics_url = f"http://{metrics_host}:{bound}/metrics"
                yield monitor
        nursery.cancel_scope.cancel()
