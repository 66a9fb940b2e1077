"""Which reward functions travel by file path or by value (``rewards._shipping``, issue 24).

Tier: unit (in-process; the worker side is played by removing the module from
``sys.modules`` before unpickling, as a fresh process does not have it).
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
import sys
import types

import pytest

import reward_fixtures as fx
from rewards import gsm8k_reward
from rewards._pickling import pickle_job
from rewards._shipping import ModuleFile, modules_to_ship


@pytest.fixture
def path_module(tmp_path):
    path = tmp_path / "loaded_by_path.py"
    path.write_text("def reward(prompt, completions, prompt_ids, completion_ids, **data):\n    return 3.0\n"
                    "class Scorer:\n    def __call__(self, *args, **data):\n        return 4.0\n")
    spec = importlib.util.spec_from_file_location("custom_module_for_shipping", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_functions_of_importable_modules_travel_by_reference():
    assert modules_to_ship(gsm8k_reward) == ((), False)
    assert modules_to_ship(fx.return_value) == ((), False)  # on sys.path (tests/fixtures)
    assert modules_to_ship(functools.partial(fx.return_value, value=1)) == ((), False)
    assert modules_to_ship(fx.CountingActor("log")) == ((), False)


def test_a_module_loaded_by_path_travels_as_its_file(path_module):
    for fn in (path_module.reward, path_module.Scorer(), functools.partial(path_module.reward, x=1)):
        (file,), by_value = modules_to_ship(fn)
        assert isinstance(file, ModuleFile) and not by_value
        assert (file.name, file.path) == ("custom_module_for_shipping", path_module.__file__)
    job, _ = pickle_job(path_module.reward, "custom_module_for_shipping.reward", ("p", "c", [], []), {})
    sys.modules.pop("custom_module_for_shipping")  # as in a fresh worker
    fn, args, data = pickle.loads(job)
    assert fn(*args, **data) == 3.0
    assert sys.modules["custom_module_for_shipping"].__file__ == path_module.__file__  # loaded under its name


def test_a_module_built_in_memory_travels_by_value():
    module = types.ModuleType("built_in_memory_for_shipping")
    exec("def reward(*args, **data):\n    return 5.0\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        assert modules_to_ship(module.reward) == ((), True)
        job, _ = pickle_job(module.reward, "built_in_memory_for_shipping.reward", (), {})
    finally:
        sys.modules.pop(module.__name__)
    fn, args, data = pickle.loads(job)  # no module of that name here any more
    assert fn() == 5.0


def test_a_reloaded_module_is_decided_again(path_module, tmp_path):
    assert modules_to_ship(path_module.reward)[0]
    sys.modules["custom_module_for_shipping"] = types.ModuleType("custom_module_for_shipping")
    exec("def reward(*args, **data):\n    return 6.0\n", sys.modules["custom_module_for_shipping"].__dict__)
    assert modules_to_ship(sys.modules["custom_module_for_shipping"].reward) == ((), True)
