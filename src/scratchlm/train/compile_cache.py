"""Where torch.compile keeps what it learns, so a second run of a model starts faster.

The first step of a compiled run pays for tracing (Dynamo), the joint forward/backward graph
(AOTAutograd), code generation and C++/Triton compilation (Inductor), and with
"max-autotune" for benchmarking kernel configurations. All but the tracing is cached on disk
by torch itself, keyed by the graph, the inputs' shapes and dtypes, the torch version and the
device, and all of it under one directory, Inductor's cache directory:

- the FX graph cache (compiled Inductor graphs, ``fxgraph/``) and the AOTAutograd cache
  (``aotautograd/``), both on by default;
- autotuning results (``torch._inductor.config.autotune_local_cache``) and Inductor's
  Triton kernels (``triton/<device>/``, unless ``TRITON_CACHE_DIR`` says otherwise);
- Dynamo's profile of which dimensions turned out dynamic (``dynamo/``), written only when
  ``torch.compiler.config.job_id`` names the job: with it, a run whose shapes vary (the
  sequence-length warm-up) compiles the dynamic graph at once instead of a static one first.

Torch's default directory is ``/tmp/torchinductor_<user>``: kept between runs on one machine
until /tmp is cleaned (at reboot on many systems, or with each job's fresh /tmp on clusters).
`trainer.compile_cache_dir` moves it somewhere lasting ("auto": ~/.cache/scratchlm/compile,
under ``$XDG_CACHE_HOME`` when set) and names the job so Dynamo's profile is kept. The default
(empty) leaves torch's settings alone. The caches are safe to share between runs: every entry is
keyed by what produced it, and a key that no longer matches is a miss, not a wrong kernel.

`torch.compiler.save_cache_artifacts` / `load_cache_artifacts` bundle the same entries into bytes
for carrying to another machine; with one lasting directory there is nothing for them to add.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("scratchlm.train")
_our_job_id: str | None = None  # the job name this module set last (a later model replaces it)


def default_compile_cache_dir() -> Path:
    """~/.cache/scratchlm/compile, or $XDG_CACHE_HOME/scratchlm/compile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scratchlm" / "compile"


def compile_job_id(text: str) -> str:
    """A stable job name for Dynamo's shape profile: what the compiled graphs depend on, hashed."""
    return "scratchlm-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def use_compile_cache(directory: str, *, job_text: str) -> Path | None:
    """Keep torch.compile's caches in `directory` ("auto": `default_compile_cache_dir()`; ""
    changes nothing and returns None). `job_text` (e.g. the model config and the compile
    options) names the job for Dynamo's profile unless ``torch.compiler.config.job_id`` was set
    by someone else (a job name from an earlier call, another model of the same process, is replaced).

    Call before the first compilation: it sets ``TORCHINDUCTOR_CACHE_DIR`` for this process.
    """
    if not directory:
        return None
    import torch

    path = default_compile_cache_dir() if directory == "auto" else Path(directory).expanduser()
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    global _our_job_id
    if torch.compiler.config.job_id in (None, _our_job_id):
        _our_job_id = torch.compiler.config.job_id = compile_job_id(job_text)
    log.info("torch.compile caches in %s", path)
    return path
