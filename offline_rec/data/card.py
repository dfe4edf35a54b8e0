"""Old import path of `offline_rec.dataset.card`: removed next release (docs/architecture.md)."""

import warnings

from offline_rec.dataset.card import *  # noqa: F403

warnings.warn("offline_rec.data.card moved to offline_rec.dataset.card; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
