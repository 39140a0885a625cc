"""What a run reports: lines on the console, one JSON line per logged step
(`metrics.jsonl`), the same scalars as TensorBoard events, and `loss.png`."""

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import _device


METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# metrics.jsonl's keys -> TensorBoard tags (grouped by what they measure).
TAGS = {
    "loss": "loss/train",
    "loss_avg": "loss/train_avg",
    "eval_loss": "loss/held_out",
    "lr": "optimizer/lr",
    "peak_bytes": "memory/peak_bytes",
} | {k: f"speed/{k}" for k in ("tokens_per_s", "step_s", "mfu", "hfu")}


def say(text: str) -> None:
    """`text` on stderr, from process 0 only (`sys.stderr` of the moment: rich's
    progress bar redirects it, to print above the bar)."""
    if _device.is_main_process():
        print(text, file=sys.stderr, flush=True)


def log_line(row: dict[str, Any]) -> str:
    """The console line of a metrics row, within 80 columns (steps up to 999,999);
    where the device tells them, MFU and peak memory on a second one."""
    parts = [
        f"step {row['step']:>6}",
        f"loss {row['loss']:.4f} (avg {row['loss_avg']:.4f})",
    ]
    if row["eval_loss"] is not None:
        parts.append(f"eval {row['eval_loss']:.4f}")
    parts.append(f"lr {row['lr']:.1e}")
    speed = row["tokens_per_s"]
    parts.append("compiled" if speed is None else f"{speed:,.0f} tok/s")
    device = []
    if row["mfu"] is not None:
        device.append(f"MFU {row['mfu']:.1%} (HFU {row['hfu']:.1%})")
    if row["peak_bytes"] is not None:
        device.append(f"peak {row['peak_bytes'] / 2**30:.2f} GiB")
    line = "  ".join(parts)
    return line if not device else line + "\n" + " " * 13 + "  ".join(device)


class MetricsWriter:
    """Rows to `run_dir/metrics.jsonl` and TensorBoard events in `run_dir` from
    step `first` on; the lines and events of later steps (of a resumed run) go."""

    def __init__(self, run_dir: Path, first: int) -> None:
        from tensorboardX import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= first]
        self.jsonl = self.path.open("w")
        self.jsonl.writelines(json.dumps(r) + "\n" for r in kept)
        self.events = SummaryWriter(str(run_dir), purge_step=first or None)

    def write(self, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        for key, tag in TAGS.items():
            if row[key] is not None:
                self.events.add_scalar(tag, row[key], row["step"], walltime=row["time"])
        self.events.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.events.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of `path` (none if it is missing), less a line a crash cut short."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def plot_losses(metrics: Path, out: Path) -> None:
    """The loss curves of `metrics` (training, held out) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    rows = read_metrics(metrics)
    evals = [r for r in rows if r.get("eval_loss") is not None]
    fig, ax = pyplot.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss_avg"] for r in rows], label="train")
    if evals:
        steps, losses = [r["step"] for r in evals], [r["eval_loss"] for r in evals]
        ax.plot(steps, losses, "o-", label="held out")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm.py")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    pyplot.close(fig)


def first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line (or its type's name)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]
