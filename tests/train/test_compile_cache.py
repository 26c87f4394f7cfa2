"""torch.compile's caches in a lasting directory: torch's own lookup honours it, and a second
compiled run of the same model reads the first one's compiled graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from scratchlm.train.compile_cache import compile_job_id, default_compile_cache_dir, use_compile_cache


@pytest.fixture
def torch_cache_settings(monkeypatch):
    """Whatever a test changes in the process-wide settings is put back."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with torch.compiler.config.patch(job_id=None):
        yield


def test_the_directory_is_where_inductor_looks(tmp_path, torch_cache_settings):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = use_compile_cache(str(tmp_path / "cc"), job_text="model A")
    assert path == (tmp_path / "cc").resolve() and path.is_dir()
    assert cache_dir() == str(path)
    assert torch.compiler.config.job_id == compile_job_id("model A") != compile_job_id("model B")


def test_empty_changes_nothing_and_a_named_job_is_kept(tmp_path, monkeypatch, torch_cache_settings):
    assert use_compile_cache("", job_text="x") is None
    assert torch.compiler.config.job_id is None
    torch.compiler.config.job_id = "mine"
    use_compile_cache(str(tmp_path), job_text="x")
    assert torch.compiler.config.job_id == "mine"


def test_a_later_model_in_the_same_process_gets_its_own_job(tmp_path, torch_cache_settings):
    # `scratchlm sweep` trains its points in one process: each model keeps its own shape profile
    use_compile_cache(str(tmp_path), job_text="model A")
    use_compile_cache(str(tmp_path), job_text="model B")
    assert torch.compiler.config.job_id == compile_job_id("model B")
    torch.compiler.config.job_id = "mine"  # one the user named stays
    use_compile_cache(str(tmp_path), job_text="model C")
    assert torch.compiler.config.job_id == "mine"


def test_auto_is_under_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compile_cache_dir() == tmp_path / "scratchlm" / "compile"


@pytest.mark.slow
def test_a_second_compiled_run_hits_the_first_runs_cache(tmp_path, torch_cache_settings):
    from torch._dynamo.utils import counters

    from scratchlm.cli.train import run_training
    from tests.train.small_runs import make_cfg

    cache = tmp_path / "compile"
    cfg = make_cfg(tmp_path, compile=True, compile_cache_dir=str(cache), max_steps=2, eval_interval=0,
                   checkpoint_interval=0, log_interval=1)
    hits = []
    for run in ("first", "second"):
        torch._dynamo.reset()
        counters.clear()
        run_training(replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / run))))
        hits.append(counters["inductor"]["fxgraph_cache_hit"])
    assert (cache / "fxgraph").is_dir()
    assert hits[0] == 0 and hits[1] > 0
