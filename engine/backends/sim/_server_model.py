"""The simulated server's GPU model (:mod:`engine.backends.sim`) and its offline replay.

:class:`ServerModel` is a pure, synchronous discrete-event model of one GPU that
:class:`~engine.backends.sim.SimBackend` drives with trio's clock;
:func:`simulate_makespan` replays recorded requests (:class:`SimRequest`) through the
same model with a zero-overhead client (the benchmarks' ideal makespan) and
:func:`group_episodes` groups recorded requests into episodes.  No trio here.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ._config import SimConfig
from ._draws import ABORT, ERROR, OK

__all__ = ["ServerModel", "SimRequest", "group_episodes", "simulate_makespan"]

_EPS_STEPS = 1e-9  # decode-progress tolerance (in steps) for float round-off


@dataclass(frozen=True)
class SimRequest:
    """One original request as the sim served it (``SimBackend(record=True)``).

    Attributes:
        key: :func:`prompt_key` of the prompt (groups the requests of an episode).
        prompt_len: prompt tokens.
        out_len: tokens the request produces in all (across an abort + resume).
        multiplier: latency multiplier (``straggler_multiplier`` or 1).
        outcome: ``"ok"``, ``"error"`` (raised after prefill) or ``"abort"``
            (``out_len // 2`` tokens, then resumed for the rest).
    """

    key: int
    prompt_len: int
    out_len: int
    multiplier: float = 1.0
    outcome: str = OK

    def segments(self) -> list[tuple[int, float, float]]:
        """``(prompt_len, prefill_s_factor, decode_steps)`` per segment sent: the
        resumed segment re-prefills prompt + partial output."""
        m = self.multiplier
        if self.outcome == ERROR:
            return [(self.prompt_len, m, 0.0)]
        if self.outcome == ABORT:
            half = self.out_len // 2
            return [(self.prompt_len, m, half * m), (self.prompt_len + half, m, (self.out_len - half) * m)]
        return [(self.prompt_len, m, self.out_len * m)]



class _Seq:
    __slots__ = ("prefill_s", "steps", "on_done", "state", "end", "decode_start")

    def __init__(self, prefill_s: float, steps: float, on_done: Callable[[float, float], None]) -> None:
        self.prefill_s = prefill_s
        self.steps = steps
        self.on_done = on_done
        self.state = "waiting"  # -> prefill -> decode -> done | cancelled
        self.end = 0.0  # prefill end (seconds) or decode end (steps), by state
        self.decode_start = 0.0


class ServerModel:
    """Event-driven model of the GPU (see the module docstring); sync and exact.

    Times are seconds on the caller's clock.  ``submit`` a sequence (prefill
    seconds, decode steps, ``on_done(end_time, decode_start_time)``), call
    :meth:`advance` with the current time to fire every event up to it (in time
    order, each ``on_done`` with the exact event time), and sleep until
    :meth:`next_event_time`.  Callbacks may submit new sequences.
    """

    def __init__(self, *, per_token_s: float, max_running_seqs: int | None = None,
                 decode_slowdown_per_seq: float = 0.0) -> None:
        self.per_token_s = per_token_s
        self.slots = max_running_seqs if max_running_seqs is not None else math.inf
        self.slowdown = decode_slowdown_per_seq
        self.t = 0.0  # model time of the last update (seconds)
        self.g = 0.0  # decode steps taken by every sequence decoding since t = 0
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._prefill: list[tuple[float, int, _Seq]] = []  # (end time, tie, seq)
        self._decode: list[tuple[float, int, _Seq]] = []  # (end progress g, tie, seq)
        self._tie = 0
        self.decoding = 0  # R
        self.occupied = 0  # sequences holding a slot (prefill + decode)
        self.queued = 0
        self.peak_occupied = 0

    def step_s(self) -> float:
        """Seconds per decode step now."""
        return self.per_token_s * (1.0 + self.slowdown * max(self.decoding - 1, 0))

    def submit(self, now: float, prefill_s: float, steps: float, on_done: Callable[[float, float], None]) -> _Seq:
        if now > self.t:
            self.advance(now)
        seq = _Seq(prefill_s, steps, on_done)
        self._waiting.append(seq)
        self.queued += 1
        self._admit()
        return seq

    def cancel(self, now: float, seq: _Seq) -> None:
        """Withdraw ``seq`` (frees its slot at ``now``); no callback."""
        if now > self.t:
            self.advance(now)
        if seq.state == "waiting":
            self.queued -= 1
        elif seq.state == "prefill":
            self.occupied -= 1
        elif seq.state == "decode":
            self.decoding -= 1
            self.occupied -= 1
        else:
            return
        seq.state = "cancelled"  # left in its queue/heap, skipped when reached
        self._admit()

    def next_event_time(self) -> float:
        t = math.inf
        while self._prefill and self._prefill[0][2].state != "prefill":
            heapq.heappop(self._prefill)
        if self._prefill:
            t = self._prefill[0][0]
        while self._decode and self._decode[0][2].state != "decode":
            heapq.heappop(self._decode)
        if self._decode:
            t = min(t, self.t + max(self._decode[0][0] - self.g, 0.0) * self.step_s())
        return t

    def advance(self, now: float) -> None:
        """Fire every event at or before ``now``, then move the clock to ``now``."""
        while True:
            te = self.next_event_time()
            if te > now:
                break
            self._move_to(te)
            while self._prefill and self._prefill[0][0] <= self.t:
                _, _, seq = heapq.heappop(self._prefill)
                if seq.state == "prefill":
                    self._start_decode(seq)
            while self._decode and self._decode_due(self._decode[0][0]):
                _, _, seq = heapq.heappop(self._decode)
                if seq.state == "decode":
                    self.decoding -= 1
                    self._finish(seq)
            self._admit()
        self._move_to(now)

    def _decode_due(self, g_end: float) -> bool:
        """A decode ending at progress ``g_end`` is due now: reached within round-off,
        or so close that its end time rounds to the current time (at clock values of
        ~1e5 s, as trio's, a few picoseconds vanish in a float)."""
        return g_end <= self.g + _EPS_STEPS or self.t + (g_end - self.g) * self.step_s() <= self.t

    def _move_to(self, t: float) -> None:
        if t > self.t:
            if self.decoding and self.per_token_s > 0:
                self.g += (t - self.t) / self.step_s()
            self.t = t

    def _admit(self) -> None:
        while self._waiting and self.occupied < self.slots:
            seq = self._waiting.popleft()
            if seq.state != "waiting":
                continue
            self.queued -= 1
            self.occupied += 1
            self.peak_occupied = max(self.peak_occupied, self.occupied)
            if seq.prefill_s > 0:
                seq.state = "prefill"
                seq.end = self.t + seq.prefill_s
                self._tie += 1
                heapq.heappush(self._prefill, (seq.end, self._tie, seq))
            else:
                self._start_decode(seq)

    def _start_decode(self, seq: _Seq) -> None:
        seq.decode_start = self.t
        if seq.steps <= 0 or self.per_token_s == 0:
            self._finish(seq)
            return
        seq.state = "decode"
        self.decoding += 1
        seq.end = self.g + seq.steps
        self._tie += 1
        heapq.heappush(self._decode, (seq.end, self._tie, seq))

    def _finish(self, seq: _Seq) -> None:
        seq.state = "done"
        self.occupied -= 1
        seq.on_done(self.t, seq.decode_start)


def simulate_makespan(episodes: Iterable[Sequence[SimRequest]], concurrency: int, config: SimConfig) -> float:
    """Makespan (seconds) of a zero-overhead client over the same server model.

    Episodes start in order, at most ``concurrency`` at a time; an episode sends
    all its requests at once (an aborted one re-sends its rest the instant the
    first part returns) and frees its slot when the last one ends; the next
    episode starts that same instant.  Nothing else takes time (tokenisation,
    rewards, scheduling).  With ``K`` unbounded and no slowdown this is list
    scheduling of per-episode latencies on ``concurrency`` slots.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    slots = config.max_running_seqs
    if config.max_concurrency is not None:
        slots = config.max_concurrency if slots is None else min(slots, config.max_concurrency)
    model = ServerModel(per_token_s=config.per_token_s, max_running_seqs=slots,
                        decode_slowdown_per_seq=config.decode_slowdown_per_seq)
    pending = collections.deque(episodes)
    ended: collections.deque[tuple[list[tuple[int, float, float]], list[int], float]] = collections.deque()
    makespan = 0.0
    running = 0

    def send(segs: list[tuple[int, float, float]], left: list[int]) -> None:
        prompt_len, factor, steps = segs[0]
        model.submit(model.t, config.prefill_seconds(prompt_len) * factor, steps,
                     lambda end, _decode_start: ended.append((segs, left, end)))

    def start_episodes() -> None:
        nonlocal running
        while pending and running < concurrency:
            episode = pending.popleft()
            if not episode:  # nothing to generate: ends at once
                continue
            running += 1
            left = [len(episode)]
            for request in episode:
                send(request.segments(), left)

    start_episodes()
    while True:
        while ended:  # callbacks only queue; events are handled here, at model.t
            segs, left, end = ended.popleft()
            makespan = max(makespan, end)
            if len(segs) > 1:
                send(segs[1:], left)  # an aborted request is resumed at once
                continue
            left[0] -= 1
            if left[0] == 0:
                running -= 1
                start_episodes()
        t = model.next_event_time()
        if t == math.inf:
            return makespan
        model.advance(t)


def group_episodes(requests: Iterable[SimRequest]) -> list[list[SimRequest]]:
    """Group recorded requests into episodes by prompt key, in first-seen order."""
    groups: dict[int, list[SimRequest]] = {}
    for r in requests:
        groups.setdefault(r.key, []).append(r)
    return list(groups.values())

