"""The live view of a run: a rich panel on a terminal, plain progress lines elsewhere.

Both show a :class:`~engine.cli._monitor.RunSnapshot`:

* episodes: ended of total, in flight, waiting (queued), accepted, rejected and
  failed with their reasons, results not yet taken;
* throughput: generated tokens and tokens/s (last 10 s);
* stragglers: the longest-running episodes in flight, with their running time,
  generated tokens and requests; and the slowest episodes that ended;
* staleness: the policy version, admission capacity, how far generation runs
  ahead of consumption (versions) against its bound ``eta``, and the staleness
  of consumed trajectories;
* the reward pool: busy (or starting) workers of the maximum, calls, timeouts,
  workers killed or dead, fallbacks.

Without a consumer (``rollout run`` without ``--consumer-batch-size``: the version
never moves) "generation ahead" means nothing and is left out.

:func:`render` builds the rich renderable (a test prints it on a recording
``Console``); :func:`plain_line` the one-line form; :func:`run_view` refreshes
either until cancelled, then shows the final state once.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import trio

from ._monitor import RunMonitor, RunSnapshot

__all__ = ["plain_line", "render", "run_view"]


def _reasons(by_reason: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(by_reason.items()))


def _ahead(s: RunSnapshot) -> str:
    bound = "unbounded" if s.eta is None else f"max {s.eta}"
    return f"{s.ahead_versions:.1f} versions ({bound})"


def _workers(s: RunSnapshot) -> str:
    """``"1/2 busy"``, ``"1/2 busy, 1 starting"``, or ``"2/2 starting"`` while none is busy yet."""
    if s.reward_workers_starting and not s.reward_workers_busy:
        return f"{s.reward_workers_starting}/{s.reward_max_workers} starting"
    starting = f", {s.reward_workers_starting} starting" if s.reward_workers_starting else ""
    return f"{s.reward_workers_busy}/{s.reward_max_workers} busy{starting}"


def render(s: RunSnapshot) -> Any:
    """The rich renderable of ``s`` (a panel of small tables)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_row(Text(f"ended {s.ended}/{s.total}", style="bold"),
                 ProgressBar(total=max(s.total, 1), completed=s.ended, width=30),
                 f"in flight {s.running}", f"waiting {s.queued}", f"{s.tokens_per_s:,.0f} tok/s",
                 f"{s.generated_tokens:,} tokens", f"{s.elapsed_s:,.1f} s")

    ends = Table(title="episodes", title_justify="left", show_edge=False, box=None, padding=(0, 2))
    ends.add_column("status")
    ends.add_column("count", justify="right")
    ends.add_column("reasons")
    ends.add_row(Text("accepted", style="green"), str(s.accepted), f"{s.results_waiting} results not yet taken")
    ends.add_row(Text("rejected", style="yellow"), str(s.rejected), _reasons(s.rejected_by_reason))
    ends.add_row(Text("failed", style="red"), str(s.failed), _reasons(s.failed_by_reason))

    gauges = Table(title="staleness and rewards", title_justify="left", show_edge=False, box=None,
                   padding=(0, 2), show_header=False)
    gauges.add_column()
    gauges.add_column()
    gauges.add_row("policy version", f"{s.version}  (consumer batch {s.consumer_batch_size})" if s.consumer
                   else f"{s.version}  (no consumer batches)")
    gauges.add_row("admission capacity", str(s.capacity))
    if s.shards is not None:
        gauges.add_row("engine shards", f"{s.shards_alive}/{s.shards} alive")
    if s.consumer:
        gauges.add_row("generation ahead", _ahead(s))
    gauges.add_row("consumed staleness", f"mean {s.consumed_staleness_mean:.2f}, max {s.consumed_staleness_max} "
                                         f"over {s.consumed} trajectories")
    gauges.add_row("reward workers", f"{_workers(s)}, {s.reward_calls} calls")
    gauges.add_row("reward trouble", f"{s.reward_timeouts} timeouts, {s.reward_workers_killed} killed, "
                                     f"{s.reward_worker_deaths} died, {s.reward_fallbacks} fallbacks, "
                                     f"{s.reward_errors} errors")

    slow = Table(title="stragglers: longest running", title_justify="left", show_edge=False, box=None,
                 padding=(0, 2))
    for name in ("episode", "running s", "tokens", "requests done/in flight"):
        slow.add_column(name, justify="right")
    for e in s.stragglers:
        slow.add_row(str(e.task_id), f"{e.seconds:.1f}", str(e.tokens), f"{e.requests}/{e.requests_in_flight}")
    if not s.stragglers:
        slow.add_row("-", "", "", "")
    done = ", ".join(f"#{e.task_id} {e.seconds:.1f} s {e.tokens} tok" for e in s.slowest_ended) or "-"
    return Panel(Group(head, Text(""), ends, Text(""), gauges, Text(""), slow, Text(f"slowest ended: {done}")),
                 title="rollout", title_align="left")


def plain_line(s: RunSnapshot) -> str:
    """``s`` on one line (the progress line written when stderr is not a terminal)."""
    reasons = _reasons({**s.rejected_by_reason, **s.failed_by_reason})
    longest = (f" | longest #{s.stragglers[0].task_id} {s.stragglers[0].seconds:.1f} s "
               f"{s.stragglers[0].tokens} tok" if s.stragglers else "")
    ahead = f" ahead {s.ahead_versions:.1f}" if s.consumer else ""
    shards = f" | shards {s.shards_alive}/{s.shards} alive" if s.shards is not None else ""
    return (f"rollout progress: {s.elapsed_s:.0f} s | ended {s.ended}/{s.total} (ok {s.accepted}, rej {s.rejected}, "
            f"fail {s.failed}{': ' + reasons if reasons else ''}) | in flight {s.running}, waiting {s.queued}{shards} | "
            f"{s.tokens_per_s:.0f} tok/s | v{s.version} cap {s.capacity}{ahead} | "
            f"reward workers {_workers(s)}, {s.reward_timeouts} timeouts, {s.reward_workers_killed} killed{longest}")


async def run_view(monitor: RunMonitor, mode: str, *, interval_s: float = 5.0, stream: TextIO | None = None,
                   console: Any = None, refresh_s: float = 0.5) -> None:
    """Show ``monitor`` until cancelled, then its final state once (shielded).

    Args:
        mode: ``"rich"`` (a rich ``Live`` panel refreshed every ``refresh_s``
            seconds on ``console``, default stderr), ``"plain"`` (a
            :func:`plain_line` every ``interval_s`` seconds on ``stream``, default
            stderr) or ``"off"``.
    """
    if mode == "off":
        await trio.sleep_forever()
    if mode == "plain":
        stream = stream or sys.stderr
        try:
            while True:
                await trio.sleep(interval_s)
                print(plain_line(monitor.snapshot()), file=stream, flush=True)
        finally:
            print(plain_line(monitor.snapshot()), file=stream, flush=True)
    from rich.console import Console
    from rich.live import Live

    console = console or Console(stderr=True)
    with Live(render(monitor.snapshot()), console=console, auto_refresh=False, transient=False) as live:
        try:
            while True:
                await trio.sleep(refresh_s)
                live.update(render(monitor.snapshot()), refresh=True)
        finally:
            live.update(render(monitor.snapshot()), refresh=True)


def view_mode(*, quiet: bool, stream: TextIO | None = None) -> str:
    """``"off"`` when quiet, ``"rich"`` on a terminal, else ``"plain"``."""
    if quiet:
        return "off"
    stream = stream or sys.stderr
    return "rich" if getattr(stream, "isatty", lambda: False)() else "plain"
