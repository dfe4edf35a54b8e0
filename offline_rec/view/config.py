"""Every option of `offline-rec view`, once: `ViewConfig`, used by the CLI and the Python API alike.

Each field carries its default, its command-line flag(s) and its help line (`offline_rec.options`);
the CLI builds `view` from them. Light on purpose: the CLI imports it to declare its options.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.options import argument, option

DEFAULT_ALGORITHM = "rec-oneside-nois"


@dataclasses.dataclass
class ViewConfig:
    """Everything `offline-rec view` needs. Validated on construction (UserError)."""

    dataset: Path = argument(help="Dataset directory.")
    model: str | None = option(
        None, "--model",
        help="Policy to compare with the behavior: colour by rho = exp(logp - behavior_logp), mark clipped tokens.",
    )
    tokenizer: str | None = option(
        None, "--tokenizer",
        help="Tokenizer for the token text (default: --model's, else the manifest's behavior model).",
    )
    algorithm: str = option(
        DEFAULT_ALGORITHM, "--algorithm",
        help="Loss preset whose advantages and clip mask are shown.",
    )
    out: Path | None = option(
        None, "--out", "-o",
        help="Write a page (HTML, plus a folder of page files next to it) to open from disk.",
    )
    serve: bool = option(False, "--serve", help="Serve the page on a local HTTP server instead (Ctrl-C stops).")
    host: str = option("127.0.0.1", "--host", help="Address the --serve server listens on.")
    port: int = option(8050, "--port", help="Port of the --serve server (0: any free port).")
    groups_per_page: int = option(20, "--groups-per-page", help="Groups shown on one page of the viewer.")
    inline_pages: int = option(1, "--inline-pages", help="Page files written into the HTML itself (opens at once).")
    temperature: float | None = option(
        None, "--temperature",
        help="The policy's scoring temperature (default: the data's sampling temperature, else 1).",
    )
    batch_size: int = option(8, "--batch-size", help="Sequences per forward pass of --model.")
    dtype: str | None = option(None, "--dtype", help="--model's dtype: float32, bfloat16, float16 (default: saved).")
    device: str | None = option(None, "--device", help="--model's device, e.g. cuda (default: cpu).")

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
        from offline_rec.errors import one_of
        from offline_rec.loss.presets import PRESETS

        if self.algorithm not in PRESETS:
            raise one_of("algorithm", self.algorithm, PRESETS)

