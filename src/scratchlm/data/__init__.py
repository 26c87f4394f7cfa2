"""Token datasets: memory-mapped token files, batch sampling, the dataset registry and download.

Modules: ``batch`` (``open_tokens``, ``get_batch``, ``BatchSampler``, ``iterate_eval_batches``;
imports torch), ``registry``, ``download`` and ``corpus`` (the quickstart's train/validation
text; standard library only) and ``config`` (``DataConfig``). ``scratchlm encode`` and
``scratchlm download`` live in ``scratchlm.cli.data``. Nothing is imported here, so
``scratchlm download`` starts without torch.
"""
