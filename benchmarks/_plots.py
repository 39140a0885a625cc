"""What the benchmark plots share: labels that do not overlap, log axes only
where the range calls for them, sizes in a unit that suits them, and timings
with their spread. Each script's `plot(data, path)` draws from its JSON alone."""

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _format


LOG_RANGE = 10.0  # a range at least this wide (largest / smallest) gets a log axis
QUARTILES_FROM = 8  # from this many samples on, a timing's bar is its quartiles
_SAME_PX = 4.0  # points closer than this on screen (pixels) share one label


def byte_unit(values: Sequence[float]) -> tuple[str, int]:
    """The unit ("KiB", "MiB" or "GiB") and its size for byte counts up to
    `max(values)`."""
    top = max(values, default=0)
    for name, size in (("GiB", _format.GiB), ("MiB", _format.MiB)):
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


def is_narrow(values: Sequence[float]) -> bool:
    """Whether positive `values` span less than a fifth of their largest."""
    positive = [v for v in values if v and v > 0]
    return bool(positive) and (max(positive) - min(positive)) < 0.2 * max(positive)


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
    """For each series hidden by an earlier one (equal within `rtol` at every
    point), the name of that one, for the legend."""

    def same(xs: Sequence[float | None], ys: Sequence[float | None]) -> bool:
        pairs = list(zip(xs, ys))
        return len(xs) == len(ys) > 0 and all(
            x is not None and y is not None and abs(x - y) <= rtol * max(abs(x), 1e-30)
            for x, y in pairs
        )

    out: dict[str, str] = {}
    names = list(series)
    for i, b in enumerate(names):
        hider = next((a for a in names[:i] if same(series[a], series[b])), None)
        if hider is not None:
            out[b] = out.get(hider, hider)
    return out


def panel_title(ax: Any, name: str, describe: str, width: int = 62) -> None:
    """A panel's title: its name, then what it is, wrapped to the panel."""
    ax.set_title(f"{name}\n{textwrap.fill(describe, width)}", fontsize=9, loc="left")


def spread_name(n: int, what: str = "steps") -> str:
    """What `spread` draws for `n` samples, for a title."""
    if n >= QUARTILES_FROM:
        return f"quartiles of {n} {what}"
    return f"fastest to slowest of {n} {what}"


def spread(times: Sequence[float], centre: float, ref: float) -> tuple[float, float]:
    """The error bar, below and above `centre`, of samples `times` in the unit of
    which `ref` is 1: their quartiles, or their range for fewer than
    `QUARTILES_FROM` samples."""
    q = (25, 75) if len(times) >= QUARTILES_FROM else (0, 100)
    lo, hi = np.percentile(np.asarray(times) / ref, q)
    return max(centre - lo, 0.0), max(hi - centre, 0.0)


def suptitle(fig: Any, text: str, fontsize: float = 10) -> None:
    """The figure's title, each line wrapped to the figure's width (at 0.6 of the
    font size per character)."""
    width = max(40, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))
    lines = [textwrap.fill(line, width) for line in text.splitlines()]
    fig.suptitle("\n".join(lines), fontsize=fontsize)


def where_when(meta: dict) -> str:
    """A results file's machine and date, for a figure's title: the device
    (or the target compiled for), cores, jax, date."""
    if meta.get("target"):
        where = f"compiled for TPU {meta['target']} on a CPU, not run"
    else:
        cores = f", {meta['cpu_count']} cores" if meta.get("backend") == "cpu" else ""
        where = f"{meta['device']}{cores}"
    return f"{where}, jax {meta['versions']['jax']}, {meta['date']}"


def label_points(
    ax: Any,
    points: Sequence[tuple[float, float, str]],
    others: Sequence[tuple[float, float]] = (),
    fontsize: float = 9,
) -> None:
    """Label scatter points (`x, y, text`) clear of each other, of every point
    (`others` too, unlabelled) and of the frame (adjustText); points that
    coincide on screen share one label, "a = b". Call it once the layout and
    the axis limits are final."""
    from adjustText import adjust_text

    pixels = ax.transData.transform([(x, y) for x, y, _ in points])
    groups: list[tuple[Any, tuple[float, float], list[str]]] = []  # px, xy, names
    for (x, y, text), px in zip(points, pixels):
        near = [g for g in groups if np.abs(g[0] - px).max() < _SAME_PX]
        if near:
            near[0][2].append(text)
        else:
            groups.append((px, (x, y), [text]))
    texts = [
        ax.text(x, y, " = ".join(dict.fromkeys(names)), fontsize=fontsize)
        for _, (x, y), names in groups
    ]
    xy = [(x, y) for x, y, _ in points] + list(others)
    adjust_text(
        texts,
        x=[x for x, _ in xy],
        y=[y for _, y in xy],
        ax=ax,
        arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5"),
        # A count, not adjustText's default of one second: the same labels on
        # a busy machine as on an idle one.
        iter_lim=3000,
    )


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_figure(fig: Any, path: Path, rect: tuple | None = None) -> None:
    """Lay out (within `rect`), write (110 dpi) and close: every plot's end."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt().close(fig)
