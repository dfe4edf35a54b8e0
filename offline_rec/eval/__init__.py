"""Evaluation: rollouts of a policy, off-policy estimates without generating, reports, and the training hooks."""
