"""offline-rec's performance benchmarks: each stage of the library measured against its limit or a peer.

`python -m benchmarks.run` (parts.py: every part and the keys it declares, measurements.py: how a key is declared),
`bash benchmarks/gpu.sh` on GPUs; docs/benchmarks.md reports the numbers. Run from the repository root. The
library (`offline_rec`) never imports this package.
"""
