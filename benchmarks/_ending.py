"""How every measuring script ends: `finish`."""

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import _console, _device, _results, _targets


def finish(
    args: argparse.Namespace,
    console: _console.Console,
    data: dict[str, Any],
    *,
    stem: str,
    plot: Callable[[dict[str, Any], Path], None] | None,
    show: Callable[[_console.Console, dict[str, Any], str], None] | None = None,
    presets: Mapping[str, Any] | None = None,
    targets: Any = None,
) -> dict[str, Any]:
    """What was measured written at once (`<out>/<stem>.json`: a later failure
    loses nothing), then the targets judged on its rows (`_targets.evaluate`
    with `presets` and `targets`, the default targets where `targets` is `None`;
    none where `presets` is `None` and `data` has its own), the results written
    whole (JSON, CSV, and `plot`'s PNG unless it is `None`), shown (`show(console,
    data, where)`), the verdicts, and where the files are. Returns `data`."""
    if _device.is_main():
        _results.write_json(args.out / f"{stem}.json", data)
    if presets is not None:
        chosen = _targets.TARGETS if targets is None else targets
        data["targets"] = _targets.evaluate(data["rows"], presets, chosen)
    path = _results.write(args, stem, data, plot)
    if show is not None:
        show(console, data, _results.where(args, data))
    if data.get("targets"):
        _console.show_targets(console, data["targets"])
    if path is not None:
        took = data["meta"].get("seconds")
        took = f" in {took:.0f} s" if took is not None else ""
        plotted = f" and {path.with_suffix('.png').name} (the plot)" * bool(plot)
        console.print(
            f"{len(data['rows'])} rows{took}; results in {path}, and beside it "
            f"{path.with_suffix('.csv').name} (every row){plotted}"
        )
    return data
