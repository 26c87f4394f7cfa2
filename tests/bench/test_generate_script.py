"""benchmarks/generate.py's choice of peers, checked before anything touches a GPU."""

import pytest

from tests.bench.test_scripts import load


def test_unknown_peer_names_are_refused_in_one_line(capsys):
    gen = load("generate")
    for flag in ("--skip", "--only"):
        with pytest.raises(SystemExit) as exc:
            gen.main([flag, "scratchlm_engine_graphs_compile", "hf_static_compile"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "unknown peer(s) hf_static_compile;" in err and "hf_generate_static_compile" in err


def test_only_and_skip_do_not_go_together(capsys):
    with pytest.raises(SystemExit):
        load("generate").main(["--only", "hf_generate_dynamic", "--skip", "scratchlm_engine_graphs"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_only_runs_the_named_peers_and_skips_every_other(monkeypatch):
    gen = load("generate")
    seen = {}

    def stop(*args, **kwargs):  # the first GPU step: record the parsed choice and stop there
        raise RuntimeError("stop")

    monkeypatch.setattr(gen, "copy_bandwidth", stop)
    real = gen.argparse.ArgumentParser.parse_args

    def parse(self, argv=None, namespace=None):
        seen["args"] = real(self, argv, namespace)
        return seen["args"]

    monkeypatch.setattr(gen.argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(RuntimeError, match="stop"):
        gen.main(["--only", "hf_generate_dynamic", "scratchlm_engine_graphs_compile"])
    skipped = set(seen["args"].skip)
    assert skipped == set(gen.BATCH1_PEERS) - {"hf_generate_dynamic", "scratchlm_engine_graphs_compile"}
