"""The torchrl tier's warning filters: torchrl 0.14.1's own warnings, by message (pyproject
turns every warning into an error).  Nothing here runs without torchrl installed."""

from __future__ import annotations

#: raised by torchrl itself, for its own classes, whatever the caller does
TORCHRL_WARNINGS = (
    # importing torchrl.collectors defines torchrl's own WeightUpdaterBase subclasses
    "ignore:Creating .* which inherits from WeightUpdaterBase is deprecated:DeprecationWarning",
)


def pytest_configure(config):
    for line in TORCHRL_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
