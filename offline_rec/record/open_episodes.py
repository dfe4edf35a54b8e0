"""The open episodes: the calls of one conversation, held until the episode closes (`EpisodeBook`).

A client names an episode with the header `X-Episode-Id` on each of its calls and closes it with
`X-Episode-End: true` on the last one; an episode with no call for `idle_timeout` seconds closes
by itself. Calls keep the order in which they ARRIVED (an agent sends call k+1 after reading
reply k); an episode whose end has been announced (or whose recorded calls grew past the size
limit) is written once its calls still in flight have finished. An episode past the size limit
RETIRES when the next call with its id arrives: that call starts a new episode under the same id,
and the old one is written once its own calls in flight finish (otherwise an agent that always
has a call in flight would keep it open for good). Sequence numbers go on across the two, so a
finishing call is found by (id, seq) in the one it belongs to. A failed call (an upstream
error, a client that went away) is not part of the episode; an episode none of whose calls
succeeded writes nothing. An id used again after its episode closed starts a new episode.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

END_HEADER = "x-episode-end"
ID_HEADER = "x-episode-id"
CLOSED_BY_END = "end-header"
CLOSED_BY_IDLE = "idle-timeout"
CLOSED_BY_SHUTDOWN = "shutdown"
CLOSED_BY_RECOVERY = "recovered"
CLOSED_BY_SIZE = "max-size"


def is_end(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes")


@dataclass
class Episode:
    episode_id: Hashable  # the book's key: the recorder's is (client, the X-Episode-Id)
    last_activity: float
    first_seq: int = 0  # the sequence number of its first call (an id's episodes never share one)
    next_seq: int = 0
    calls: dict[int, list[dict]] = field(default_factory=dict)  # seq -> the call's records (a batch gives several)
    in_flight: set[int] = field(default_factory=set)
    ending: bool = False
    size: int = 0  # bytes of the calls recorded so far (the caller adds them)
    too_large: bool = False  # its calls passed the size limit: it ends too (ending: its end was announced)
    unjournaled: set[int] = field(default_factory=set)  # seqs of recorded calls whose journal entry failed

    def ordered_calls(self) -> list[dict]:
        return [record for seq in sorted(self.calls) for record in self.calls[seq]]


class EpisodeBook:
    """Open episodes by id. Pure bookkeeping: the caller writes what it returns.

    `owner(episode_id)` names who opened an episode (the recorder's: the client); `open_by(owner)`
    counts that owner's open episodes (a quota per client)."""

    def __init__(self, owner=lambda episode_id: None):
        self.open: dict[str, Episode] = {}
        self.retiring: dict[Hashable, list[Episode]] = {}  # id -> episodes past the size limit, calls in flight
        self.owner = owner
        self.counts: dict = {}  # owner -> open episodes (retiring ones included)
        self.seq_floor: dict = {}  # id -> the sequence number its next new episode starts at (default 0)

    def open_by(self, owner) -> int:
        return self.counts.get(owner, 0)

    def _remove(self, episode: Episode) -> Episode:
        owner = self.owner(episode.episode_id)
        self.counts[owner] -= 1
        if not self.counts[owner]:
            del self.counts[owner]
        if self.open.get(episode.episode_id) is episode:
            del self.open[episode.episode_id]
        else:
            retiring = self.retiring[episode.episode_id]
            retiring.remove(episode)
            if not retiring:
                del self.retiring[episode.episode_id]
        return episode

    def begin(self, episode_id: Hashable, now: float) -> int:
        """A call of `episode_id` arrives: its sequence number within the episode."""
        episode = self.open.get(episode_id)
        if episode is not None and episode.too_large:  # it has calls in flight (else it was written)
            self.retiring.setdefault(episode_id, []).append(self.open.pop(episode_id))
            episode = self._new(episode_id, now, first_seq=episode.next_seq)
        elif episode is None:
            episode = self._new(episode_id, now, first_seq=self.seq_floor.get(episode_id, 0))
        seq = episode.next_seq
        episode.next_seq += 1
        episode.in_flight.add(seq)
        episode.last_activity = now
        return seq

    def _new(self, episode_id: Hashable, now: float, first_seq: int) -> Episode:
        episode = self.open[episode_id] = Episode(episode_id, last_activity=now, first_seq=first_seq,
                                                  next_seq=first_seq)
        owner = self.owner(episode_id)
        self.counts[owner] = self.counts.get(owner, 0) + 1
        return episode

    def holding(self, episode_id: Hashable, seq: int) -> Episode | None:
        """The episode (open or retiring) whose call `seq` is in flight; None when there is none."""
        episode = self.open.get(episode_id)
        if episode is not None and seq in episode.in_flight:
            return episode
        return next((e for e in self.retiring.get(episode_id, ()) if seq in e.in_flight), None)

    def finish(self, episode_id: Hashable, seq: int, call: list[dict] | None, end: bool, now: float) -> Episode | None:
        """A call finished with its records (`call` None: failed, not recorded). Returns the episode when it is now
        closed (its end announced, or past the size limit, and nothing in flight): the caller writes it, unless it
        has no calls."""
        episode = self.holding(episode_id, seq)
        episode.in_flight.discard(seq)
        episode.last_activity = now
        if call is not None:
            episode.calls[seq] = call
        episode.ending = episode.ending or end
        if (episode.ending or episode.too_large) and not episode.in_flight:
            return self._remove(episode)
        return None

    def expired(self, now: float, idle_timeout: float) -> list[Episode]:
        """Episodes idle (nothing in flight, no call) for `idle_timeout` seconds, removed from the book."""
        done = [
            e for e in self.open.values() if not e.in_flight and now - e.last_activity >= idle_timeout
        ]
        for episode in done:
            self._remove(episode)
        return done

    def held(self) -> list[Episode]:
        """Every episode the book holds: open, or retiring (past the size limit, its calls in flight)."""
        return list(self.open.values()) + [e for retiring in self.retiring.values() for e in retiring]

    def drain(self) -> list[Episode]:
        """Every open episode (shutdown), removed from the book."""
        episodes = self.held()
        self.open.clear()
        self.retiring.clear()
        self.counts.clear()
        return episodes
