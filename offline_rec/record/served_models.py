"""Which checkpoint answered a call: the upstream's served model list (served name -> `root` in /v1/models, the path
or hub id it was loaded from), looked up again whenever the proxy opens a new connection to the upstream.

A vLLM restarted with other weights under the same `--served-model-name` (the deploy -> log -> train loop) has
closed every connection of the process it replaced, so a call the new process answers travels on a connection
opened after the restart. A line is therefore named from a lookup SENT after its call's connection was opened
(`root`). Each new connection starts a lookup (`connector`), which runs while the upstream generates, so a call
waits for it only when its answer comes first; calls on kept-alive connections wait for nothing. Lookups never
overlap (connections opened during one are covered by the next) and go over the proxy's own session, whose
connections start none.

A served name missing from the list (an adapter loaded since) is looked up again, at most every
UNKNOWN_NAME_SECONDS. A lookup that fails or takes longer than LOOKUP_TIMEOUT leaves the roots unknown: lines then
name the served model. What is not seen: weights changed under a running server (an adapter reloaded under its
name from another path shows after UNKNOWN_NAME_SECONDS at the earliest, in-place weight updates never), and several
servers behind one address whose balancer keeps its own connections open.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections.abc import Awaitable, Callable

LOOKUP_TIMEOUT = 30.0  # seconds a lookup may take; longer: the roots are unknown until the next one
UNKNOWN_NAME_SECONDS = 30.0  # a served name not in the list is looked up again after this long
# when the connection last handed out in this task (to one forwarded request) was opened
_HANDED_OUT = contextvars.ContextVar("offline_rec_upstream_connection_opened", default=None)


class ServedModels:
    """The served model list and when it was asked for; `run` does the lookups, `root` names a call's model."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.roots: dict[str, str] = {}
        self.asked_at = -float("inf")  # when the lookup that gave `roots` was sent
        self.opened_at = -float("inf")  # when the proxy last opened a connection to the upstream
        self._opened_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> when opened
        self._wanted = asyncio.Event()
        self._wanted.set()  # the first lookup: at start
        self._answered = asyncio.Condition()
        self._failing = False  # the last lookup failed (said once per run of failures)

    def connector(self, **options):
        """An aiohttp TCPConnector (`options` its own) that tells this list of each connection it opens, and each
        request (`opened_by`) when the connection it got was opened.

        aiohttp's `connect` hands each request a connection, kept alive or new: one not handed out before is new.
        An aiohttp TraceConfig would say the same, but every request would then pay for all its trace signals
        (docs/record.md, "Overhead")."""
        import aiohttp

        models = self

        class Connector(aiohttp.TCPConnector):
            async def connect(self, *args, **kwargs):
                connection = await super().connect(*args, **kwargs)
                models._handed_out(connection.protocol)
                return connection

        return Connector(**options)

    def _handed_out(self, connection) -> None:
        opened = self._opened_at.get(connection) if connection is not None else self.opened_at
        if opened is None:  # opened for this request
            opened = self._opened_at[connection] = self.opened_at = self.clock()
            self._wanted.set()
        _HANDED_OUT.set(opened)

    def opened_by(self) -> float:
        """When the connection of the request this task last sent upstream was opened (a kept-alive connection: when
        it was first opened); the newest connection's when the connector did not say."""
        opened = _HANDED_OUT.get()
        return self.opened_at if opened is None else opened

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
        """What `served` was loaded from, per a lookup sent after `opened_by` (when the call's connection was opened;
        waited for, at most LOOKUP_TIMEOUT); the served name itself when that is unknown."""
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
