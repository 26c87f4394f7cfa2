import json

import pytest

from scratchlm.errors import UserError
from scratchlm.train.metrics import JsonlLogger, read_metrics, truncate_metrics

RECORDS = [{"event": "train", "step": 1}, {"event": "train", "step": 2}]


def _killed_mid_record(path):
    """metrics.jsonl of a run killed while it wrote its third record."""
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + '{"event": "train", "st')


def test_a_last_line_cut_by_a_killed_run_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _killed_mid_record(path)
    assert read_metrics(path) == RECORDS


def test_resuming_drops_the_cut_line_so_new_records_stay_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _killed_mid_record(path)
    truncate_metrics(path, 2)  # resumed at the step of the last whole record: nothing else to drop
    logger = JsonlLogger(path)
    logger.log({"event": "train", "step": 3})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_a_damaged_line_inside_the_file_names_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\nnot json\n{"event": "train", "step": 2}\n')
    with pytest.raises(UserError, match="metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(path)


@pytest.mark.parametrize("damage, message", [
    (b"[1, 2]\n", "line 2 is not a JSON record"),  # was an AttributeError on resume
    (b"\xff\xfe garbage\n", "not a metrics log"),  # was a UnicodeDecodeError
])
def test_a_line_that_is_no_record_or_no_text_is_a_user_error(tmp_path, damage, message):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "train", "step": 1}\n' + damage)
    with pytest.raises(UserError, match=message):
        read_metrics(path)
    with pytest.raises(UserError, match=message):
        truncate_metrics(path, 0)
