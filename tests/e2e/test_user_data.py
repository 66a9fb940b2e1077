"""A user's own data and reward (issue 15).

Unit tier: :mod:`engine.datasets._hf` on files the tests write (jsonl, parquet, csv,
save_to_disk folders), column mapping, bad rows, the exact-match reward.
End-to-end tier: ``rollout run --backend sim`` on a parquet file with
``problem``/``solution`` columns and the math-verify reward, a jsonl with a
``messages`` column and the exact-match reward, and a ``save_to_disk`` folder; the
sim answers with a canned text (``--sim-text``) so that rewards are a real mix of 0 and 1.
"""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from engine.errors import DatasetError
from engine.datasets import DataSpec, load_items, render_template
from rewards.exact_match import exact_match_reward, normalize
from rewards.math import math_reward
from conftest import run_cli

MATH_ROWS = [
    {"problem": "What is 1+1?", "solution": "So the answer is \\boxed{2}."},
    {"problem": "What is 2+2?", "solution": "4"},
    {"problem": "Half of 4?", "solution": "\\frac{4}{2}"},
    {"problem": "What is 3-2?", "solution": "\\boxed{1}"},
]


_cli = run_cli


def _rows(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


# -- loading and mapping ---------------------------------------------------------------------------


def test_gsm8k_jsonl_and_builtin_arith_give_the_items_they_gave_before(tmp_path):
    from engine.datasets import PROMPT_SUFFIX, builtin_arith, load_dataset

    path = tmp_path / "gsm8k.jsonl"
    rows = builtin_arith(5)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = load_dataset(str(path))
    new = load_items(DataSpec(source=str(path), prompt_suffix=PROMPT_SUFFIX, required=("answer",))).items
    assert new == old
    assert load_items(DataSpec(source="builtin:arith:5", prompt_suffix=PROMPT_SUFFIX)).items == \
        load_dataset("builtin:arith:5")


def test_parquet_csv_and_save_to_disk_folders_load_with_their_columns_mapped(tmp_path):
    datasets.Dataset.from_list(MATH_ROWS).to_parquet(str(tmp_path / "m.parquet"))
    datasets.Dataset.from_list(MATH_ROWS).to_csv(str(tmp_path / "m.csv"), index=False)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH_ROWS[:1]),
                          "test": datasets.Dataset.from_list(MATH_ROWS)}).save_to_disk(str(tmp_path / "dd"))
    for source, split in (("m.parquet", None), ("m.csv", None), ("dd", "test")):
        got = load_items(DataSpec(source=str(tmp_path / source), split=split, prompt_suffix=" HINT",
                                  required=("answer",)))
        assert got.rows == 4 and got.columns == ("problem", "solution"), source
        first = got.items[0]
        assert first["messages"] == [{"role": "user", "content": "What is 1+1? HINT"}]
        assert first["answer"] == MATH_ROWS[0]["solution"] and first["problem"] == "What is 1+1?"
    assert load_items(DataSpec(source=str(tmp_path / "dd"))).rows == 1  # default split: train
    with pytest.raises(DatasetError, match=r"split 'dev' not found; splits are train, test"):
        load_items(DataSpec(source=str(tmp_path / "dd"), split="dev"))


def test_limit_shuffle_seed_and_epochs(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(10)))

    def answers(**kw):
        return [item["answer"] for item in load_items(DataSpec(source=str(path), **kw)).items]

    assert answers(limit=3) == ["0", "1", "2"]
    shuffled = answers(shuffle=True, seed=7, limit=4)
    assert shuffled == answers(shuffle=True, seed=7, limit=4) != answers(shuffle=True, seed=8, limit=4)
    assert sorted(shuffled) != shuffled or shuffled != ["0", "1", "2", "3"]
    two = answers(shuffle=True, seed=7, limit=4, epochs=2)
    assert two[:4] == shuffled and sorted(two[4:]) == sorted(shuffled)
    assert answers(limit=2, epochs=3) == ["0", "1"] * 3


def test_templates_chats_and_system_prompts(tmp_path):
    assert render_template("Q: {q} \\boxed{} \\frac{1}{2} {{q}}", {"q": "x"}) == "Q: x \\boxed{} \\frac{1}{2} {q}"
    path = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "Say hi"}]
    path.write_text(json.dumps({"messages": chat, "answer": "hi", "topic": "greet"}) + "\n")
    item = load_items(DataSpec(source=str(path), system_prompt="Be terse.")).items[0]
    assert item["messages"] == [{"role": "system", "content": "Be terse."}, *chat]
    item = load_items(DataSpec(source=str(path), prompt_template="Topic {topic}: answer {answer}")).items[0]
    assert item["messages"] == [{"role": "user", "content": "Topic greet: answer hi"}]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"source": "nope.parquet"}, "dataset file not found: nope.parquet"),
        ({"source": "{d}/x.txt"}, "unknown format '.txt'"),
        ({"source": "{d}/ok.jsonl", "prompt_key": "missing"}, "--prompt-key 'missing' is not a column"),
        ({"source": "{d}/ok.jsonl", "prompt_template": "{nope}"}, "placeholder {nope} is not a column"),
        ({"source": "{d}/other.jsonl"}, "no prompt column"),
        ({"source": "{d}/ok.jsonl", "required": ("answer",), "answer_key": "zzz"}, "--answer-key 'zzz'"),
        ({"source": "{d}/noanswer.jsonl", "required": ("answer",)}, "no column 'answer', which the reward needs"),
        ({"source": "{d}/broken.jsonl"}, "broken.jsonl: cannot load it"),
    ],
)
def test_a_dataset_that_cannot_be_used_is_one_error_naming_the_field(tmp_path, spec, needle):
    (tmp_path / "x.txt").write_text("hello")
    (tmp_path / "ok.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    (tmp_path / "other.jsonl").write_text('{"text": "q"}\n')
    (tmp_path / "noanswer.jsonl").write_text('{"question": "q"}\n')
    (tmp_path / "broken.jsonl").write_text('{"question": "q"}\n{not json\n')
    spec = {k: v.replace("{d}", str(tmp_path)) if isinstance(v, str) else v for k, v in spec.items()}
    with pytest.raises(DatasetError) as info:
        load_items(DataSpec(**spec))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_hub_id_offline_is_one_error_saying_the_hub_was_not_reached(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never reaches the network
    with pytest.raises(DatasetError, match=r"dataset 'someone/some-set': not a local file or folder, and the "
                                           r"Hugging Face hub could not be reached"):
        load_items(DataSpec(source="someone/some-set"))


def test_unusable_rows_name_their_index_and_are_skipped_on_request(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "ok", "answer": "1"}\n{"question": "  ", "answer": "2"}\n'
                    '{"question": "no answer", "answer": null}\n{"question": "fine", "answer": "4"}\n')
    with pytest.raises(DatasetError, match=r"row index 1: field 'question' is empty"):
        load_items(DataSpec(source=str(path), required=("answer",)))
    caplog.set_level(logging.WARNING, logger="rollout.engine.datasets._hf")
    got = load_items(DataSpec(source=str(path), required=("answer",), skip_bad_rows=True))
    assert [i["question"] for i in got.items] == ["ok", "fine"]
    assert got.skipped == ((1, "field 'question' is empty"),
                           (2, "field 'answer' is missing or null (the reward needs it)"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "row index 1 skipped" in lines[0] and "row index 2 skipped" in lines[1]
    path.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DatasetError, match=r"row index 0: field 'messages': message 0 must be an object with"):
        load_items(DataSpec(source=str(path)))


def test_exact_match_reward():
    assert normalize('  "Paris."  ') == "paris"
    assert exact_match_reward(None, "Let me think.\nParis", None, None, answer="paris") == 1.0
    assert exact_match_reward(None, "Answer: New  York!\nDone", None, None, answer="new york") == 1.0
    assert exact_match_reward(None, "it is \\boxed{B}", None, None, answer=["A", "b"]) == 1.0
    assert exact_match_reward(None, "Lyon", None, None, answer="Paris") == 0.0
    assert exact_match_reward(None, "", None, None, answer="") == 0.0


# -- rollout run, end to end -----------------------------------------------------------------------


@pytest.mark.slow
def test_run_on_a_parquet_file_with_problem_solution_columns_and_the_math_reward(tmp_path, capsys):
    canned = ["--sim-text", "\\boxed{2} "]  # the sim's completions repeat this: right for 2 of the 4 problems
    data = tmp_path / "math.parquet"
    datasets.Dataset.from_list(MATH_ROWS).to_parquet(str(data))
    out = tmp_path / "out"
    code, stdout, err = _cli(["run", "--backend", "sim", "--dataset", str(data), "--reward", "math", "--n-samples",
                              "2", "--max-new-tokens", "48", "--sim-out-len-median", "40", "--sim-out-len-sigma", "0",
                              *canned, "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["submitted"] == summary["accepted"] == 4 and summary["trajectories"] == 8
    assert summary["reward"] == "math" and summary["dataset_rows"] == 4
    rows = _rows(out)
    by_task = {}
    for row in rows:
        problem = MATH_ROWS[row["task_id"]]
        assert problem["problem"] in row["prompt"] and "\\boxed{}" in row["prompt"]  # the math hint
        assert row["reward"] == math_reward(None, row["completion"], None, None, answer=problem["solution"])
        by_task.setdefault(row["task_id"], set()).add(row["reward"])
    assert by_task == {0: {1.0}, 1: {0.0}, 2: {1.0}, 3: {0.0}}  # 2 = \frac{4}{2}: math-verify's equivalence
    assert summary["reward_mean"] == 0.5


@pytest.mark.slow
def test_run_on_a_jsonl_with_a_messages_column_and_exact_match(tmp_path, capsys):
    canned = ["--sim-text", "\\boxed{hi} "]  # a slice of 30 tokens holds a complete one
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i, answer in enumerate(["hi", "bye", "hi"]):
            chat = [{"role": "system", "content": f"Persona {i}."}, {"role": "user", "content": f"Greet {i}"}]
            f.write(json.dumps({"messages": chat, "answer": answer}) + "\n")
    out = tmp_path / "out"
    code, _, err = _cli(["run", "--backend", "sim", "--dataset", str(data), "--reward", "exact_match", "--n-samples",
                         "1", "--max-new-tokens", "40", "--sim-out-len-median", "30", "--sim-out-len-sigma", "0",
                         *canned, "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    rows = sorted(_rows(out), key=lambda r: r["task_id"])
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0]
    for i, row in enumerate(rows):
        assert f"<|im_start|>system\nPersona {i}.<|im_end|>" in row["prompt"] and f"Greet {i}" in row["prompt"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == 3 and summary["reward_mean"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_run_on_a_save_to_disk_folder_with_split_template_limit_shuffle_epochs(tmp_path, capsys):
    folder = tmp_path / "ds"
    test_rows = [{"q": f"What is {i} + {i}?", "gold": f"#### {2 * i}", "unit": "apples"} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(test_rows[:1]),
                          "test": datasets.Dataset.from_list(test_rows)}).save_to_disk(str(folder))
    out = tmp_path / "out"
    code, _, err = _cli(["run", "--backend", "sim", "--dataset", str(folder), "--split", "test", "--prompt-template",
                         "{q} Count {unit}.", "--answer-key", "gold", "--limit", "3", "--shuffle", "--seed", "5",
                         "--epochs", "2", "--n-samples", "1", "--max-new-tokens", "8", "--quiet", "--out", str(out)],
                        capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["submitted"] == summary["trajectories"] == 6 and summary["epochs"] == 2
    prompts = [r["prompt"] for r in sorted(_rows(out), key=lambda r: r["task_id"])]
    firsts = [p.split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for p in prompts]
    assert all(p.endswith(" Count apples.") for p in firsts)
    assert sorted(firsts[:3]) == sorted(firsts[3:]) and len(set(firsts)) == 3  # 3 rows, twice


def test_rollout_run_refuses_an_unusable_row_in_one_line(tmp_path, capsys, monkeypatch):
    import engine.cli._backend
    import engine.cli._main

    monkeypatch.setattr(engine.cli._backend, "tokenizer_and_backend", lambda args: pytest.fail("no work for bad input"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "ok", "solution": "1"}\n{"problem": "", "solution": "2"}\n')
    code, _, err = _cli(["run", "--backend", "sim", "--dataset", str(data), "--reward", "math", "--quiet",
                         "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "row index 1: field 'problem' is empty" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(["run", "--backend", "sim", "--dataset", str(data), "--reward", "nope", "--quiet",
                         "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--reward 'nope': unknown reward; built-ins are gsm8k, math, exact_match" in err
