"""The console: rich tables and progress bars that only process 0 of a
multi-host run prints, and the target verdicts every measuring script ends
with."""

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import rich.box
import rich.console
import rich.progress
import rich.table
from rich.markup import escape

from . import _device


WIDTH = 100  # the width of the tables when the output is not a terminal


def shown_columns(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    """The indices of the columns not `n/a` (or empty) in every row."""
    return [
        i
        for i in range(len(columns))
        if not rows or any(str(r[i]) not in ("n/a", "") for r in rows)
    ]


class Console:
    """rich output that only process 0 prints (`WIDTH` wide off a terminal)."""

    def __init__(self) -> None:
        c = rich.console.Console()
        self.rich = c if c.is_terminal else rich.console.Console(width=WIDTH)

    def print(self, *objects: Any, **kw: Any) -> None:
        if _device.is_main():
            self.rich.print(*objects, **kw)

    def table(
        self, title: str, columns: Sequence[str], rows: Sequence, left: int = 3
    ) -> None:
        """A compact table: no all-`n/a` columns, the first `left` columns
        left-aligned, labels never cut."""
        keep = shown_columns(columns, rows)
        t = rich.table.Table(
            title=escape(title),
            title_justify="left",
            box=rich.box.SIMPLE_HEAD,
            padding=(0, 1),
            pad_edge=False,
            collapse_padding=True,
        )
        for i in keep:
            label = max((len(str(r[i])) for r in rows), default=0) if i < left else 0
            justify = "left" if i < left else "right"
            width = min(label, 24) or None
            t.add_column(escape(columns[i]), justify=justify, min_width=width)
        for r in rows:
            t.add_row(*[escape(str(r[i])) for i in keep])
        self.print(t)

    @contextlib.contextmanager
    def progress(self, total: int) -> Iterator[Callable[[str], None]]:
        """A context manager giving `step(description)`, one bar per run."""
        columns = (
            rich.progress.TextColumn("{task.description:<50}"),
            rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(),
            rich.progress.TimeElapsedColumn(),
        )
        bar = rich.progress.Progress(
            *columns, console=self.rich, disable=not _device.is_main()
        )
        with bar:
            task = bar.add_task("", total=total)

            def step(desc: str) -> None:
                bar.update(task, description=desc[:50])
                bar.advance(task)

            yield step


def show_targets(console: "Console", targets: Sequence[dict[str, Any]]) -> None:
    """The target verdicts every measuring script ends with."""
    mark = {True: "met", False: "NOT met", None: "n/a"}
    rows = [
        (mark[t["met"]], t["name"], t["measured"], t.get("why", "")) for t in targets
    ]
    console.table("Targets", ("", "target", "measured", "note"), rows, left=4)
