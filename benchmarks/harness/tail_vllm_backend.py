"""The tail scenario's server on real vLLM (:mod:`.tail_vllm`): the sim's length model
forced onto each request, and the server's own counters.

:class:`ForcedLengthVLLM` is the ``vllm`` backend with one change per segment: the
response length.  The engine and the workflow send exactly what they send to the sim
(:class:`~.tail_run.TailWorkflow`: ``max_new_tokens`` = the cap, ``gconfig.seed =
derive_seed(seed, i, j, 0)``); on a request id's first segment the backend makes the sim's
draw for it (:func:`forced_draw`: :func:`engine.backends.sim._draws.request_seed_rng` and
:func:`~engine.backends.sim._draws.draw`, the code :class:`~engine.backends.sim.SimBackend`
runs, so the length is the sim's for the same ``(seed, prompt, sample)``), and every
segment asks vLLM for ``min(budget, rest of the draw)`` tokens with ``ignore_eos`` and
``min_tokens`` equal to that: the server decodes exactly that many.  The segment that
reaches a draw which ended before the cap is answered ``"stop"`` (the sim's EOS; its last
token is the model's own, not EOS), one cut at the cap stays ``"length"``.

Why here and not in the workflow's ``max_new_tokens``: the engine's policies read the
budget.  ``length_aware`` estimates a group whose probe runs past the probe budget as
``done + budget left``; with the draw as the budget that estimate would be the exact
length (an oracle the sim's run does not have, where it is the cap).  Forced in the
backend, the engine sees the same requests and answers on both servers.

Counting: tokens of answered segments per prompt (:attr:`ForcedLengthVLLM.decoded`,
exact); a segment withdrawn before it answered (cancelled: a deferred or stale episode,
the run's close) leaves its tokens at the server unseen; :class:`ServerMetrics` reads the
server's own ``vllm:generation_tokens_total`` (exact, every token decoded) so the run knows
the total, and :meth:`ForcedLengthVLLM.attribute_unreturned` splits it over the withdrawn
segments (an estimate; the JSON says so).  Slot occupancy comes from sampling
``vllm:num_requests_running``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from engine.backends.remote import VLLMBackend
from engine.backends.sim import SimConfig, SimDraw
from engine.backends.sim._draws import draw, prompt_key, request_seed_rng
from engine.errors import BackendError, InvalidRequestError
from engine.types import ModelRequest, ModelResponse

__all__ = ["ForcedLengthVLLM", "MetricsSample", "ServerMetrics", "Withdrawn", "forced_draw", "parse_metrics"]


def forced_draw(sim: SimConfig, input_ids: Sequence[int], gconfig_seed: int, budget: int) -> SimDraw:
    """The sim's draw for a request with this prompt, ``gconfig.seed`` and new-token
    ``budget`` (the cap): what :meth:`SimBackend.draw <engine.backends.sim.SimBackend.draw>`
    returns for it (``.n`` tokens, ``.finished`` when it ends before the cap)."""
    key = prompt_key(input_ids) if sim.difficulty_sigma > 0 else None
    return draw(sim, request_seed_rng(sim.seed, gconfig_seed, input_ids), budget, key=key)


@dataclass(frozen=True)
class _Forced:
    prompt_len: int
    length: int  # tokens the sample has in all (the draw, capped)
    finished: bool  # the draw ends before the cap: its last segment answers "stop"


@dataclass(frozen=True)
class Withdrawn:
    """A segment that never answered: ``prompt`` index (None: not the scenario's), tokens
    asked for, seconds from send to withdrawal, and whether the run was closing."""

    prompt: int | None
    budget: int
    elapsed_s: float
    at_close: bool


class ForcedLengthVLLM(VLLMBackend):
    """:class:`~engine.backends.remote.VLLMBackend` whose responses have the sim's lengths
    (module docstring).

    Args:
        servers: the vLLM base URLs.
        sim: the length model (its ``seed``, ``out_len_median``, ``out_len_sigma``,
            ``difficulty_sigma``; nothing else of it is read).
        kwargs: :class:`VLLMBackend`'s.

    Attributes:
        prompt_of: request id -> prompt index (the workflow fills it).
        decoded: prompt index -> tokens of its answered segments.
        returned_tokens: tokens of every answered segment.
        answered_s: seconds those segments took, summed (send to answer).
        withdrawn: the segments that never answered (:class:`Withdrawn`).
        forced_segments: ``(rid, tokens asked for, tokens answered, stop reason)`` per answered segment.
        closing: set when the trainer is done (what is withdrawn then was in flight at the end).

    Raises (from :meth:`generate`):
        InvalidRequestError: a request without ``gconfig.seed`` (its length would not be the sim's).
        BackendError: a segment asked for past its draw, or vLLM answered another token
            count than it was asked (``ignore_eos`` not honoured), except an abort.
    """

    def __init__(self, servers: Sequence[str] | str, *, sim: SimConfig, **kwargs: Any) -> None:
        super().__init__(servers, **kwargs)
        self.sim = sim
        self.prompt_of: dict[str, int] = {}
        self.decoded: collections.Counter[int] = collections.Counter()
        self.returned_tokens = 0
        self.answered_s = 0.0
        self.withdrawn: list[Withdrawn] = []
        self.forced_segments: list[tuple[str, int, int, str]] = []
        self.closing = False
        self._forced: dict[str, _Forced] = {}

    def forced_length(self, rid: str) -> int | None:
        """The drawn length of request ``rid`` (None before its first segment)."""
        forced = self._forced.get(rid)
        return None if forced is None else forced.length

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        forced = self._forced.get(request.rid)
        if forced is None:  # the first segment: input_ids is the prompt, the budget the cap
            if request.gconfig.seed is None:
                raise InvalidRequestError(f"request {request.rid}: ForcedLengthVLLM needs gconfig.seed (the sim's "
                                          "draw is a function of the seed and the prompt)")
            d = forced_draw(self.sim, request.input_ids, request.gconfig.seed, request.validate())
            forced = self._forced[request.rid] = _Forced(len(request.input_ids), d.n, d.finished)
        rest = forced.length - (len(request.input_ids) - forced.prompt_len)
        if rest <= 0:
            raise BackendError(f"request {request.rid}: a segment asked for past its drawn {forced.length} tokens")
        ask = min(budget, rest)
        segment = dataclasses.replace(request, gconfig=request.gconfig.new(ignore_eos=True, min_new_tokens=ask))
        prompt = self.prompt_of.get(request.rid)
        sent = trio.current_time()
        try:
            resp = await super().generate(segment, ask)
        except BaseException:
            self.withdrawn.append(Withdrawn(prompt, ask, trio.current_time() - sent, self.closing))
            raise
        if resp.stop_reason != "abort" and resp.output_len != ask:
            raise BackendError(f"request {request.rid}: vLLM answered {resp.output_len} tokens for a forced {ask} "
                               "(ignore_eos/min_tokens not honoured?)")
        self.returned_tokens += resp.output_len
        self.answered_s += trio.current_time() - sent
        if prompt is not None:
            self.decoded[prompt] += resp.output_len
        if resp.stop_reason == "length" and ask == rest and forced.finished:
            resp = dataclasses.replace(resp, stop_reason="stop")  # the draw ended here: the sim's EOS
        self.forced_segments.append((request.rid, ask, resp.output_len, resp.stop_reason))
        return resp

    def attribute_unreturned(self, unreturned: int) -> dict[int, int]:
        """Split ``unreturned`` tokens (decoded by the server, never answered: its counter
        minus :attr:`returned_tokens`) over the withdrawn segments of known prompts, in
        proportion to ``min(budget, elapsed_s * rate)`` (``rate``: tokens per second per
        segment over the answered ones), each capped at its budget; prompt -> tokens."""
        if unreturned <= 0 or not self.withdrawn:
            return {}
        rate = self.returned_tokens / self.answered_s if self.answered_s > 0 else None
        weights = [float(w.budget) if rate is None else min(w.budget, w.elapsed_s * rate) for w in self.withdrawn]
        total = sum(weights)
        out: collections.Counter[int] = collections.Counter()
        if total <= 0:
            return {}
        for w, weight in zip(self.withdrawn, weights):
            if w.prompt is not None:
                out[w.prompt] += min(w.budget, round(unreturned * weight / total))
        return dict(out)


@dataclass(frozen=True)
class MetricsSample:
    """One read of ``GET /metrics`` (``t_s``: trio time of the read; ``running``: requests the
    engine core decodes, ``waiting``: queued in it; ``client``: requests the client had sent
    and not yet seen answered: the difference to ``running + waiting`` is inside the API
    server, being parsed or answered)."""

    t_s: float
    running: float
    waiting: float
    generation_tokens: float
    prompt_tokens: float
    preemptions: float
    client: float = 0.0  # requests the client had outstanding at the read (poll's in_flight)


_NAMES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:generation_tokens_total": "generation_tokens", "vllm:prompt_tokens_total": "prompt_tokens",
          "vllm:num_preemptions_total": "preemptions"}


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges and counters of :class:`MetricsSample` from Prometheus text (summed over
    label sets; a metric absent is 0)."""
    out = dict.fromkeys(_NAMES.values(), 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        key = _NAMES.get(name)
        if key is None:
            continue
        try:
            out[key] += float(rest.rpartition("}")[2].split()[0])
        except (IndexError, ValueError):
            continue
    return out


@dataclass
class ServerMetrics:
    """Reads a vLLM server's ``/metrics`` (:meth:`read`) and samples it every
    ``interval_s`` seconds while :meth:`poll` runs (:attr:`samples`).

    Attributes:
        url: the server's base URL.
        interval_s: seconds between reads while polling (> 0).
        timeout_s: each read's bound.
    """

    url: str
    interval_s: float = 0.25
    timeout_s: float = 10.0
    samples: list[MetricsSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s must be a finite number of seconds > 0, got {self.interval_s!r}")

    async def read(self, client: httpx.AsyncClient) -> MetricsSample:
        """One read now.

        Raises:
            httpx.HTTPError: the server did not answer within ``timeout_s``, or not with 200.
        """
        answer = await client.get(self.url + "/metrics", timeout=self.timeout_s)
        answer.raise_for_status()
        return MetricsSample(trio.current_time(), **parse_metrics(answer.text))

    async def poll(self, client: httpx.AsyncClient, in_flight: Callable[[], int] | None = None) -> None:
        """Append a sample every ``interval_s`` until cancelled (a failed read is skipped);
        ``in_flight()``: the client's outstanding requests, read as the answer arrives."""
        while True:
            try:
                sample = await self.read(client)
                if in_flight is not None:
                    sample = dataclasses.replace(sample, client=float(in_flight()))
                self.samples.append(sample)
            except httpx.HTTPError:
                pass
            await trio.sleep(self.interval_s)

    def busy_slot_s(self, start_s: float, end_s: float) -> float:
        """Slot-seconds held in ``[start_s, end_s]``: the running-requests gauge integrated
        (each sample held until the next)."""
        total = 0.0
        points = [s for s in self.samples if s.t_s <= end_s]
        for a, b in zip(points, [*points[1:], None]):
            lo, hi = max(a.t_s, start_s), min(end_s, b.t_s if b is not None else end_s)
            if hi > lo:
                total += a.running * (hi - lo)
        return total

    def mean(self, name: str, start_s: float, end_s: float) -> float | None:
        """Mean of a gauge (``"running"``, ``"waiting"``, ``"client"``) over the samples in ``[start_s, end_s]``."""
        values = [getattr(s, name) for s in self.samples if start_s <= s.t_s <= end_s]
        return sum(values) / len(values) if values else None

    async def wait_idle(self, client: httpx.AsyncClient, *, timeout_s: float = 30.0) -> MetricsSample:
        """Read until no request runs or waits (aborts landed), at most ``timeout_s``
        seconds; the last read."""
        with trio.move_on_after(timeout_s):
            while True:
                sample = await self.read(client)
                if sample.running == 0 and sample.waiting == 0:
                    return sample
                await trio.sleep(0.2)
        return await self.read(client)
