"""Token datasets: memory-mapped token files, batch sampling, the dataset registry and download.

Modules: ``batch`` (``open_tokens``, ``get_batch``, ``BatchSampler``, ``iterate_eval_batches``;
imports torch), ``registry`` and ``download`` (standard library only), ``config``
(``DataConfig``); ``scratchlm encode`` / ``scratchlm download`` live in ``scratchlm.cli.data``.
Nothing is imported here, so ``scratchlm download`` starts without torch.
"""
