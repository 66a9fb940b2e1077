"""The reward pool's latency window: percentiles by selection equal the sorted ones."""

from __future__ import annotations

import random

import pytest

from rewards._stats import LatencyWindow, percentile


def test_empty_window_has_no_percentiles():
    assert LatencyWindow(8).percentiles(0.5, 0.99) == (None, None)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 100])
def test_percentiles_equal_nearest_rank_over_the_last_values(n):
    rng = random.Random(n)
    window = LatencyWindow(8)
    values = [rng.random() for _ in range(n)]
    for v in values:
        window.append(v)
    kept = sorted(values[-8:])  # the ring keeps the last 8 only
    assert len(window) == len(kept)
    assert window.percentiles(0.5, 0.99, 1.0) == (percentile(kept, 0.5), percentile(kept, 0.99), kept[-1])
