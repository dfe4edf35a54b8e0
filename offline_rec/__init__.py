"""offline-rec: offline RL for LLMs from logged trajectories (regularized group-relative REINFORCE).

Importing the package is cheap: no torch, transformers or vLLM are imported here.
"""

__version__ = "0.1.0"
