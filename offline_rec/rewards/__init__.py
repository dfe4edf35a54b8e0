"""Scoring a dataset into a new one (`offline-rec reward`): a task's reward function (rescore.py), a
sequence-classification reward model (loaded and run in sequence_classifier.py, scored over a dataset in
reward_model.py) and an LLM judge (judge.py); config.py holds the command's options. `rescore.reward_dataset`
dispatches to the one `RewardConfig` names."""
