import doctest
import json

import pytest

import scratchlm.bench.results as results
from scratchlm.bench.results import add_ratios, environment, ratio, ratio_table, read_jsonl, write_json
from scratchlm.errors import UserError


def test_docstring_examples():
    assert doctest.testmod(results).failed == 0


def test_write_json_creates_the_folder_and_round_trips(tmp_path):
    path = write_json(tmp_path / "a" / "b.json", {"rows": [{"x": 1.5}]})
    assert json.loads(path.read_text()) == {"rows": [{"x": 1.5}]}


def test_environment_names_device_and_torch():
    import torch

    env = environment()
    assert env["torch"] == torch.__version__ and env["device"]


def test_ratio_of_missing_or_zero_is_none():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None


def test_add_ratios_sets_every_field_present_in_both_rows():
    ref = {"tok": 10.0, "mem": 4.0}
    rows = [{"tok": 15.0, "mem": 2.0}, {"tok": 5.0}, {"error": "out of memory"}]
    add_ratios(rows, ref, {"speed": "tok", "memory": "mem"})
    assert rows[0]["speed"] == 1.5 and rows[0]["memory"] == 0.5
    assert rows[1]["speed"] == 0.5 and "memory" not in rows[1]
    assert rows[2] == {"error": "out of memory"}


def test_ratio_table_skips_failed_rows_and_shows_missing_ratios():
    rows = [{"v": "ref", "t": 100.0, "r": 1.0}, {"v": "broken"}, {"v": "new", "t": 150.0}]
    lines = ratio_table(rows, label="v", value="t", ratio_key="r", header=("variant", "tok/s", "ratio"),
                        value_format=".0f", label_width=10).splitlines()
    assert len(lines) == 3
    assert lines[1].split() == ["ref", "100", "1.000x"] and lines[2].split() == ["new", "150", "n/a"]


def test_read_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n\n{"event": "eval", "val_loss": 3.5}\n')
    assert read_jsonl(path) == [{"event": "train", "step": 1}, {"event": "eval", "val_loss": 3.5}]


def test_read_jsonl_leaves_out_a_last_line_cut_by_a_killed_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "train", "st')
    assert read_jsonl(path) == [{"event": "train", "step": 1}]


def test_read_jsonl_names_a_damaged_line_that_is_not_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "tr\n{"event": "eval", "val_loss": 3.5}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_jsonl(path)
