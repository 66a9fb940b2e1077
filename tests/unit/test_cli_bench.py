"""Unit tier: ``rollout bench`` is the one place the library reaches the ``benchmarks``
package (tests/unit/test_layers.py), and it copes with its absence."""

from __future__ import annotations


def test_rollout_bench_without_the_benchmarks_package_is_one_line(monkeypatch, capsys):
    """The library runs without ``benchmarks`` (an install may leave it out): ``rollout
    bench`` then says so in one line, exit status 2, instead of a traceback."""
    import sys

    from engine.cli import main

    # import benchmarks... -> ModuleNotFoundError, also when an earlier test imported its submodules
    for name in [n for n in sys.modules if n == "benchmarks" or n.startswith("benchmarks.")] or ["benchmarks"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["bench", "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout bench: error:") and "benchmarks" in err and err.count("\n") == 1, err
