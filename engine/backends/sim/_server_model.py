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
    __slots__ = ("prefill_s", "steps", "on_done", "state", "end", "decode_start", "prompt_tokens", "rate",
                 "priority", "order", "g_start", "done_steps")

    def __init__(self, prefill_s: float, steps: float, on_done: Callable[[float, float], None],
                 prompt_tokens: int, rate: float, priority: int, order: int) -> None:
        self.prefill_s = prefill_s
        self.steps = steps  # decode steps still to take (this stint)
        self.on_done = on_done
        self.state = "waiting"  # -> prefill -> decode -> done | cancelled (decode -> waiting: preempted)
        self.end = 0.0  # prefill end (seconds) or decode end (steps), by state
        self.decode_start = math.nan  # time of the first decode step (kept across preemptions)
        self.prompt_tokens = prompt_tokens  # KV tokens held from admission (prompt + earlier output)
        self.rate = rate  # tokens per decode step (1 / straggler multiplier)
        self.priority = priority
        self.order = order  # arrival order
        self.g_start = 0.0  # decode progress g when this stint started
        self.done_steps = 0.0  # decode steps taken in earlier stints (before a preemption)


class ServerModel:
    """Event-driven model of the GPU (see the package docstring); sync and exact.

    Times are seconds on the caller's clock.  ``submit`` a sequence (prefill
    seconds, decode steps, ``on_done(end_time, decode_start_time)``), call
    :meth:`advance` with the current time to fire every event up to it (in time
    order, each ``on_done`` with the exact event time), and sleep until
    :meth:`next_event_time`.  Callbacks may submit new sequences.

    Admission: at most ``max_running_seqs`` sequences hold a slot (prefilling or
    decoding); waiting ones are admitted lowest ``(priority, arrival)`` first (pass
    ``priority=0`` everywhere for FCFS).  With a ``kv_token_budget`` a sequence holds
    ``prompt_tokens + tokens decoded`` of KV; one is admitted only if its prompt fits
    with :attr:`watermark` tokens to spare (or if the server is empty); when decoding
    sequences grow past the budget the one with the highest ``(priority, arrival)``
    among them is preempted (vLLM's recompute preemption), as long as another keeps
    decoding: it returns to the queue with its place, keeps its progress and, once
    readmitted, prefills ``recompute_s_per_token`` seconds per token it had decoded on
    top of its own prefill.

    Counters (since construction): :attr:`busy_slot_s` (slot-seconds held),
    :attr:`decoding_seq_s` (sequence-seconds decoding), :attr:`preemptions`,
    :attr:`peak_occupied`, :attr:`peak_kv_tokens` (tracked with a KV budget only).
    """

    def __init__(self, *, per_token_s: float, max_running_seqs: int | None = None,
                 decode_slowdown_per_seq: float = 0.0, kv_token_budget: int | None = None,
                 recompute_s_per_token: float = 0.0) -> None:
        self.per_token_s = per_token_s
        self.slots = max_running_seqs if max_running_seqs is not None else math.inf
        self.slowdown = decode_slowdown_per_seq
        self.kv_budget = kv_token_budget
        self.watermark = 0 if kv_token_budget is None else max(1, kv_token_budget // 100)
        self.recompute_s_per_token = recompute_s_per_token
        self.t = 0.0  # model time of the last update (seconds)
        self.g = 0.0  # decode steps taken by every sequence decoding since t = 0
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap of (priority, arrival, seq)
        self._prefill: list[tuple[float, int, _Seq]] = []  # (end time, tie, seq)
        self._decode: list[tuple[float, int, _Seq]] = []  # (end progress g, tie, seq)
        self._decoding_seqs: set[_Seq] = set()
        self._tie = 0
        self._arrivals = 0
        self.decoding = 0  # R
        self.occupied = 0  # sequences holding a slot (prefill + decode)
        self.queued = 0
        self.peak_occupied = 0
        # KV tokens held = _kv_const + _kv_rate * g (prefilling: their prompt; decoding: prompt + rate * (g - g_start))
        self._kv_const = 0.0
        self._kv_rate = 0.0
        self._prefill_kv = 0  # prompt tokens of the prefilling sequences (exact)
        self.peak_kv_tokens = 0.0
        self.busy_slot_s = 0.0
        self.decoding_seq_s = 0.0
        self.preemptions = 0

    def step_s(self) -> float:
        """Seconds per decode step now."""
        return self.per_token_s * (1.0 + self.slowdown * max(self.decoding - 1, 0))

    def kv_tokens(self) -> float:
        """KV tokens held now (prompt + decoded tokens of every sequence holding a slot)."""
        return self._kv_const + self._kv_rate * self.g

    def submit(self, now: float, prefill_s: float, steps: float, on_done: Callable[[float, float], None], *,
               prompt_tokens: int = 0, tokens_per_step: float = 1.0, priority: int = 0) -> _Seq:
        """Queue a sequence: ``prefill_s`` seconds of prefill, then ``steps`` decode steps
        producing ``tokens_per_step`` tokens each; it holds ``prompt_tokens`` of KV from
        admission.  Lower ``priority`` values are admitted first.

        Raises:
            ValueError: ``prompt_tokens`` does not fit the KV budget (with the watermark).
        """
        if self.kv_budget is not None and prompt_tokens + self.watermark > self.kv_budget:
            raise ValueError(f"a prompt of {prompt_tokens} tokens does not fit the server's KV budget of "
                             f"{self.kv_budget} tokens (with a {self.watermark}-token watermark)")
        if now > self.t:
            self.advance(now)
        self._arrivals += 1
        seq = _Seq(prefill_s, steps, on_done, prompt_tokens, tokens_per_step, priority, self._arrivals)
        heapq.heappush(self._waiting, (priority, seq.order, seq))
        self.queued += 1
        self._admit()
        return seq

    def decoded_tokens(self, seq: _Seq) -> float:
        """Tokens ``seq`` has decoded so far (all stints; fractional between steps)."""
        steps = seq.done_steps + (self.g - seq.g_start if seq.state == "decode" else 0.0)
        return steps * seq.rate

    def cancel(self, now: float, seq: _Seq) -> float:
        """Withdraw ``seq`` (frees its slot at ``now``); no callback.  Returns the tokens
        it had decoded (lost with it unless the caller hands them out)."""
        if now > self.t:
            self.advance(now)
        decoded = self.decoded_tokens(seq)
        if seq.state == "waiting":
            self.queued -= 1
        elif seq.state == "prefill":
            self.occupied -= 1
            self._kv_const -= seq.prompt_tokens
            self._prefill_kv -= seq.prompt_tokens
        elif seq.state == "decode":
            self._stop_decoding(seq)
            self.occupied -= 1
        else:
            return decoded
        seq.state = "cancelled"  # left in its queue/heap, skipped when reached
        self._admit()
        return decoded

    def _overflow_progress(self) -> float:
        """The progress ``g`` at which the decoding sequences outgrow the KV budget (inf:
        never, or nobody to preempt: one sequence alone may run past it)."""
        if self.kv_budget is None or self.decoding < 2 or self._kv_rate <= 0 or self.per_token_s == 0:
            return math.inf
        return (self.kv_budget - self._kv_const) / self._kv_rate

    def _overflow_time(self) -> float:
        g_over = self._overflow_progress()
        return math.inf if g_over == math.inf else self.t + max(g_over - self.g, 0.0) * self.step_s()

    def next_event_time(self) -> float:
        t = math.inf
        while self._prefill and self._prefill[0][2].state != "prefill":
            heapq.heappop(self._prefill)
        if self._prefill:
            t = self._prefill[0][0]
        decode = self._decode
        while decode:  # drop entries of ended stints (inlined _live_decode: the hottest loop)
            g_end, _, seq = decode[0]
            if seq.state == "decode" and seq.end == g_end:
                t = min(t, self.t + max(g_end - self.g, 0.0) * self.step_s())
                break
            heapq.heappop(decode)
        return t if self.kv_budget is None else min(t, self._overflow_time())

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
                entry = heapq.heappop(self._decode)
                if self._live_decode(entry):
                    seq = entry[2]
                    self._stop_decoding(seq)
                    self._finish(seq)
            while self.kv_budget is not None and self._decode_due(self._overflow_progress()):
                self._preempt()
            self._admit()
        self._move_to(now)

    @staticmethod
    def _live_decode(entry: tuple[float, int, _Seq]) -> bool:
        """A decode-heap entry of the sequence's current stint (a preempted sequence's
        earlier entry is stale)."""
        return entry[2].state == "decode" and entry[2].end == entry[0]

    def _decode_due(self, g_end: float) -> bool:
        """A decode ending at progress ``g_end`` is due now: reached within round-off,
        or so close that its end time rounds to the current time (at clock values of
        ~1e5 s, as trio's, a few picoseconds vanish in a float)."""
        return g_end <= self.g + _EPS_STEPS or self.t + (g_end - self.g) * self.step_s() <= self.t

    def _move_to(self, t: float) -> None:
        if t > self.t:
            dt = t - self.t
            self.busy_slot_s += self.occupied * dt
            self.decoding_seq_s += self.decoding * dt
            if self.decoding and self.per_token_s > 0:
                self.g += dt / self.step_s()
                if self.kv_budget is not None:
                    kv = self.kv_tokens()
                    if kv > self.peak_kv_tokens:
                        self.peak_kv_tokens = kv
            self.t = t

    def _fits(self, seq: _Seq) -> bool:
        if self.kv_budget is None or self.occupied == 0:
            return True
        return self.kv_tokens() + seq.prompt_tokens + self.watermark <= self.kv_budget

    def _admit(self) -> None:
        waiting = self._waiting
        while waiting and self.occupied < self.slots:
            seq = waiting[0][2]
            if seq.state != "waiting":
                heapq.heappop(waiting)
                continue
            if not self._fits(seq):
                break  # the head waits for room (no skipping ahead of it)
            heapq.heappop(waiting)
            self.queued -= 1
            self.occupied += 1
            self.peak_occupied = max(self.peak_occupied, self.occupied)
            self._kv_const += seq.prompt_tokens
            if self.kv_budget is not None:
                self.peak_kv_tokens = max(self.peak_kv_tokens, self.kv_tokens())
            if seq.prefill_s > 0:
                self._prefill_kv += seq.prompt_tokens
                seq.state = "prefill"
                seq.end = self.t + seq.prefill_s
                self._tie += 1
                heapq.heappush(self._prefill, (seq.end, self._tie, seq))
            else:
                self._start_decode(seq)

    def _start_decode(self, seq: _Seq) -> None:
        if seq.state == "prefill":
            self._prefill_kv -= seq.prompt_tokens
        if math.isnan(seq.decode_start):
            seq.decode_start = self.t
        if seq.steps <= 0 or self.per_token_s == 0:
            self._kv_const -= seq.prompt_tokens
            self._finish(seq)
            return
        seq.state = "decode"
        self.decoding += 1
        if self.kv_budget is not None:  # (preemption candidates)
            self._decoding_seqs.add(seq)
        seq.g_start = self.g
        self._kv_const += -seq.rate * self.g  # prompt_tokens already counted at admission
        self._kv_rate += seq.rate
        seq.end = self.g + seq.steps
        self._tie += 1
        heapq.heappush(self._decode, (seq.end, self._tie, seq))

    def _stop_decoding(self, seq: _Seq) -> None:
        """``seq`` leaves the decoding set (finished, cancelled or preempted): its KV is freed."""
        self.decoding -= 1
        self._decoding_seqs.discard(seq)
        self._kv_const -= seq.prompt_tokens - seq.rate * seq.g_start
        self._kv_rate -= seq.rate
        if not self.decoding:  # no drift from float round-off across idle periods
            self._kv_rate = 0.0
            self._kv_const = float(self._prefill_kv)

    def _preempt(self) -> None:
        """Preempt the lowest-priority, latest-arrived decoding sequence (recompute: it
        re-queues with its progress and re-prefills prompt + output when readmitted)."""
        victim = max(self._decoding_seqs, key=lambda s: (s.priority, s.order))
        self._stop_decoding(victim)
        self.occupied -= 1
        self.preemptions += 1
        taken = self.g - victim.g_start
        decoded = taken * victim.rate
        victim.done_steps += taken
        victim.steps -= taken
        victim.prompt_tokens += round(decoded)
        victim.prefill_s += decoded * self.recompute_s_per_token
        victim.state = "waiting"
        heapq.heappush(self._waiting, (victim.priority, victim.order, victim))
        self.queued += 1

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
                        decode_slowdown_per_seq=config.decode_slowdown_per_seq,
                        kv_token_budget=config.kv_token_budget, recompute_s_per_token=config.prefill_s_per_token)
    pending = collections.deque(episodes)
    ended: collections.deque[tuple[list[tuple[int, float, float]], list[int], float]] = collections.deque()
    makespan = 0.0
    running = 0

    def send(segs: list[tuple[int, float, float]], left: list[int]) -> None:
        prompt_len, factor, steps = segs[0]
        model.submit(model.t, config.prefill_seconds(prompt_len) * factor, steps,
                     lambda end, _decode_start: ended.append((segs, left, end)),
                     prompt_tokens=prompt_len, tokens_per_step=1.0 / factor)

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

