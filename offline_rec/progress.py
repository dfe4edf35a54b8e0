"""One progress bar for every long command (collect, train, eval): rich, on stderr, silent when disabled."""

from __future__ import annotations


class ProgressBar:
    """A rich progress bar over `total` units (prompts, steps) with a free-text info column.

    `advance(n, info)` moves it; used as a context manager it starts and stops itself. Disabled,
    it does nothing and imports nothing (workers and quiet runs pay no cost).
    """

    def __init__(self, label: str, total: int, done: int = 0, unit: str = "", enabled: bool = True):
        self.progress = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [TextColumn(label), BarColumn(), MofNCompleteColumn()]
        if unit:
            columns.append(TextColumn(unit))
        columns += [TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
        self.progress = Progress(*columns, console=Console(stderr=True))
        self.task_id = self.progress.add_task(label, total=total, completed=done, info="")

    def __enter__(self) -> ProgressBar:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.progress is not None:
            self.progress.start()

    def advance(self, n: int = 1, info: str | None = None) -> None:
        if self.progress is not None:
            fields = {} if info is None else {"info": info}
            self.progress.update(self.task_id, advance=n, **fields)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
