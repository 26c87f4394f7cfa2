"""One module per parallel strategy; `scratchlm.parallel.registry` lists them by name."""
