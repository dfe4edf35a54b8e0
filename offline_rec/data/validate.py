"""Old import path of `offline_rec.dataset.validate`: removed next release (docs/architecture.md)."""

import warnings

from offline_rec.dataset.validate import *  # noqa: F403

warnings.warn("offline_rec.data.validate moved to offline_rec.dataset.validate; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
