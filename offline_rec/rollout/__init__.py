"""Sampling with a behavior policy: `collect` and its backends (transformers, vLLM)."""
