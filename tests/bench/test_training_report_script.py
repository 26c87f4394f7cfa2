"""benchmarks/training_report.py's seed study on run folders written here."""

import json

from tests.bench.test_scripts import load


def _run(runs, name, losses):
    (runs / name).mkdir(parents=True)
    lines = [json.dumps({"event": "train", "step": 1, "loss": 9.0})]
    lines += [json.dumps({"event": "eval", "step": step, "val_loss": loss}) for step, loss in losses.items()]
    (runs / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_seed_study_pairs_the_last_evaluations_of_each_seed(tmp_path):
    _run(tmp_path, "scratchlm_s0", {500: 4.5, 5000: 3.90})
    _run(tmp_path, "reference_s0", {500: 4.4, 5000: 3.88})
    _run(tmp_path, "scratchlm_s1", {5000: 3.86})
    _run(tmp_path, "reference_s1", {5000: 3.89})
    _run(tmp_path, "scratchlm", {5000: 3.7})  # another benchmark's run in the same folder
    final, lines = load("training_report").seed_study(tmp_path)
    assert set(final) == {"scratchlm_s0", "reference_s0", "scratchlm_s1", "reference_s1"}
    assert final["scratchlm_s0"] == {500: 4.5, 5000: 3.90}
    assert lines[0].endswith("delta +0.0200") and lines[1].endswith("delta -0.0300")
    assert lines[2] == "mean: scratchlm 3.8800  reference 3.8850  delta -0.0050"
