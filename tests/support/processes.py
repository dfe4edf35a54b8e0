"""Child processes a test stops with Ctrl-C."""

from __future__ import annotations

import signal


def interruptible() -> None:
    """`preexec_fn` for a child the test stops with SIGINT: SIGINT back to its default action. A suite started in
    the background (`nohup`, `&` in a script) ignores SIGINT, every child inherits that, and Python then installs
    no KeyboardInterrupt handler: the child would never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
