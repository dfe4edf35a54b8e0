"""Every option of `offline-rec view`, once: `ViewConfig`, used by the CLI and the Python API alike.

Each field carries its default, its command-line flag(s) and its help line (the convention of
offline_rec/eval/config.py); the CLI builds its `view` options from them. Light on purpose: the
CLI imports it to declare its options.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from offline_rec.errors import UserError

DEFAULT_ALGORITHM = "rec-oneside-nois"


def _option(default, flags: tuple[str, ...], help: str):
    """A field with its command-line flags (first: the long one) and help line."""
    return dataclasses.field(default=default, metadata={"flags": flags, "help": help})


@dataclasses.dataclass
class ViewConfig:
    """Everything `offline-rec view` needs. Validated on construction (UserError)."""

    dataset: Path = dataclasses.field(default=Path("."), metadata={"help": "Dataset directory."})
    model: str | None = _option(
        None, ("--model",),
        "Policy to compare with the behavior: colour by rho = exp(logp - behavior_logp), mark clipped tokens.",
    )
    tokenizer: str | None = _option(
        None, ("--tokenizer",), "Tokenizer for the token text (default: --model's, else the manifest's behavior model)."
    )
    algorithm: str = _option(
        DEFAULT_ALGORITHM, ("--algorithm",), "Loss preset whose advantages and clip mask are shown."
    )
    out: Path | None = _option(
        None, ("--out", "-o"), "Write a page (HTML, plus a folder of page files next to it) to open from disk."
    )
    serve: bool = _option(False, ("--serve",), "Serve the page on a local HTTP server instead (Ctrl-C stops).")
    host: str = _option("127.0.0.1", ("--host",), "Address the --serve server listens on.")
    port: int = _option(8050, ("--port",), "Port of the --serve server (0: any free port).")
    groups_per_page: int = _option(20, ("--groups-per-page",), "Groups shown on one page of the viewer.")
    inline_pages: int = _option(1, ("--inline-pages",), "Page files written into the HTML itself (opens at once).")
    temperature: float | None = _option(
        None, ("--temperature",), "The policy's scoring temperature (default: the data's sampling temperature, else 1)."
    )
    batch_size: int = _option(8, ("--batch-size",), "Sequences per forward pass of --model.")
    dtype: str | None = _option(None, ("--dtype",), "--model's dtype: float32, bfloat16, float16 (default: saved).")
    device: str | None = _option(None, ("--device",), "--model's device, e.g. cuda (default: cpu).")

    def __post_init__(self):
        self.dataset = Path(self.dataset)
        if self.out is not None:
            self.out = Path(self.out)
        if self.serve == (self.out is not None):
            raise UserError("give exactly one of --out PAGE.html and --serve")
        if self.out is not None and self.out.suffix.lower() not in (".html", ".htm"):
            raise UserError(f"--out {self.out}: the page is an HTML file; give a name ending in .html")
        for name in ("groups_per_page", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.inline_pages < 0:
            raise UserError(f"--inline-pages must be >= 0, got {self.inline_pages}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be in 0..65535, got {self.port}")
        if self.temperature is not None and not self.temperature > 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        from offline_rec.algorithms import ALGORITHMS
        from offline_rec.errors import one_of

        if self.algorithm not in ALGORITHMS:
            raise one_of("algorithm", self.algorithm, ALGORITHMS)


def cli_options() -> list[dataclasses.Field]:
    """The fields the command line sets as options, in the order `offline-rec view --help` lists them."""
    return [field for field in dataclasses.fields(ViewConfig) if "flags" in field.metadata]
