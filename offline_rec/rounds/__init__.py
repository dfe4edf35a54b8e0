"""`offline-rec rounds`: the loop a team runs with a deployed model, as one resumable command.

Deploy a policy, log what it answers (collect here, or logs that arrive from production), train on the logs of
the last W rounds, choose the next policy on validation prompts, evaluate it, deploy it, again. round_loop.py
reads top to bottom; config.py holds the options, prompt_plan.py which prompts each round asks, stages.py the library
commands each stage runs, deployment.py the one sampling engine the policies are loaded into, selection.py the
choice of the next policy, records.py each round's line of rounds.jsonl, run_folder.py where everything is
written. How a round maps to Trinity-RFT's sync_interval / sync_offset and to ReST's Grow / Improve steps:
docs/rounds.md.
"""
