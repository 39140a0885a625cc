"""What a run reports: one JSON line per logged step (`metrics.jsonl`), the same
scalars as TensorBoard events, a log line on the console, and `loss.png`."""

import json
import logging
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
    "tokens_per_s": "speed/tokens_per_s",
    "step_s": "speed/step_s",
    "mfu": "speed/mfu",
    "hfu": "speed/hfu",
    "peak_bytes": "memory/peak_bytes",
}
log = logging.getLogger("train_lm")


# -------------------------------------------------------------------------- logging


class _StderrHandler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment, so that rich's live progress bar,
    which redirects it, prints log lines above the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def setup_logging() -> None:
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
    log.propagate = False
    # Only process 0 of a multi-host run speaks (errors excepted).
    log.setLevel(logging.INFO if _device.is_main_process() else logging.ERROR)


def log_line(row: dict[str, Any]) -> str:
    """The console line of a metrics row: the logged loss (that step's), the
    average since the previous line, the held-out loss (`eval`), the learning
    rate and the speed, within 80 columns (steps up to 999,999); where the
    device tells them, MFU and peak memory on a second, indented line.
    Everything else is in `metrics.jsonl`."""
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


# ---------------------------------------------------------------------------- files


class MetricsWriter:
    """`run_dir/metrics.jsonl` and TensorBoard event files in `run_dir`, from step
    `first` on: lines of later steps (of a run that is resumed) are dropped, and
    TensorBoard is told to drop its events of those steps (`purge_step`)."""

    def __init__(self, run_dir: Path, first: int) -> None:
        from tensorboardX import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        truncate_metrics(self.path, first)
        self.jsonl = self.path.open("a")
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
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps up to `step` (a resumed run writes the rest again)."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot_losses(metrics: Path, out: Path) -> None:
    """The loss curve of `metrics` (training loss, held-out loss) as a PNG."""
    from benchmarks._common import plt

    pyplot = plt()
    rows = read_metrics(metrics)
    fig, ax = pyplot.subplots(figsize=(7, 4), layout="constrained")
    ax.plot([r["step"] for r in rows], [r["loss_avg"] for r in rows], label="train")
    evals = [r for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="held out",
        )
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm.py")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120)
    pyplot.close(fig)
