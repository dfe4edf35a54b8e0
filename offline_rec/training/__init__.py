"""Offline training: configuration, the schedule and step plans, one optimizer step, checkpoints, the loop."""
