"""An experiment's rows and columns, declared once: a typed row (a frozen
dataclass or a NamedTuple, read from a results file's dict with `read`) and a
column spec (a list of `Column`s), which both the console (`show`) and
`report.py`'s markdown (`markdown`) print. A renamed field is one edit, and
`read` fails on a results file that lacks a field the row requires."""

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from . import _console, _format


R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Column(Generic[R]):
    """One column: its header, a row's cell as text, and what it means (the
    console's legend says it for each column shown)."""

    name: str
    cell: Callable[[R], Any]
    means: str = ""
    code: bool = False  # markdown shows the cell as code (a checkpoint's label)


def read(row: type[R], d: Mapping[str, Any]) -> R:
    """A `row` (a dataclass or a NamedTuple) from a results file's dict: each
    field by its name, a field the dict lacks at its default; a required field
    missing is a `KeyError` naming it and the row type. Keys the row does not
    declare are left out."""
    if dataclasses.is_dataclass(row):
        fields = [f.name for f in dataclasses.fields(row)]
        required = {
            f.name
            for f in dataclasses.fields(row)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        }
    else:  # a NamedTuple
        fields = list(getattr(row, "_fields"))
        required = set(fields) - set(getattr(row, "_field_defaults"))
    for name in sorted(required - set(d)):
        raise KeyError(f"{row.__name__} needs {name!r}; the row has {sorted(d)}")
    return row(**{k: d[k] for k in fields if k in d})


def read_all(row: type[R], rows: Iterable[Mapping[str, Any]]) -> list[R]:
    return [read(row, d) for d in rows]


def cells(columns: Sequence[Column], rows: Sequence[Any]) -> list[list[str]]:
    return [[str(c.cell(r)) for c in columns] for r in rows]


def shown(columns: Sequence[Column], rows: Sequence[Any]) -> list[Column]:
    """The columns not `n/a` (or empty) in every row."""
    keep = _console.shown_columns([c.name for c in columns], cells(columns, rows))
    return [columns[i] for i in keep]


def legend(columns: Sequence[Column]) -> str:
    """`Columns: name = what it means; ...` for `columns` that say."""
    said = [f"{c.name} = {c.means}" for c in columns if c.means]
    return "Columns: " + "; ".join(said) + "." if said else ""


def show(
    console: _console.Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Any],
    left: int = 2,
) -> list[Column]:
    """The console's table of `rows` (columns `n/a` in every row left out).
    Returns the columns shown, for the legend."""
    columns = shown(columns, rows)
    console.table(title, [c.name for c in columns], cells(columns, rows), left=left)
    return columns


def markdown(columns: Sequence[Column], rows: Sequence[Any]) -> str:
    """`report.py`'s table of `rows`: the same columns, `code` ones as code,
    those `n/a` in every row left out."""
    columns = shown(columns, rows)
    text = [
        [f"`{c.cell(r)}`" if c.code else str(c.cell(r)) for c in columns] for r in rows
    ]
    return _format.markdown_table([c.name for c in columns], text)


MARK = {True: "met", False: "**not met**", None: "n/a"}


def targets_markdown(data: Mapping[str, Any]) -> str:
    """The verdicts of a results file, as markdown (empty where it has none)."""
    rows = data.get("targets") or []
    cols = ["", "target", "measured"]
    return (
        _format.markdown_table(
            cols, [[MARK[t["met"]], t["name"], t["measured"]] for t in rows]
        )
        if rows
        else ""
    )


def presets_markdown(data: Mapping[str, Any], topology: bool = False) -> str:
    """`- name: what it is` for each preset of a results file."""
    return "\n".join(
        f"- `{n}`: {p['describe']}" + (f", {p['topology']}" if topology else "")
        for n, p in data["presets"].items()
    )
