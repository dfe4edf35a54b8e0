"""Preemption: a stop signal (SIGTERM, SIGINT, SIGUSR1) becomes a clean stop at the command's next safe point.

Clusters preempt and time-limit jobs with SIGTERM (or SIGUSR1 as an early warning), then SIGKILL
after a grace period. A long command runs inside `StopRequest()`: the handler only records the
first signal; the command finishes what is in flight (the training step, the groups being
written), saves it exactly as a periodic save would, and raises `Preempted`. The CLI then exits
with PREEMPTED_EXIT_CODE, which a job script reads as "stopped with everything saved: rerun with
--resume". Further signals while saving are recorded and ignored (the atomic writes keep the
previous state valid even if a SIGKILL follows), except a second Ctrl-C, which interrupts at once.
"""

from __future__ import annotations

import signal
import threading

PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL (sysexits.h): a temporary failure, try again: here, resume the run."""

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


class Preempted(Exception):
    """A command stopped on a signal after saving its progress; exit code PREEMPTED_EXIT_CODE."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class StopRequest:
    """Records the first stop signal while active (a context manager; the previous handlers come back on exit).

    Outside the main thread signal handlers cannot be set, and the request then stays inactive.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, number: int, frame) -> None:
        if self.signal_name is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user wants out now
        if self.signal_name is None:
            self.signal_name = signal.Signals(number).name
