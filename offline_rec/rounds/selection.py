"""The choice of the policy the next round starts from: validation scores only, never the test prompts."""

from __future__ import annotations


def choose_next_policy(candidates: list[dict]) -> dict:
    """The candidate with the highest `validation_greedy_accuracy`, the later `step` on a tie.

    candidates: one dict per model of the round, step 0 being the policy the round started from and the others its
    training checkpoints; only "validation_greedy_accuracy" and "step" are read. On a tie the later step wins: a
    trained policy no worse on validation is preferred to the one it came from. Returns the chosen dict.
    """
    if not candidates:
        raise ValueError("no candidate policies to choose from")
    return max(candidates, key=lambda candidate: (candidate["validation_greedy_accuracy"], candidate["step"]))
