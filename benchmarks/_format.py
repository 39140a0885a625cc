"""Numbers as text, the same in every console table and markdown table: bytes,
ratios, FLOPs, percentages, milliseconds, and a markdown table."""

from collections.abc import Sequence
from typing import Any

import eqx_remat as er
from eqx_remat.internal import format_flops


GiB, MiB = 2**30, 2**20


def first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line (or its type's name)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def fmt_bytes(n: int | None, digits: int = 2) -> str:
    return "n/a" if n is None else er.format_bytes(n, digits=digits)


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_flops(n: int | float | None) -> str:
    return "n/a" if n is None else format_flops(n)


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.3g} ms"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
