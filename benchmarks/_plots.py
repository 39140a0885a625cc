"""What the benchmark plots share, so that each reads at the width a README shows
it: labels that do not overlap, log axes only where the range calls for them,
sizes in a unit that suits them, and timings with their spread.

The figures are drawn by each script's `plot(data, path)` from its JSON alone, so
`python -c "..."` with a committed JSON file redraws a committed figure."""

import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _common


# A range at least this wide (largest / smallest) gets a log axis.
LOG_RANGE = 10.0
# Where a label may sit around its point, in points: (dx, dy, ha, va), in order of
# preference: next to it, then further away, with a line to it.
_NEAR = (
    (5, 3, "left", "bottom"),
    (5, -3, "left", "top"),
    (-5, 3, "right", "bottom"),
    (-5, -3, "right", "top"),
    (0, 6, "center", "bottom"),
    (0, -6, "center", "top"),
    (8, 0, "left", "center"),
    (-8, 0, "right", "center"),
)
_FAR = tuple((dx * s, dy * s, ha, va) for s in (3, 5) for dx, dy, ha, va in _NEAR[:6])
# Points closer than this on screen (pixels) share one label, "a = b".
_SAME_PX = 4.0


def byte_unit(values: Sequence[float]) -> tuple[str, int]:
    """The unit ("KiB", "MiB" or "GiB") and its size for byte counts whose largest
    is `max(values)`."""
    top = max(values, default=0)
    for name, size in (("GiB", _common.GiB), ("MiB", _common.MiB)):
        if top >= size:
            return name, size
    return "KiB", 2**10


def scale_for(ax: Any, axis: str, values: Sequence[float]) -> None:
    """A log scale on `axis` ("x" or "y") only if `values` span at least
    `LOG_RANGE`, with plain numbers as tick labels (`0.5`, `10`, not `10^1`)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    positive = [v for v in values if v and v > 0]
    if not positive or max(positive) / min(positive) < LOG_RANGE:
        return
    getattr(ax, f"set_{axis}scale")("log")
    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    which.set_minor_formatter(NullFormatter())


def zero_based_if_narrow(ax: Any, axis: str, values: Sequence[float]) -> None:
    """On a linear axis, start at 0 when `values` span less than a fifth of their
    largest: a range of 1.02 to 1.10 would make a 7% difference look large."""
    positive = [v for v in values if v and v > 0]
    if not positive or getattr(ax, f"get_{axis}scale")() != "linear":
        return
    if (max(positive) - min(positive)) < 0.2 * max(positive):
        getattr(ax, f"set_{axis}lim")(0, max(positive) * 1.08)


def coinciding(
    series: dict[str, Sequence[float | None]], rtol: float = 0.03
) -> dict[str, str]:
    """For each series that another, earlier one hides (equal within `rtol` at
    every point), the name of that one: curves drawn on top of each other are
    then said to be, in the legend."""
    out: dict[str, str] = {}
    names = list(series)
    for i, b in enumerate(names):
        for a in names[:i]:
            xs, ys = series[a], series[b]
            if (
                len(xs) == len(ys)
                and xs
                and all(
                    x is not None
                    and y is not None
                    and abs(x - y) <= rtol * max(abs(x), 1e-30)
                    for x, y in zip(xs, ys)
                )
            ):
                out[b] = out.get(a, a)
                break
    return out


def panel_title(ax: Any, name: str, describe: str, width: int = 62) -> None:
    """A panel's title: its name, then what it is, wrapped to the panel."""
    ax.set_title(f"{name}\n{textwrap.fill(describe, width)}", fontsize=9, loc="left")


# From this many samples on, a timing's bar is its quartiles, else its range.
QUARTILES_FROM = 8


def spread_name(n: int, what: str = "steps") -> str:
    """What `spread` draws for `n` samples, for a title."""
    if n >= QUARTILES_FROM:
        return f"quartiles of {n} {what}"
    return f"fastest to slowest of {n} {what}"


def spread(times: Sequence[float], centre: float, ref: float) -> tuple[float, float]:
    """The error bar, below and above `centre`, of samples `times` measured in the
    unit of which `ref` is 1 (e.g. seconds, with `ref` the step time that a ratio
    divides by): their quartiles, or from fastest to slowest for fewer than
    `QUARTILES_FROM` samples."""
    q = (25, 75) if len(times) >= QUARTILES_FROM else (0, 100)
    lo, hi = np.percentile(np.asarray(times) / ref, q)
    return max(centre - lo, 0.0), max(hi - centre, 0.0)


def suptitle(fig: Any, text: str, fontsize: float = 10) -> None:
    """The figure's title, each line wrapped to the figure's width (at 0.6 of the
    font size per character, wide enough for a line of digits and capitals)."""
    width = max(40, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))
    lines = [textwrap.fill(line, width) for line in text.splitlines()]
    fig.suptitle("\n".join(lines), fontsize=fontsize)


def _overlap(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _outside(box: Any, frame: Any) -> float:
    return box.width * box.height - _overlap(box, frame)


def label_points(
    ax: Any,
    points: Sequence[tuple[float, float, str]],
    others: Sequence[tuple[float, float]] = (),
    fontsize: float = 9,
) -> None:
    """Label scatter points so that no label overlaps another, a point (also one
    of `others`, unlabelled) or the frame, where some place allows: points that
    coincide on screen share one label ("a = b"); each label takes the first of
    the places around its point (near it, then further, with a line) that
    overlaps nothing placed before, else the one that overlaps least. Call it
    after the figure's layout is final (`fig.tight_layout()`) and the axis limits
    are set."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    groups: list[tuple[Any, list[str], tuple[float, float]]] = []
    for x, y, text in points:
        px = ax.transData.transform((x, y))
        for g in groups:
            if abs(g[0][0] - px[0]) < _SAME_PX and abs(g[0][1] - px[1]) < _SAME_PX:
                g[1].append(text)
                break
        else:
            groups.append((px, [text], (x, y)))
    r = fig.dpi / 72 * 3  # a marker's half-size, in pixels
    taken = [
        Bbox.from_extents(px - r, py - r, px + r, py + r)
        for px, py in ax.transData.transform(
            [(x, y) for x, y, _ in points] + list(others)
        )
    ]
    for _, texts, xy in groups:
        best = None
        for dx, dy, ha, va in _NEAR + _FAR:
            far = abs(dx) + abs(dy) > 10
            label = ax.annotate(
                " = ".join(dict.fromkeys(texts)),
                xy,
                xytext=(dx, dy),
                textcoords="offset points",
                ha=ha,
                va=va,
                fontsize=fontsize,
                arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkB=4)
                if far
                else None,
            )
            box = label.get_window_extent(renderer)
            cost = sum(_overlap(box, t) for t in taken) + 10 * _outside(box, frame)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, label, box)
            else:
                label.remove()
            if cost == 0:
                break
        taken.append(best[2])
