"""Unit tier: the ``hf`` continuous batcher's pump (the worker thread that carries
transformers' streamed outputs into the trio loop), against a stand-in manager (no model)."""

from __future__ import annotations

import queue
from typing import Any

import pytest
import trio

from engine.backends.hf._continuous import ContinuousBatcher


class FakeManager:
    """``outputs`` queued as a decoding step leaves them; running while any is left."""

    def __init__(self, outputs: list[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        for out in outputs:
            self.queue.put(out)

    def is_running(self) -> bool:
        return not self.queue.empty()

    def get_result(self, timeout: float | None = None) -> str | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None


class Recording(ContinuousBatcher):
    def __init__(self) -> None:
        super().__init__(lm=None, current_version=lambda: 0, max_batch_size=32, cache_tokens=1024)  # type: ignore[arg-type]
        self.routed: list[Any] = []

    def _route(self, out: Any) -> None:
        self.routed.append(out)


async def test_pump_routes_a_steps_outputs_in_one_trio_round_trip(monkeypatch):
    # one trio round trip per streamed output was 32 per decoding step at 32 rows, each a GIL
    # hand-off between the pump, the trio thread and the decoding thread (the H200 run's 141 tokens/s)
    outputs = [f"r{i}" for i in range(32)]
    batcher = Recording()
    batcher.manager = FakeManager(outputs)
    batcher._token = trio.lowlevel.current_trio_token()
    trips = 0
    run_sync = trio.from_thread.run_sync

    def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal trips
        trips += 1
        return run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(trio.from_thread, "run_sync", counting)
    await trio.to_thread.run_sync(batcher._pump)
    assert batcher.routed == outputs  # every output, in order
    assert trips == 1


def test_a_transformers_without_the_continuous_config_fields_is_one_clear_error(monkeypatch):
    """Regression (seen on a GPU machine with transformers 5.17): continuous mode died with
    a TypeError from deep inside start-up; now a BackendError naming the version and the way out."""
    import types

    import transformers

    from engine.errors import BackendError

    class OldConfig:
        def __init__(self, **kwargs):
            raise TypeError("__init__() got an unexpected keyword argument 'page_size'")

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", OldConfig)
    lm = types.SimpleNamespace(vocab_size=8, tokenizer=types.SimpleNamespace(pad_token_id=0))
    batcher = ContinuousBatcher(lm, lambda: 0, max_batch_size=4, cache_tokens=256)  # type: ignore[arg-type]
    with pytest.raises(BackendError, match=r"mode='continuous' needs a transformers .* use mode='static'"):
        batcher._start_manager()
