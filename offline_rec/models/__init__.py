"""Models without a training loop: loading with clear errors, tiny models, chunked log-probs, policy versions."""
