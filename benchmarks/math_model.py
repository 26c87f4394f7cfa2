"""Our own math model, end to end: pretrain on books and math solutions, then SFT and GRPO on GSM8K.

    python benchmarks/math_model.py --scale tiny --out runs/math-model-tiny       # CPU, a few minutes
    python benchmarks/math_model.py --scale full --out runs/math-model \
        --json docs/benchmarks/math_model.json --plot docs/benchmarks/math_model.png
    python benchmarks/math_model.py --scale full --out runs/math-model --from sft --set sft.optim.lr=1e-4
    python benchmarks/math_model.py --scale full --out runs/math-model --until pretrain

Stages, each recorded in OUT/stages/NAME.json when it succeeds and skipped on a later call
while that record exists (`--from STAGE` reruns a stage and every one after it):

1. data: the Project Gutenberg training books (../shared/data/gutenberg/train_*.txt.zst) and
   the GSM8K and MATH *training* sets as "question + worked solution" documents (in the
   question_only format: "{question}\nAnswer: {solution}\n#### {answer}"), the math
   documents repeated `math_repeat` times and spread evenly between the books, joined by
   <|endoftext|>; validation text is the held-out Gutenberg books. No test problem is read
   into the mix (any training problem equal to a test problem is dropped and counted).
2. tokenizer: `scratchlm train-bpe` on the first `tokenizer_sample_mb` MB of the mix (the
   interleaving makes any prefix a fair sample of it).
3. encode: `scratchlm encode` of the training and validation text.
4. pretrain: `scratchlm train configs/math-lm.toml` with the scale's overrides; an
   interrupted run resumes from its last checkpoint.
5. eval_base, eval_sft, eval_grpo: `scratchlm eval-math` on the GSM8K test set (r1_zero
   prompt, greedy) of the pretrained model, the SFT policy and the GRPO policy;
   eval_base_question_only grades the pretrained model in the format of its math documents
   (`--template question_only`: the question, "Answer:", the number after "####").
6. sft: `scratchlm sft align-sft` on GSM8K train (r1_zero format, loss on the response).
7. grpo: `scratchlm grpo align-grpo` on GSM8K train from the SFT policy.

The commands run in this process through the `scratchlm` command-line entry point and are
printed as they run, so each stage can be rerun by hand. At the end the results of every
stage that has run (settings, data mix, losses and rewards by step, GSM8K accuracy as
measured) go into one JSON file, and the curves into one PNG.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError

EOT = "<|endoftext|>"
REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "math-lm.toml"
STAGES = ("data", "tokenizer", "encode", "pretrain", "eval_base", "eval_base_question_only", "sft", "eval_sft",
          "grpo", "eval_grpo")
EVALS = {"base": "pretrained, r1_zero", "base_question_only": "pretrained, question_only",
         "sft": "after SFT, r1_zero", "grpo": "after GRPO, r1_zero"}


@dataclass
class Scale:
    """Sizes of one run. The three dicts are dotted overrides (``section.key``) of the commands'
    own presets: `scratchlm train configs/math-lm.toml`, `scratchlm sft align-sft`,
    `scratchlm grpo align-grpo`."""

    book_files: list[str]  # Gutenberg training files used
    books_mb: float  # decompressed MB taken from the start of each book file (0 = all)
    valid_mb: float  # MB of the held-out books used for validation (0 = all)
    gsm8k_limit: int  # GSM8K training problems in the mix (0 = all 7,473)
    math_limit: int  # MATH training problems in the mix (0 = all 7,500)
    math_repeat: int  # times each math document appears in the mix
    tokenizer_sample_mb: float  # millions of characters (about MB) of the mix the BPE trains on (0 = all)
    vocab_size: int
    pretrain: dict[str, Any]
    sft: dict[str, Any]
    grpo: dict[str, Any]
    eval_limit: int  # GSM8K test problems graded at each eval stage (0 = all 1,319)
    eval_max_new_tokens: int
    eval_batch_size: int
    threads: int = 0  # torch threads on a CPU (0 = leave as is)
    notes: list[str] = field(default_factory=list)


# The full scale's SFT and GRPO settings; the short scale takes them with fewer epochs and less time.
# 3 epochs of the 7,473 worked solutions at 64 per step (~350 steps); a model trained from
# scratch takes a far larger learning rate than the preset's (made for large pretrained ones).
FULL_SFT = {"data.eval_limit": 200, "data.reward": "r1_zero", "sft.micro_batch_size": 32, "sft.grad_accum_steps": 2,
    "sft.num_epochs": 3.0, "sft.log_every": 10, "optim.lr": 3e-4, "optim.warmup_steps": 20,
    "optim.min_lr_ratio": 0.1, "sampling.batch_size": 256, "sampling.eval_max_new_tokens": 384,
    "run.progress": False}
# 32 questions x 8 samples per step, on-policy, a moderate learning rate after a warm-up
# (docs/benchmarks/post_training.md), stopped by wall time after 10 minutes.
FULL_GRPO = {"data.eval_limit": 200, "data.reward": "r1_zero", "grpo.n_grpo_steps": 400,
    "grpo.rollout_batch_size": 256, "grpo.group_size": 8, "grpo.train_batch_size": 256,
    "grpo.grad_accum_steps": 8, "grpo.eval_every": 25, "grpo.max_seconds": 600.0, "optim.lr": 3e-5,
    "optim.warmup_steps": 10, "optim.min_lr_ratio": 1.0, "sampling.temperature": 1.0,
    "sampling.max_new_tokens": 384, "sampling.eval_max_new_tokens": 384, "sampling.batch_size": 256,
    "run.progress": False}


SCALES = {
    # A check of the plumbing on a CPU: small slices of every source, a 0.1M-parameter model, a
    # few steps of each stage. Its accuracies are 0 and mean nothing.
    "tiny": Scale(
        book_files=["train_00.txt.zst"], books_mb=0.3, valid_mb=0.05, gsm8k_limit=200, math_limit=100,
        math_repeat=2, tokenizer_sample_mb=0, vocab_size=1024,
        pretrain={"model.context_length": 512, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 2,
                  "model.d_ff": 192, "model.attention_backend": "math", "trainer.batch_size": 4,
                  "trainer.max_steps": 30, "trainer.log_interval": 10, "trainer.eval_interval": 15,
                  "trainer.eval_batches": 2, "trainer.checkpoint_interval": 15, "trainer.compile": False,
                  "trainer.sample_tokens": 0, "trainer.progress": False, "optim.lr": 3e-3, "optim.min_lr": 3e-4,
                  "optim.warmup_steps": 3},
        sft={"data.limit": 32, "data.eval_limit": 2, "data.reward": "r1_zero", "sft.micro_batch_size": 4,
             "sft.grad_accum_steps": 1, "sft.max_steps": 6, "sft.log_every": 2, "optim.lr": 1e-3,
             "optim.warmup_steps": 1, "sampling.batch_size": 8, "sampling.eval_max_new_tokens": 16,
             "run.progress": False},
        grpo={"data.limit": 16, "data.eval_limit": 2, "data.reward": "r1_zero", "grpo.n_grpo_steps": 2,
              "grpo.rollout_batch_size": 8, "grpo.group_size": 4, "grpo.train_batch_size": 8,
              "grpo.grad_accum_steps": 2, "grpo.eval_every": 1, "optim.lr": 1e-4, "sampling.max_new_tokens": 16,
              "sampling.eval_max_new_tokens": 16, "sampling.batch_size": 8, "run.progress": False},
        eval_limit=6, eval_max_new_tokens=16, eval_batch_size=8, threads=1,
    ),
    # One GPU, ~7 minutes in all (6.6 on an H100): the full recipe cut to fit one short GPU slot.
    # The first 100 MB of train_00 (so a copy of just that prefix, about 31 MB compressed, is all
    # the books it reads); pretraining for 215 s of wall time, compilation included, the schedule
    # following the clock; two epochs of SFT; 100 s of GRPO.
    "short": Scale(
        book_files=["train_00.txt.zst"], books_mb=100, valid_mb=0, gsm8k_limit=0, math_limit=0, math_repeat=4,
        tokenizer_sample_mb=64, vocab_size=16384,
        pretrain={"trainer.progress": False, "trainer.max_steps": 100_000, "trainer.time_budget_s": 215.0,
                  "optim.warmup_steps": 100, "trainer.eval_interval": 500, "trainer.checkpoint_interval": 1000},
        sft={**FULL_SFT, "sft.num_epochs": 2.0},
        grpo={**FULL_GRPO, "grpo.max_seconds": 100.0},
        eval_limit=0, eval_max_new_tokens=384, eval_batch_size=256,
    ),
    # One GPU (H100/H200): ~40 minutes in all, about 15 of them pretraining (configs/math-lm.toml).
    "full": Scale(
        book_files=["train_00.txt.zst", "train_01.txt.zst"], books_mb=0, valid_mb=0, gsm8k_limit=0,
        math_limit=0, math_repeat=4, tokenizer_sample_mb=64, vocab_size=16384,
        pretrain={"trainer.progress": False},
        sft=FULL_SFT,
        grpo=FULL_GRPO,
        eval_limit=0, eval_max_new_tokens=384, eval_batch_size=256,
    ),
}


# ----------------------------------------------------------------------------------- data

def decompressor() -> str:
    """"zstandard" (the Python package) when it imports, else "zstd" (the program) when on PATH."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return "zstandard"
    if shutil.which("zstd"):
        return "zstd"
    raise UserError("reading the .zst books needs the zstandard Python package (pip install zstandard) "
                    "or the zstd program (apt-get install zstd); install one of them")


def _read_stream(stream: Any, max_bytes: int) -> bytes:
    if not max_bytes:
        return stream.read()
    parts, size = [], 0
    while size < max_bytes:
        chunk = stream.read(min(1 << 20, max_bytes - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def read_zst(path: Path, max_bytes: int = 0) -> str:
    """The decompressed UTF-8 text of `path`, or its first `max_bytes` cut at a document (or
    line) boundary."""
    if not path.is_file():
        raise UserError(f"{path} not found; the shared data folder (see ../shared/data/README.md) is needed")
    if decompressor() == "zstandard":
        import zstandard

        with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as reader:
            data = _read_stream(reader, max_bytes + 1 if max_bytes else 0)
    else:
        with subprocess.Popen(["zstd", "-dc", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            data = _read_stream(proc.stdout, max_bytes + 1 if max_bytes else 0)
            proc.stdout.close()
            if max_bytes:
                proc.kill()  # the rest of the file is not wanted
            elif proc.wait() != 0:
                raise UserError(f"zstd could not decompress {path}: {proc.stderr.read().decode(errors='replace')}")
    text = data[:max_bytes].decode("utf-8", errors="ignore") if max_bytes else data.decode("utf-8")
    if max_bytes and len(data) > max_bytes:
        cut = text.rfind(EOT)
        cut = cut if cut > len(text) // 2 else text.rfind("\n")
        text = text[:cut] if cut > 0 else text
    return text


def split_documents(text: str) -> list[str]:
    """The non-empty documents of a text joined by <|endoftext|>."""
    return [d.strip() for d in text.split(EOT) if d.strip()]


def math_documents(data_dir: Path, *, gsm8k_limit: int, math_limit: int) -> tuple[list[str], dict[str, int]]:
    """GSM8K and MATH training problems with their worked solutions as text documents, and counts.

    A document is the question_only prompt and response ("{question}\nAnswer: {solution}",
    GSM8K's ending "\n#### {answer}"), so the pretrained model can be graded in the format it
    read. A training problem whose text is also a test problem (of either set) is left out, so
    that nothing graded later was seen in pretraining."""
    from scratchlm.align.datasets import load_examples
    from scratchlm.align.prompts import get_template

    template = get_template("question_only")
    test_questions = {ex.question.strip() for name in ("gsm8k", "math")
                      for ex in load_examples(name, "test", data_dir=data_dir)}
    docs, counts = [], {"gsm8k": 0, "math": 0, "dropped_equal_to_a_test_problem": 0}
    for name, limit in (("gsm8k", gsm8k_limit), ("math", math_limit)):
        for ex in load_examples(name, "train", data_dir=data_dir, limit=limit or None):
            if ex.question.strip() in test_questions:
                counts["dropped_equal_to_a_test_problem"] += 1
                continue
            if name == "gsm8k":  # the reasoning without calculator annotations, as SFT sees it
                doc = template.format(ex.question) + template.response(ex.reasoning, ex.answer)
            else:  # the solution ends in its \boxed{} answer
                doc = f"{template.format(ex.question)} {ex.reasoning.strip()}"
            docs.append(doc.replace(EOT, ""))
            counts[name] += 1
    return docs, counts


def mix_documents(books: list[str], math_docs: list[str], *, repeat: int, seed: int) -> list[str]:
    """The books in order with `repeat` shuffled copies of the math documents spread evenly
    between them, so every stretch of the mix holds about the same share of math.

    Example: 2 books, 3 math documents, repeat 2 -> book, 3 math, book, 3 math (6 in all)."""
    rng = random.Random(seed)
    pool = []
    for _ in range(repeat):
        copy_ = list(math_docs)
        rng.shuffle(copy_)
        pool += copy_
    if not books:
        return pool
    mixed = []
    for i, book in enumerate(books):
        mixed.append(book)
        mixed += pool[i * len(pool) // len(books):(i + 1) * len(pool) // len(books)]
    return mixed


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def prepare_data(scale: Scale, data_dir: Path, out: Path, seed: int) -> dict[str, Any]:
    """Write out/data/{train,valid,tokenizer_sample}.txt; returns what the mix holds."""
    out.mkdir(parents=True, exist_ok=True)
    gutenberg = data_dir / "gutenberg"
    books: list[str] = []
    for name in scale.book_files:
        books += split_documents(read_zst(gutenberg / name, int(scale.books_mb * 1e6)))
        print(f"  {name}: {len(books)} book documents so far", flush=True)
    math_docs, counts = math_documents(data_dir, gsm8k_limit=scale.gsm8k_limit, math_limit=scale.math_limit)
    mixed = mix_documents(books, math_docs, repeat=scale.math_repeat, seed=seed)
    train = EOT.join(mixed)
    write_atomic(out / "train.txt", train)
    valid = EOT.join(split_documents(read_zst(gutenberg / "valid.txt.zst", int(scale.valid_mb * 1e6))))
    write_atomic(out / "valid.txt", valid)
    sample_bytes = int(scale.tokenizer_sample_mb * 1e6)
    if sample_bytes and sample_bytes < len(train):
        cut = train.rfind(EOT, 0, sample_bytes)
        write_atomic(out / "tokenizer_sample.txt", train[:cut if cut > 0 else sample_bytes])
    else:  # the tokenizer trains on all of train.txt; no sample of an earlier call may stand in
        (out / "tokenizer_sample.txt").unlink(missing_ok=True)
    book_bytes = sum(len(b.encode("utf-8")) for b in books)
    math_bytes = sum(len(d.encode("utf-8")) for d in math_docs) * scale.math_repeat
    return {"book_documents": len(books), "math_documents": counts, "math_repeat": scale.math_repeat,
            "train_bytes": len(train.encode("utf-8")), "book_bytes": book_bytes, "math_bytes": math_bytes,
            "math_share_of_bytes": math_bytes / max(book_bytes + math_bytes, 1),
            "valid_bytes": len(valid.encode("utf-8")), "decompressor": decompressor()}


# ----------------------------------------------------------------------------------- stages

class StageFailed(Exception):
    """A `scratchlm` command of a stage failed (it has printed why)."""


def run_scratchlm(argv: list[str]) -> str:
    """Run one `scratchlm` command in this process, printed first; a failure stops the pipeline.
    Returns the command line."""
    from scratchlm.cli import main as scratchlm_main

    line = f"scratchlm {shlex.join(argv)}"
    print(f"$ {line}", flush=True)
    code = scratchlm_main(argv)
    if code:
        raise StageFailed(f"`scratchlm {argv[0]}` exited with status {code} (its message is above)")
    return line


def overrides(values: dict[str, Any]) -> list[str]:
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)
    return [f"--{key}={text(value)}" for key, value in values.items()]


def apply_set(scale: Scale, assignment: str) -> None:
    """``--set`` one setting: ``FIELD=VALUE`` for the scale's own fields (typed like the value
    they replace), ``pretrain|sft|grpo.SECTION.KEY=VALUE`` for a command's override."""
    if "=" not in assignment:
        raise UserError(f"--set expects KEY=VALUE, got {assignment!r}")
    key, value = assignment.split("=", 1)
    stage, _, rest = key.partition(".")
    if stage in ("pretrain", "sft", "grpo") and "." in rest:
        getattr(scale, stage)[rest] = value
        return
    if key not in Scale.__dataclass_fields__ or isinstance(getattr(scale, key), (dict, list)):
        raise UserError(f"--set: unknown setting {key!r} (a scale field, or pretrain|sft|grpo.section.key)")
    current = getattr(scale, key)
    setattr(scale, key, value.lower() in ("1", "true", "yes") if isinstance(current, bool) else type(current)(value))


class Pipeline:
    """The stages of one run in `out`; each writes `out/stages/NAME.json` when it succeeds."""

    def __init__(self, scale: Scale, out: Path, *, data_dir: Path, device: str, seed: int) -> None:
        self.scale, self.out, self.data_dir, self.device, self.seed = scale, out, data_dir, device, seed
        self.data = out / "data"
        self.tokenizer = out / "tokenizer"
        self.pretrain_dir = out / "pretrain"
        self.commands: list[str] = []  # the command lines of the stage that runs

    def scratchlm(self, argv: list[str]) -> None:
        self.commands.append(run_scratchlm(argv))

    def record_path(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.json"

    def run(self, stages: list[str], redo: set[str]) -> None:
        for stage in stages:
            record = self.record_path(stage)
            if record.is_file() and stage not in redo:
                print(f"[{stage}] done before ({record}); skipped", flush=True)
                continue
            print(f"[{stage}]", flush=True)
            start = time.perf_counter()
            self.commands = []
            info = getattr(self, f"stage_{stage}")(redone=record.is_file()) or {}
            record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record, json.dumps({"stage": stage, "seconds": time.perf_counter() - start,
                                             "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                             "commands": self.commands, **info},
                                            indent=1) + "\n")

    def stage_data(self, redone: bool) -> dict[str, Any]:
        mix = prepare_data(self.scale, self.data_dir, self.data, self.seed)
        print(f"  mix: {mix['book_documents']} book documents ({mix['book_bytes'] / 1e6:.1f} MB), "
              f"{mix['math_documents']} math documents x {mix['math_repeat']} ({mix['math_bytes'] / 1e6:.1f} MB, "
              f"{100 * mix['math_share_of_bytes']:.1f}% of the bytes); validation {mix['valid_bytes'] / 1e6:.2f} MB",
              flush=True)
        return {"mix": mix}

    def stage_tokenizer(self, redone: bool) -> dict[str, Any]:
        sample = self.data / "tokenizer_sample.txt"
        sample = sample if sample.is_file() else self.data / "train.txt"
        self.scratchlm(["train-bpe", str(sample), "--vocab-size", str(self.scale.vocab_size),
                       "--special-token", EOT, "--out", str(self.tokenizer), "--overwrite", "--quiet"])
        return {"train_bpe": json.loads((self.tokenizer / "train_bpe.json").read_text(encoding="utf-8"))}

    def stage_encode(self, redone: bool) -> dict[str, Any]:
        for split in ("train", "valid"):
            self.scratchlm(["encode", str(self.data / f"{split}.txt"), "--tokenizer", str(self.tokenizer),
                           "--out", str(self.data / f"{split}.bin"), "--overwrite", "--no-progress"])
        return {split: json.loads((self.data / f"{split}.json").read_text(encoding="utf-8"))
                for split in ("train", "valid")}

    def stage_pretrain(self, redone: bool) -> dict[str, Any]:
        from scratchlm.tokenizer.tokenizer import Tokenizer

        vocab = Tokenizer.load(self.tokenizer).vocab_size
        argv = ["train", str(PRESET), f"--data.train_path={self.data / 'train.bin'}",
                f"--data.val_path={self.data / 'valid.bin'}", f"--data.tokenizer_dir={self.tokenizer}",
                f"--trainer.out_dir={self.pretrain_dir}", f"--trainer.device={self.device}",
                f"--trainer.seed={self.seed}", f"--model.vocab_size={vocab}"] + overrides(self.scale.pretrain)
        checkpoints = self.pretrain_dir / "checkpoints"
        if not redone and checkpoints.is_dir() and any(checkpoints.glob("step_*")):
            argv.append("--resume")  # an interrupted run continues where it stopped
        elif self.pretrain_dir.exists():
            argv.append("--overwrite")
        self.scratchlm(argv)
        return {}

    def _eval(self, name: str, model: Path, template: str = "r1_zero") -> dict[str, Any]:
        out = self.out / "eval" / f"{name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = ["eval-math", str(model), "--dataset", "gsm8k", "--split", "test", "--data-dir", str(self.data_dir),
                "--out", str(out), "--max-new-tokens", str(self.scale.eval_max_new_tokens),
                "--batch-size", str(self.scale.eval_batch_size), "--device", self.device, "--seed", str(self.seed),
                "--template", template]
        if self.scale.eval_limit:
            argv += ["--limit", str(self.scale.eval_limit)]
        self.scratchlm(argv)
        return {"summary": json.loads(out.with_suffix(".summary.json").read_text(encoding="utf-8"))}

    def _align(self, command: str, preset: str, policy: Path, out_dir: Path, settings: dict[str, Any]) -> None:
        if out_dir.exists():
            shutil.rmtree(out_dir)  # the command starts afresh; a half-written folder is not reused
        self.scratchlm([command, preset, f"--policy.path={policy}", f"--policy.device={self.device}",
                       "--data.dataset=gsm8k", "--data.split=train", f"--data.data_dir={self.data_dir}",
                       "--data.template=r1_zero", f"--run.out_dir={out_dir}", f"--run.seed={self.seed}"]
                      + overrides(settings))

    def stage_eval_base(self, redone: bool) -> dict[str, Any]:
        return self._eval("base", self.pretrain_dir)

    def stage_eval_base_question_only(self, redone: bool) -> dict[str, Any]:
        return self._eval("base_question_only", self.pretrain_dir, template="question_only")

    def stage_sft(self, redone: bool) -> dict[str, Any]:
        self._align("sft", "align-sft", self.pretrain_dir, self.out / "sft", self.scale.sft)
        return {}

    def stage_eval_sft(self, redone: bool) -> dict[str, Any]:
        return self._eval("sft", self.out / "sft" / "policy")

    def stage_grpo(self, redone: bool) -> dict[str, Any]:
        self._align("grpo", "align-grpo", self.out / "sft" / "policy", self.out / "grpo", self.scale.grpo)
        return {}

    def stage_eval_grpo(self, redone: bool) -> dict[str, Any]:
        return self._eval("grpo", self.out / "grpo" / "policy")


# ----------------------------------------------------------------------------------- results

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def collect_results(out: Path, scale_name: str, scale: Scale, device: str) -> dict[str, Any]:
    """Everything the stages left in `out`, as one dict (stages that have not run are absent)."""
    import torch

    stages = {}
    for stage in STAGES:
        path = out / "stages" / f"{stage}.json"
        if path.is_file():
            stages[stage] = json.loads(path.read_text(encoding="utf-8"))
    results: dict[str, Any] = {
        "scale": scale_name, "device": device, "settings": asdict(scale),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "stage_seconds": {s: round(r["seconds"], 1) for s, r in stages.items()},
        "commands": {s: r.get("commands", []) for s, r in stages.items()},
    }
    if "data" in stages:
        results["data"] = stages["data"]["mix"]
    if "tokenizer" in stages:
        t = stages["tokenizer"]["train_bpe"]
        results["tokenizer"] = {k: t[k] for k in ("vocab_size", "input_bytes", "tokenizer_hash") if k in t}
    if "encode" in stages:
        results["tokens"] = {split: stages["encode"][split].get("num_tokens") for split in ("train", "valid")}
    pre = read_jsonl(out / "pretrain" / "metrics.jsonl")
    if pre:
        train = [r for r in pre if r.get("event") == "train"]
        evals = [r for r in pre if r.get("event") == "eval"]
        results["pretrain"] = {
            "train_loss": [[r["step"], r["loss"]] for r in train],
            "val_loss": [[r["step"], r["val_loss"]] for r in evals],
            "final_val_loss": evals[-1]["val_loss"] if evals else None,
            "steps": train[-1]["step"] if train else 0,
            "tokens_per_s": [r.get("tokens_per_s") for r in train][-1] if train else None,
        }
    for name in ("sft", "grpo"):
        rows = read_jsonl(out / name / "metrics.jsonl")
        if rows:
            results[name] = {"history": rows}
    results["gsm8k_test"] = {name: stages[f"eval_{name}"]["summary"] for name in EVALS if f"eval_{name}" in stages}
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'GSM8K test, greedy':<32}{'problems':>10}{'accuracy':>10}{'format':>10}")
    for name, s in results["gsm8k_test"].items():
        print(f"{EVALS[name]:<32}{s['total']:>10}{100 * s['accuracy']:>9.2f}%{100 * s['format_rate']:>9.2f}%")
    if results.get("pretrain", {}).get("final_val_loss") is not None:
        print(f"pretraining: {results['pretrain']['steps']} steps, "
              f"final validation loss {results['pretrain']['final_val_loss']:.4f} (held-out Gutenberg books)")
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in results["stage_seconds"].items()))


def plot_curves(results: dict[str, Any], path: Path) -> None:
    """Pretraining loss, SFT loss, GRPO reward and held-out accuracy, GSM8K accuracy by stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    pre = results.get("pretrain", {})
    if pre.get("train_loss"):
        ax.plot(*zip(*pre["train_loss"]), label="train")
    if pre.get("val_loss"):
        ax.plot(*zip(*pre["val_loss"]), "o-", label="validation (held-out books)")
    ax.set_title("pretraining loss")
    ax.set_xlabel("step")
    ax = axes[0][1]
    sft = [r for r in results.get("sft", {}).get("history", []) if "loss" in r]
    if sft:
        ax.plot([r["step"] for r in sft], [r["loss"] for r in sft])
    ax.set_title("SFT loss (response tokens, GSM8K train)")
    ax.set_xlabel("step")
    ax = axes[1][0]
    grpo = results.get("grpo", {}).get("history", [])
    steps = [r for r in grpo if "reward_mean" in r]
    if steps:
        ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="rollout reward")
        ax.plot([r["step"] for r in steps], [r["format_reward_mean"] for r in steps], label="rollout format reward")
    evals = [r for r in grpo if "eval_accuracy" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
                label="GSM8K test accuracy (subset)")
    ax.set_title("GRPO")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.05)
    ax = axes[1][1]
    names = list(results.get("gsm8k_test", {}))
    if names:
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [100 * results["gsm8k_test"][n]["accuracy"] for n in names], 0.4,
               label="accuracy")
        ax.bar([x + 0.2 for x in xs], [100 * results["gsm8k_test"][n]["format_rate"] for n in names], 0.4,
               label="format")
        ax.set_xticks(list(xs), [EVALS[n].replace(", ", "\n") for n in names])
        top = max(100 * max(s[k] for s in results["gsm8k_test"].values()) for k in ("accuracy", "format_rate"))
        ax.set_ylim(0, max(5.0, 1.2 * top))  # accuracies of a few percent stay visible
    ax.set_title("GSM8K test (%), as measured")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"math model, {results['scale']} scale on {results['machine']['gpu'] or 'CPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main

def default_data_dir() -> Path:
    """``shared/data`` beside the repository, else inside it (where a copy of the tree carries it)."""
    for candidate in (REPO.parent / "shared" / "data", REPO / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return REPO.parent / "shared" / "data"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    parser.add_argument("--out", default=None, help="working directory of the run (default runs/math-model-SCALE)")
    parser.add_argument("--data-dir", default=str(default_data_dir()),
                        help="folder holding gutenberg/, gsm8k/ and math/ (default: shared/data beside the "
                             "repository, or inside it)")
    parser.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from", dest="from_stage", choices=STAGES, default=None,
                        help="rerun this stage and every later one even if they are done")
    parser.add_argument("--until", choices=STAGES, default=STAGES[-1], help="stop after this stage")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override a setting: a scale field (math_repeat=8) or a command's "
                             "(pretrain.trainer.max_steps=2000, sft.optim.lr=1e-4, grpo.data.reward=gsm8k_last_number)")
    parser.add_argument("--json", default=None, help="results file (default OUT/math_model.json)")
    parser.add_argument("--plot", default=None, help="curves (default OUT/math_model.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = copy.deepcopy(SCALES[args.scale])
    out = Path(args.out or f"runs/math-model-{args.scale}")
    try:
        for assignment in args.set:
            apply_set(scale, assignment)
        data_dir = Path(args.data_dir)
        if not (data_dir / "gsm8k").is_dir():
            raise UserError(f"--data-dir {data_dir} has no gsm8k/ folder; point it at the shared data folder")
        stages = list(STAGES[:STAGES.index(args.until) + 1])
        redo = set(STAGES[STAGES.index(args.from_stage):]) if args.from_stage else set()
        pipeline = Pipeline(scale, out, data_dir=data_dir, device=args.device, seed=args.seed)
        if "data" in redo or not pipeline.record_path("data").is_file():
            decompressor()  # fail before any work when the books cannot be read (only the data stage reads them)
        if scale.threads:
            import torch

            torch.set_num_threads(scale.threads)  # tiny models: one thread beats a contended pool
        started = time.perf_counter()
        pipeline.run(stages, redo)
    except (UserError, StageFailed) as exc:
        print(f"math_model: error: {exc}", file=sys.stderr)
        return 1
    results = collect_results(out, args.scale, scale, args.device)
    results["seconds_this_call"] = time.perf_counter() - started
    print_table(results)
    json_path = Path(args.json or out / "math_model.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plot_path = Path(args.plot or out / "math_model.png")
    try:
        plot_curves(results, plot_path)
    except ImportError as exc:
        print(f"no plot ({exc})")
    print(f"results: {json_path}, curves: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
