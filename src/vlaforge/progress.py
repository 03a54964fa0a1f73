"""One rich progress bar for every long-running verb (train, data generate, eval)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, label: str, total: int, start: int = 0) -> Iterator[Callable[[str], None]]:
    """Yield `advance(note="")`: one step done, with a short note shown after the bar (loss, rate, ...)."""
    if not enabled:
        yield lambda note="": None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[note]}")) as bar:
        task = bar.add_task(label, total=total, completed=start, note="")
        yield lambda note="": bar.update(task, advance=1, note=note)
