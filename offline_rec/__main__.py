"""`python -m offline_rec` (and `accelerate launch -m offline_rec train ...`) runs the CLI."""

from offline_rec.cli import run

if __name__ == "__main__":
    run()
