from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scratchlm import cli
from scratchlm.errors import UserError


def test_help_lists_every_command(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_user_error_is_one_line(monkeypatch, capsys):
    def boom(argv):
        raise UserError("vocab_size must be at least 257")

    monkeypatch.setattr(cli, "_resolve", lambda name: boom)
    assert cli.main(["train-bpe"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "scratchlm train-bpe: error: vocab_size must be at least 257"


def test_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    def crash(argv):
        raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")

    monkeypatch.setattr(cli, "_resolve", lambda name: crash)
    monkeypatch.delenv("SCRATCHLM_DEBUG", raising=False)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("scratchlm train: error: RuntimeError: CUDA error: device-side assert triggered "
                   "(rerun with --debug for the traceback)")
    with pytest.raises(RuntimeError):
        cli.main(["train", "--debug"])
    monkeypatch.setenv("SCRATCHLM_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["train"])


def test_debug_flag_is_not_passed_to_the_command(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_resolve", lambda name: lambda argv: seen.append(argv) or 0)
    assert cli.main(["--debug", "account", "tiny-cpu", "--debug"]) == 0
    assert seen == [["tiny-cpu"]]


def test_missing_file_is_one_line(monkeypatch, capsys):
    def missing(argv):
        open("/nonexistent/corpus.txt")

    monkeypatch.setattr(cli, "_resolve", lambda name: missing)
    assert cli.main(["encode"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scratchlm encode: error: No such file or directory") and "\n" not in err


@pytest.mark.parametrize("command", [["encode", "{long}", "--tokenizer", "tok", "--out", "o.bin"],
                                     ["train-bpe", "{long}", "--vocab-size", "300", "--out", "tok"],
                                     ["tokenizer-stats", "{long}", "sample.txt"],
                                     ["account", "{long}"]])
def test_a_file_name_too_long_is_one_line(tmp_path, monkeypatch, capsys, command):
    # Stopped with "OSError: [Errno 36] File name too long ... (rerun with --debug for the traceback)".
    monkeypatch.chdir(tmp_path)
    long = "a" * 300 + ".txt"
    assert cli.main([word.format(long=long) for word in command]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"scratchlm {command[0]}: error: File name too long: {long}"


def test_every_command_resolves():
    """Each registered command names a function that exists."""
    for name in cli.COMMANDS:
        assert callable(cli._resolve(name)), name


def test_import_is_light_and_python_m_works():
    code = "import sys, scratchlm; import scratchlm.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "scratchlm", "--help"], capture_output=True, text=True, check=True)
    assert "usage: scratchlm" in out.stdout


def test_the_command_table_and_light_commands_import_no_torch():
    """`scratchlm --help` and the tokenizer, data and account commands start without torch."""
    code = ("import sys, scratchlm.cli, scratchlm.cli.tokenizer; from scratchlm.cli import _resolve; "
            "[_resolve(n) for n in ('train-bpe', 'tokenizer-stats', 'download', 'encode', 'account')]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-c", "import sys, scratchlm.cli; scratchlm.cli.main(['--help']); "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "False"


def test_output_reaches_a_pipe_line_by_line():
    # A long job's log must show up while it runs, also when stdout is a pipe (block-buffered).
    script = ("import time; from scratchlm import cli\n"
              "cli._resolve = lambda name: lambda argv: (print('step 1 | loss 4.2'), time.sleep(60))\n"
              "cli.main(['train'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=30), "no output within 30 s while the command runs"
        assert proc.stdout.readline().strip() == "step 1 | loss 4.2"
    finally:
        proc.kill()
        proc.wait()


def test_a_plain_ctrl_c_says_interrupted(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_resolve", lambda name: interrupted)
    assert cli.main(["encode"]) == 130
    assert capsys.readouterr().err == "scratchlm encode: interrupted\n"
