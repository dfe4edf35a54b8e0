"""Old import path of `offline_rec.dataset.format`: removed next release (docs/architecture.md)."""

import warnings

from offline_rec.dataset.format import *  # noqa: F403

warnings.warn("offline_rec.data.dataset moved to offline_rec.dataset.format; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
