"""`--rewards FILE`: rewards that arrive after the fact (thumbs, task success), keyed by response or episode id.

FILE is JSON Lines, one object per line: {"id": ID, "reward": R}. ID is a logged response's "id"
(e.g. "chatcmpl-..."), or an episode's "episode_id"; R is a number, null, or a list with one
number per choice of that response (as a line's own "reward"). A reward from FILE overrides the
line's own. Each id may appear once. Ids that match no line are counted (`rewards_unmatched` in the
import summary), not an error: a rewards file often covers more traffic than one log file.
"""

from __future__ import annotations

from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.files import read_jsonl


class Rewards:
    """The rewards of a --rewards file, and which of them a line has used."""

    def __init__(self, by_id: dict[str, object], path: str | None = None):
        self.by_id = by_id
        self.path = path
        self.used: set[str] = set()

    @classmethod
    def load(cls, path: str | Path | None) -> Rewards:
        if path is None:
            return cls({})
        path = Path(path)
        if not path.is_file():
            raise UserError(f"--rewards {path} does not exist")
        by_id: dict[str, object] = {}
        for line in read_jsonl(path):
            if line.problem is not None:
                raise UserError(f"{line.where}: {line.problem}")
            item = line.value
            if not isinstance(item.get("id"), str) or "reward" not in item:
                raise UserError(f'{line.where}: expected {{"id": "...", "reward": ...}}')
            if item["id"] in by_id:
                raise UserError(f"{line.where}: id {item['id']!r} appears twice")
            by_id[item["id"]] = item["reward"]
        return cls(by_id, str(path))

    def lookup(self, *ids: object) -> tuple[bool, object]:
        """(found, reward) for the first of `ids` (a response id, an episode id) the file holds."""
        for key in ids:
            if isinstance(key, str) and key in self.by_id:
                self.used.add(key)
                return True, self.by_id[key]
        return False, None

    def stats(self) -> dict:
        if self.path is None:
            return {}
        return {"rewards_file": self.path, "rewards_matched": len(self.used),
                "rewards_unmatched": len(self.by_id) - len(self.used)}
