"""What rank 0 shows and records: the startup table, the progress bar, metrics.jsonl, TensorBoard and W&B.

Throughput and MFU:
- tokens/s counts real (non-padding) tokens of the global batch per second of step time, split into text tokens
  and visual tokens (image placeholder positions).
- MFU = achieved FLOP/s / (peak FLOP/s per device * devices) (`vlmctl.train.flops.mfu`, PaLM appendix B). The
  FLOPs of each micro-batch come from the cost model `vlmctl.train.flops.CostModel.batch_flops` (vision tower,
  projector, language model, LM head on labelled tokens, causal attention per packed sample; sources there). Peak
  FLOP/s (`peak_flops`) are the dense bf16 tensor-core figures of the vendor data sheets; unknown devices (and
  CPUs) get no MFU. Runs with float8 linears (`train.fp8`) are counted against the same bf16 peak (the float8
  peak is twice it on Hopper): MFU stays comparable across runs and shows float8's gain as a higher MFU, which
  can exceed what bf16 alone could reach.

Stragglers (`straggler_stats`; every step waits for the slowest data-parallel rank):
- balance = sum over steps of the mean rank forward + backward time / sum over steps of the largest: the share of
  the step's compute time the average rank spends working (1 = all ranks as busy as the slowest). `balance_flops`
  is the same ratio of the ranks' estimated FLOPs (`vlmctl.train.flops.CostModel.batch_flops`), what compute
  balancing (`train.balance`) evens out.
- data_wait = the share of the interval's wall time the worst rank (`data_wait_rank`) spent blocked waiting for
  its data loader; a slow loader shows here, on its own rank, not in `balance`.
- per rank, in rank order: `rank_compute_s` (forward + backward seconds per step), `rank_data_wait_s` (seconds per
  step waiting for data), `rank_sync_s` (the rest of the step: collectives, where ranks wait for each other, the
  optimizer step and host work).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# matplotlib and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# wandb (an optional dependency) is imported only where used, so the rest works without it.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

# Dense bf16 peak FLOP/s per device (vendor data sheets, without sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "L40": 181e12, "A10": 125e12, "4090": 165e12, "B200": 2250e12, "GH200": 989e12}


def peak_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of one `device` (a torch.device) from `PEAK_FLOPS`, matched on the CUDA device name;
    None for CPUs and unknown GPUs."""
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


def straggler_stats(steps, seconds: float) -> dict[str, Any]:
    """The straggler figures (module docstring) of `steps` (`vlmctl.train.loop.StepResult`s with per-rank
    `rank_compute_s`, `rank_data_wait_s`, `rank_flops`) over `seconds` of wall time: `balance`, `balance_flops`
    (fractions in (0, 1], None when nothing was measured), `data_wait` (a fraction of `seconds`),
    `data_wait_rank`, and the per-rank lists `rank_compute_s`, `rank_data_wait_s`, `rank_sync_s` (seconds per
    step). Empty when the steps carry no per-rank figures."""
    steps = [s for s in steps if s.rank_compute_s]
    if not steps:
        return {}
    n = len(steps)

    def ratio(per_rank: list[list[float]]) -> float | None:
        worst = sum(max(r) for r in per_rank)
        return sum(sum(r) / len(r) for r in per_rank) / worst if worst > 0 else None

    compute = [sum(s.rank_compute_s[r] for s in steps) / n for r in range(len(steps[0].rank_compute_s))]
    waiting = [sum(s.rank_data_wait_s[r] for s in steps) / n for r in range(len(compute))]
    shares = [w * n / max(seconds, 1e-9) for w in waiting]
    worst = max(range(len(shares)), key=lambda r: (shares[r], -r))
    return {
        "balance": ratio([s.rank_compute_s for s in steps]),
        "balance_flops": ratio([s.rank_flops for s in steps]),
        "data_wait": shares[worst],
        "data_wait_rank": worst,
        "rank_compute_s": compute,
        "rank_data_wait_s": waiting,
        "rank_sync_s": [max(seconds / n - c - w, 0.0) for c, w in zip(compute, waiting)],
    }


class MetricsLogger:
    """Rank 0's sinks: metrics.jsonl (always), TensorBoard and W&B when listed in `train.report_to`.

    Raises ConfigError when a tracker's package is missing.
    """

    def __init__(self, run_dir: Path, report_to: list[str], *, run_name: str, project: str, config: dict, resume_step: int = 0):
        from vlmctl.errors import ConfigError

        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step and self.path.is_file():
            self._truncate(resume_step)
        self._tb = None
        self._wandb = None
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError("train.report_to has tensorboard but the package is not installed",
                                  hint="pip install 'vlmctl[tracking]', or remove it from train.report_to") from exc
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError("train.report_to has wandb but the package is not installed",
                                  hint="pip install 'vlmctl[tracking]', or remove it from train.report_to") from exc
            self._wandb = wandb.init(project=project, name=run_name, id=run_name.replace("/", "-"), resume="allow",
                                     dir=str(run_dir), config=config)

    def _truncate(self, step: int) -> None:
        """Drop rows past `step` (written after the checkpoint a resumed run restarts from)."""
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def log(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        step = row["step"]
        scalars = {tracker_tag(k): v for k, v in row.items() if isinstance(v, (int, float)) and k != "step" and v is not None}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def tracker_tag(key: str) -> str:
    """The TensorBoard / W&B tag of a metrics row's key: validation's `val_*` under eval/ (`val_loss` ->
    `eval/loss`), the rest under train/."""
    return f"eval/{key[4:]}" if key.startswith("val_") else f"train/{key}"


class Progress:
    """A rich progress bar on a terminal; one plain line per logged step otherwise (logs, SLURM)."""

    def __init__(self, total: int, start: int, enabled: bool, fields: tuple[tuple[str, str], ...] = ()):
        from rich.console import Console

        self.enabled = enabled
        self.fields = fields  # the objective's own metrics in the step line (`ObjectiveSpec.step_line`)
        self.console = Console(highlight=False)
        self.total = total
        self.bar = None
        self.start_time = time.monotonic()
        self.start_step = start
        if enabled and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                    TimeRemainingColumn(), console=self.console, transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, row: dict[str, Any] | None) -> None:
        if not self.enabled:
            return
        info = format_row(row, self.fields) if row else None
        if self.bar is not None:
            self.bar.update(self.task, completed=step, **({"info": info} if info else {}))
        elif info:
            done = step - self.start_step
            eta = (time.monotonic() - self.start_time) / max(done, 1) * (self.total - step)
            self.console.print(f"step {step}/{self.total} {info} eta {eta:.0f}s")

    def print(self, text: str, markup: bool = True) -> None:
        """Print `text` on rank 0 (rich markup read unless `markup` is off: for text holding paths)."""
        if self.enabled:
            (self.bar.console if self.bar is not None else self.console).print(text, markup=markup)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def format_row(row: dict[str, Any], fields: tuple[tuple[str, str], ...] = ()) -> str:
    """The step line of a metrics row: loss, validation, lr, gradient norm, then `fields` (the objective's metrics,
    (key, `str.format` template) pairs of `ObjectiveSpec.step_line`, those the row holds), throughput and the rest."""
    loss = "skipped (NaN/inf)" if row["loss"] is None else f"{row['loss']:.4f}"
    parts = [f"loss {loss}"]
    if row.get("val_loss") is not None:
        best = f" (best {row['best_val_loss']:.4f} at step {row['best_step']})" if row.get("best_step") != row["step"] else " (best)"
        parts.append(f"val loss {row['val_loss']:.4f}{best}")
    parts.append(f"lr {row['lr']:.2e}")
    if row.get("grad_norm") is not None:
        parts.append(f"gnorm {row['grad_norm']:.3f}")
    parts += [template.format(row[key]) for key, template in fields if row.get(key) is not None]
    parts.append(f"tok/s {row['tokens_per_s']:.0f} (text {row['text_tokens_per_s']:.0f}, visual {row['visual_tokens_per_s']:.0f})")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("balance") is not None and len(row.get("rank_compute_s") or ()) > 1:
        parts.append(f"balance {100 * row['balance']:.1f}%")
    if row.get("data_wait") is not None:
        rank = f" (rank {row['data_wait_rank']})" if len(row.get("rank_compute_s") or ()) > 1 else ""
        parts.append(f"data wait {100 * row['data_wait']:.1f}%{rank}")
    if row.get("memory_gib") is not None:
        parts.append(f"mem {row['memory_gib']:.1f} GiB")
    if row.get("save_s"):
        parts.append(f"checkpoint {row['save_s']:.1f} s")
    return " | ".join(parts)


def plot_loss(run_dir: Path, curves: tuple = (), loss: bool = True) -> Path | None:
    """Write `run_dir/loss.png` from metrics.jsonl; None without rows. One panel per figure, sharing the step axis:
    the training loss with the learning rate (`loss`; the panel is drawn without `curves` whatever `loss` says),
    the validation loss when the run validated, its best step (a star) and the step the run stopped early (a
    dashed line); then a panel per entry of the objective's `curves` (`ObjectiveSpec.curves`, a metric or a tuple of
    metrics drawn together: DPO's margins, accuracies, chosen and rejected rewards; GRPO's reward, whose loss is ~0
    by construction) the rows hold, with their validation values (`val_<metric>`)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    val = [r for r in rows if r.get("val_loss") is not None]
    rows = [r for r in rows if r.get("loss") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [tuple(k for k in ((c,) if isinstance(c, str) else c) if any(r.get(k) is not None for r in rows))
              for c in curves]
    groups = [g for g in groups if g]
    panels = ([("loss",)] if loss or not groups else []) + groups
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.2 + 2.8 * len(panels)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == ("loss",):
            _loss_panel(ax, rows, val)
            continue
        for key in panel:
            drawn = [r for r in rows if r.get(key) is not None]
            ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], label=key)
            checked = [r for r in val if r.get(f"val_{key}") is not None]
            if checked:
                ax.plot([r["step"] for r in checked], [r[f"val_{key}"] for r in checked], marker="o", label=f"val {key}")
        if len(panel) > 1 or any(r.get(f"val_{k}") is not None for r in val for k in panel):
            ax.legend(loc="best")
        ax.set_ylabel(" / ".join(panel))
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    tmp = out.with_suffix(".tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out


def _loss_panel(ax, rows: list[dict[str, Any]], val: list[dict[str, Any]]) -> None:
    """The loss panel of `plot_loss`: loss, validation loss with its best step and early stop, lr on a twin axis."""
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="loss")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], color="tab:green", marker="o", label="val loss")
        last = val[-1]
        if last.get("best_step") is not None and last.get("best_val_loss") is not None:
            ax.plot([last["best_step"]], [last["best_val_loss"]], color="tab:red", marker="*", markersize=14,
                    linestyle="none", label="best")
            ax.annotate(f"best: step {last['best_step']}", (last["best_step"], last["best_val_loss"]),
                        textcoords="offset points", xytext=(6, 8), fontsize=8)
        stopped = next((r for r in val if r.get("early_stop")), None)
        if stopped is not None:
            ax.axvline(stopped["step"], color="tab:gray", linestyle="--", linewidth=1)
            ax.annotate(f"early stop: step {stopped['step']}", (stopped["step"], 0.95), xycoords=("data", "axes fraction"),
                        textcoords="offset points", xytext=(-4, 0), ha="right", fontsize=8)
        ax.legend(loc="upper right")
    ax.set_ylabel("loss")
    lr_ax = ax.twinx()
    lr_ax.plot([r["step"] for r in rows], [r["lr"] for r in rows], color="tab:orange", alpha=0.5, label="lr")
    lr_ax.set_ylabel("learning rate")


def plot_loss_or_warn(run_dir: Path, curves: tuple = (), loss: bool = True) -> Path | None:
    """`plot_loss`, with a failure to write it (a full disk) reported as one warning line: loss.png is a
    convenience, never the run's error."""
    import sys

    try:
        return plot_loss(run_dir, curves, loss)
    except OSError as exc:
        print(f"warning: {Path(run_dir) / 'loss.png'} not written: {exc.strerror or exc}", file=sys.stderr)
        return None


def startup_table(info: dict[str, Any]):
    """One rich table of the run: model parts, trainable parameters, strategy, world size, batch, steps, data."""
    from rich.table import Table

    table = Table(title="vlmctl train", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        table.add_row(key, str(value))
    return table


def human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"
