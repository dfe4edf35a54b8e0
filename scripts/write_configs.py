"""Write configs/NAME.yaml of every preset (offline_rec/loss/presets.py `PRESETS`), the presets' recipes as
`offline-rec train --config` files. The presets are their only source: change one there, then run

    python scripts/write_configs.py [FOLDER]        # FOLDER: configs/ of this checkout by default

tests/training/test_config.py fails while a file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from offline_rec.loss.presets import PRESETS
from offline_rec.training.recipes import write_config_files

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else CONFIGS
    for path in write_config_files(folder, PRESETS):
        print(path)
