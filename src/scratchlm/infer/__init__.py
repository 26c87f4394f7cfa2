"""Decoding: sampling filters, KV cache and batched generation; token ids only."""
