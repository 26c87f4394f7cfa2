"""benchmarks/math_model.py: the data mix, reading the .zst books, and the whole pipeline at a
shrunken tiny scale on CPU (every stage, skipping, resuming), on the shared data."""

import json
import shutil
import sys

import pytest

from scratchlm.errors import UserError
from tests.bench.test_scripts import load

pytestmark = pytest.mark.usefixtures("one_thread")

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def mm():
    return load("math_model")


def test_mix_spreads_each_math_document_repeat_times_between_the_books_in_order(mm):
    books = [f"book {i}" for i in range(4)]
    math_docs = [f"problem {i}" for i in range(7)]
    mixed = mm.mix_documents(books, math_docs, repeat=3, seed=0)
    assert [d for d in mixed if d.startswith("book")] == books
    assert sorted(d for d in mixed if d.startswith("problem")) == sorted(math_docs * 3)
    at = [mixed.index(b) for b in books] + [len(mixed)]
    shares = [at[i + 1] - at[i] - 1 for i in range(len(books))]
    assert sum(shares) == 21 and max(shares) - min(shares) <= 1  # 21 over 4 gaps: 5 or 6 each
    assert mm.mix_documents(books, math_docs, repeat=3, seed=0) == mixed
    assert mm.mix_documents(books, math_docs, repeat=3, seed=1) != mixed
    assert mm.mix_documents([], math_docs, repeat=2, seed=0).count("problem 3") == 2


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_math_documents_hold_training_solutions_and_drop_problems_equal_to_a_test_problem(mm, tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7 apples.\n#### 7"},
        {"question": "What is 2 times 5?", "answer": "2*5=10\n#### 10"}])
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "What is 2 times 5?", "answer": "#### 10"}])
    write_jsonl(tmp_path / "math" / "train.jsonl", [
        {"problem": "Solve $x+1=2$.", "solution": "So $x=\\boxed{1}$.", "level": "Level 1", "type": "Algebra"}])
    write_jsonl(tmp_path / "math" / "test.jsonl", [
        {"problem": "Held out: $y^2=4$, $y>0$.", "solution": "$y=\\boxed{2}$", "level": "Level 1", "type": "Algebra"}])
    docs, counts = mm.math_documents(tmp_path, gsm8k_limit=0, math_limit=0)
    assert counts == {"gsm8k": 1, "math": 1, "dropped_equal_to_a_test_problem": 1}
    assert docs == ["Tom has 3 apples and buys 4. How many?\nAnswer: 3+4=7 apples.\n#### 7",
                    "Solve $x+1=2$.\nAnswer: So $x=\\boxed{1}$."]
    # Each document is a question_only prompt whose continuation that format's reward grades right.
    from scratchlm.align.prompts import get_template
    from scratchlm.align.rewards import question_only_reward

    for doc, question, answer in zip(docs, ["Tom has 3 apples and buys 4. How many?", "Solve $x+1=2$."], ["7", "1"]):
        prompt = get_template("question_only").format(question)
        assert doc.startswith(prompt) and question_only_reward(doc[len(prompt):], answer)["reward"] == 1.0


@pytest.fixture
def zst_file(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    text = EOT.join(f"document {i}\n" + "words and more words\n" * 50 for i in range(20))
    path = tmp_path / "books.txt.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(text.encode("utf-8")))
    return path, text


def test_read_zst_gives_the_text_and_cuts_a_prefix_at_a_document_boundary(mm, zst_file, monkeypatch):
    path, text = zst_file
    assert mm.read_zst(path) == text
    head = mm.read_zst(path, 5000)
    assert text.startswith(head) and len(head.encode()) <= 5000 and text[len(head):].startswith(EOT)
    if shutil.which("zstd"):  # the same through the zstd program
        monkeypatch.setitem(sys.modules, "zstandard", None)
        assert mm.decompressor() == "zstd"
        assert mm.read_zst(path) == text and mm.read_zst(path, 5000) == head


def test_no_decompressor_is_a_one_line_error_naming_both_fixes(mm, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard raises ImportError
    monkeypatch.setattr(mm.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="zstandard Python package.*zstd program") as err:
        mm.decompressor()
    assert "\n" not in str(err.value)


def test_set_overrides_a_scale_field_or_a_command_setting_and_refuses_unknown_keys(mm):
    scale = mm.copy.deepcopy(mm.SCALES["tiny"])
    mm.apply_set(scale, "math_repeat=5")
    mm.apply_set(scale, "pretrain.trainer.max_steps=7")
    mm.apply_set(scale, "grpo.data.reward=gsm8k_last_number")
    assert scale.math_repeat == 5 and scale.pretrain["trainer.max_steps"] == "7"
    assert scale.grpo["data.reward"] == "gsm8k_last_number"
    for bad in ("no_such_field=1", "pretrain=3", "math_repeat"):
        with pytest.raises(UserError):
            mm.apply_set(scale, bad)


# The tiny scale made smaller still, so the default test run stays short.
SHRINK = ["--set", "books_mb=0.1", "gsm8k_limit=60", "math_limit=30", "vocab_size=600", "eval_limit=3",
          "pretrain.trainer.max_steps=12", "pretrain.trainer.eval_interval=6",
          "pretrain.trainer.checkpoint_interval=6", "pretrain.model.context_length=448", "sft.sft.max_steps=2",
          "sft.data.eval_limit=1", "grpo.grpo.n_grpo_steps=1", "grpo.data.eval_limit=1"]


def test_tiny_pipeline_runs_every_stage_then_skips_reruns_and_resumes(mm, shared_data, tmp_path, capsys,
                                                                      monkeypatch):
    out = tmp_path / "run"
    assert mm.main(["--scale", "tiny", "--out", str(out), "--data-dir", str(shared_data)] + SHRINK) == 0
    results = json.loads((out / "math_model.json").read_text())
    assert set(results["stage_seconds"]) == set(mm.STAGES)
    assert (out / "math_model.png").stat().st_size > 0

    # The mix holds the training solutions, and no GSM8K test question.
    train = (out / "data" / "train.txt").read_text()
    assert results["data"]["math_documents"]["gsm8k"] == 60 and train.count("\nAnswer: ") >= 2 * (60 + 30)
    tests = [json.loads(line)["question"] for line in (shared_data / "gsm8k" / "test.jsonl").open()]
    assert not any(q.strip() in train for q in tests)
    assert results["tokens"]["train"] > 0 and results["tokenizer"]["vocab_size"] == 600

    # Pretraining learned something; each stage's accuracy is what its per-example file says.
    val = results["pretrain"]["val_loss"]
    assert val[-1][0] == 12 and val[-1][1] < val[0][1]
    assert set(results["gsm8k_test"]) == {"base", "base_question_only", "sft", "grpo"}
    assert "--template question_only" in results["commands"]["eval_base_question_only"][0]
    for name, summary in results["gsm8k_test"].items():
        rows = [json.loads(line) for line in (out / "eval" / f"{name}.jsonl").open()]
        assert summary["total"] == len(rows) == 3
        assert summary["accuracy"] == sum(r["answer_reward"] == 1.0 for r in rows) / 3
    assert (out / "grpo" / "policy" / "tokenizer").is_dir()
    assert [r["step"] for r in results["grpo"]["history"] if "reward_mean" in r] == [1]
    assert "--policy.path=" + str(out / "sft" / "policy") in results["commands"]["grpo"][0]

    # A second call skips every stage; --from reruns that stage and the later ones. Past the data
    # stage no book is read, so a machine without a .zst decompressor carries on.
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setattr(mm.shutil, "which", lambda name: None)
    capsys.readouterr()
    before = {s: (out / "stages" / f"{s}.json").read_text() for s in mm.STAGES}
    assert mm.main(["--scale", "tiny", "--out", str(out), "--data-dir", str(shared_data), "--from", "eval_grpo"]
                   + SHRINK) == 0
    assert capsys.readouterr().out.count("skipped") == len(mm.STAGES) - 1
    after = {s: (out / "stages" / f"{s}.json").read_text() for s in mm.STAGES}
    assert [s for s in mm.STAGES if before[s] != after[s]] == ["eval_grpo"]

    # An interrupted pretraining (checkpoints but no stage record) resumes instead of starting over.
    (out / "stages" / "pretrain.json").unlink()
    assert mm.main(["--scale", "tiny", "--out", str(out), "--data-dir", str(shared_data), "--until", "pretrain"]
                   + SHRINK) == 0
    record = json.loads((out / "stages" / "pretrain.json").read_text())
    assert record["commands"][0].endswith("--resume")


def test_a_failing_command_stops_the_pipeline_with_its_status(mm, shared_data, tmp_path, capsys):
    out = tmp_path / "run"
    code = mm.main(["--scale", "tiny", "--out", str(out), "--data-dir", str(shared_data), "--until", "tokenizer",
                    "--set", "books_mb=0.05", "gsm8k_limit=5", "math_limit=5", "vocab_size=100"])
    assert code == 1
    assert "`scratchlm train-bpe` exited with status" in capsys.readouterr().err
    assert (out / "stages" / "data.json").is_file() and not (out / "stages" / "tokenizer.json").exists()


@pytest.mark.slow
def test_tiny_scale_as_documented(mm, shared_data, tmp_path):
    out = tmp_path / "run"
    assert mm.main(["--scale", "tiny", "--out", str(out), "--data-dir", str(shared_data)]) == 0
    results = json.loads((out / "math_model.json").read_text())
    assert {s["total"] for s in results["gsm8k_test"].values()} == {mm.SCALES["tiny"].eval_limit}


@pytest.mark.parametrize("scale", ["tiny", "short", "full"])
def test_every_scale_gives_commands_their_configs_accept(mm, scale):
    """The full scale never runs on a CPU: its settings are checked against the commands' configs here."""
    from scratchlm.align.config import GRPORunConfig, SFTRunConfig
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    s = mm.SCALES[scale]
    train = load_config(TrainConfig, str(mm.PRESET), mm.overrides(s.pretrain) + [f"--model.vocab_size={s.vocab_size}"])
    sft = load_config(SFTRunConfig, "align-sft", mm.overrides(s.sft))
    grpo = load_config(GRPORunConfig, "align-grpo", mm.overrides(s.grpo))
    assert train.model.vocab_size == s.vocab_size and train.model.context_length >= 448
    assert sft.data.reward == grpo.data.reward == "r1_zero"
    if scale == "full":  # the shape the preset's comments and the page describe
        assert (train.model.context_length, train.model.d_model, train.model.num_layers) == (1024, 512, 8)
        assert train.trainer.batch_size * train.trainer.max_steps * train.model.context_length == 294_912_000
        assert grpo.sampling.max_new_tokens == s.eval_max_new_tokens == 384
