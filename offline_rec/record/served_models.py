"""Which checkpoint answered a call: the upstream's served model list (served name -> `root` in /v1/models, the path
or hub id it was loaded from), looked up again whenever the proxy opens a new connection to the upstream.

A vLLM restarted with other weights under the same `--served-model-name` (the deploy -> log -> train loop) has
closed every connection of the process it replaced, so a call the new process answers travels on a connection
opened after the restart. A line is therefore named from a lookup SENT after the newest connection the proxy had
opened when its call's answer began (`root`; at least as new as the call's own). Each new connection starts a
lookup (`connector`), which runs while the upstream generates, so a call waits for it only when its answer comes
first; calls on kept-alive connections wait for nothing. Lookups never overlap (connections opened during one are
covered by the next) and go over the proxy's own session, whose connections start none.

A served name missing from the list (an adapter loaded since) is looked up again, at most every
UNKNOWN_NAME_SECONDS. A lookup that fails or takes longer than LOOKUP_TIMEOUT leaves the roots unknown: lines then
name the served model. What is not seen: weights changed under a running server (an adapter reloaded under its
name from another path shows after UNKNOWN_NAME_SECONDS at the earliest, in-place weight updates never), and several
servers behind one address whose balancer keeps its own connections open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

LOOKUP_TIMEOUT = 30.0  # seconds a lookup may take; longer: the roots are unknown until the next one
UNKNOWN_NAME_SECONDS = 30.0  # a served name not in the list is looked up again after this long


class ServedModels:
    """The served model list and when it was asked for; `run` does the lookups, `root` names a call's model."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.roots: dict[str, str] = {}
        self.asked_at = -float("inf")  # when the lookup that gave `roots` was sent
        self.opened_at = -float("inf")  # when the proxy last opened a connection to the upstream
        self._wanted = asyncio.Event()
        self._wanted.set()  # the first lookup: at start
        self._answered = asyncio.Condition()
        self._failing = False  # the last lookup failed (said once per run of failures)

    def connector(self, **options):
        """An aiohttp TCPConnector (`options` its own) that tells this list of each connection it opens.

        It overrides aiohttp's connection factory, a private method of that name through aiohttp 3.x: a TraceConfig
        would say the same through the public API, but every request would then pay for all its trace signals
        (docs/record.md, "Overhead"). If aiohttp renames the method, no lookup follows a new connection and
        tests/record's upstream-restart test fails."""
        import aiohttp

        models = self

        class Connector(aiohttp.TCPConnector):
            async def _create_connection(self, *args, **kwargs):
                protocol = await super()._create_connection(*args, **kwargs)
                models.opened_at = models.clock()
                models._wanted.set()
                return protocol

        return Connector(**options)

    async def run(self, lookup: Callable[[], Awaitable[dict[str, str]]], warn: Callable[[str], None]) -> None:
        """Look the list up each time one is wanted, one lookup at a time (a background task of the proxy)."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            asked = self.clock()
            try:
                roots = await asyncio.wait_for(lookup(), LOOKUP_TIMEOUT)
                self._failing = False
            except Exception as e:  # unknown until the next lookup: lines name the served model meanwhile
                if not self._failing:
                    warn(f"record: the upstream's model list could not be read ({type(e).__name__}: {e}); lines "
                         "name the served model until it can")
                self._failing = True
                roots = {}
            self.roots, self.asked_at = roots, asked
            async with self._answered:
                self._answered.notify_all()

    async def root(self, served: object, opened_by: float) -> str | None:
        """What `served` was loaded from, per a lookup sent after `opened_by` (by when the call's connection had been
        opened; waited for, at most LOOKUP_TIMEOUT); the served name itself when that is unknown."""
        if not isinstance(served, str):
            return None
        if self.asked_at <= opened_by:
            await self._lookup_after(opened_by)
        elif served not in self.roots and self.clock() - self.asked_at > UNKNOWN_NAME_SECONDS:
            await self._lookup_after(self.clock())
        else:
            return self.roots.get(served, served)
        return self.roots.get(served, served) if self.asked_at > opened_by else served

    async def _lookup_after(self, moment: float) -> None:
        self._wanted.set()
        async with self._answered:
            try:
                await asyncio.wait_for(self._answered.wait_for(lambda: self.asked_at > moment), LOOKUP_TIMEOUT)
            except asyncio.TimeoutError:
                pass
