"""offline-rec's research experiments and their results: what docs/paper.md reports, reproducible from here.

Run from the repository root, e.g. `python -m experiments.peers --quick --no-peers`. Every experiment runs on
`experiments.harness` (the demo's data, an arm trained and evaluated, results kept and resumed, tables); their
measured runs are in experiments/results/. The library (`offline_rec`) never imports this package.
"""
