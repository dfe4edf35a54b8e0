"""The Hugging Face Hub: push and pull datasets, resolve hf:// dataset paths, publish trained policies."""
