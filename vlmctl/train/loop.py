"""The step loop shared by every strategy and objective: `Trainer.train()` and `Trainer.train_step()`, read top to
bottom.

The loop drives two things it knows only by their protocols: an `Engine` (`distributed.engine`: torch for
ddp/fsdp, DeepSpeed for zero2/zero3) forwards, back-propagates and steps, and an `Objective` (`train.objectives`:
supervised fine-tuning, or any other) says what a batch holds and computes the loss of one micro-batch.

Loss: the objective's summed loss over the tokens of the whole global batch (all micro-batches of the accumulation
window on all data-parallel ranks), divided by their count (`Objective.label_tokens`; for fine-tuning the assistant
tokens, `objectives.loss_sum`). Each micro-batch's summed loss is scaled by `dp_size / global_label_tokens` before
backward, because data-parallel gradient reduction averages over the data-parallel ranks. So the loss and gradients
of a step do not depend on how the global batch is split over ranks and micro-batches (1 rank x 8 samples == 2
ranks x 4 samples), unlike a mean of per-rank means. Label tokens, losses, token counts, FLOPs and the objective's
extra metrics are summed over the data-parallel group (`ParallelDims.dp_group`), the ranks that read different
data. With sequence parallelism the ranks of a group read the same row and each computes the loss of its slice
(`distributed.sequence`): the scale is `dp_size x sp / global_label_tokens`, as gradients are averaged over all of
them, and a batch's loss is summed over its group before it is reported.

Stragglers: every collective waits for the slowest rank. Each step records, per data-parallel rank, its
forward + backward time (`StepTimer`: CUDA events on a GPU, read after one synchronize per step; host clocks on a
CPU) and its wait for the data loader (the host blocked on the next micro-batch), gathered in the step's result
(`rank_compute_s`, `rank_data_wait_s`, `rank_flops`; `vlmctl.train.metrics.straggler_stats` turns them into the
rows' `balance` and `data_wait`). The first collective of a step (the label-token count) comes before any forward
pass, so a rank whose data arrives late makes the others wait there, outside their forward + backward time: a slow
loader shows as `data_wait` on its rank, not as imbalance. Under FSDP2 the per-layer all-gathers keep the ranks in
step inside the forward and backward passes too, so a fast rank's wait for a slow one partly counts as its compute
and `balance` reads closer to 1 than the ranks' own work is; `balance_flops` (the estimated FLOPs per rank) does not.

Bad steps: a micro-batch whose loss is NaN/inf on any rank is not back-propagated and the step is skipped
(torch engine: no optimizer step, gradients dropped; DeepSpeed: the bad micro-batch is left out of the
window, as its engine always steps at the boundary). After `train.max_bad_steps` the run aborts.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from vlmctl.distributed.engine import HostValues
from vlmctl.errors import VlmctlError
from vlmctl.train.objectives import check_batch, has_hook

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported; queue (standard library, not loaded at the CLI's start-up)
# too. Light vlmctl modules and modules the start-up loads anyway sit next to their use as well.


def prefetch(batches: Iterator[dict[str, Any]], prepare=None, depth: int = 2, device=None) -> Iterator[dict[str, Any]]:
    """Yield `prepare(batch)` (or the batch itself) for each batch of `batches`, computed up to `depth` batches
    ahead in a background thread, so CPU-side preparation (reading from the DataLoader, Qwen-VL's mRoPE positions)
    overlaps the device's work on the current step instead of idling it between steps. With a CUDA `device` the
    batches' tensors are also put in pinned memory there (`pin_batch`), so that `to_device` copies them without
    holding the host. Exceptions raised while preparing are re-raised in the consumer at the batch where they
    happened."""
    import queue
    import threading

    done = object()
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    pin = device is not None and getattr(device, "type", None) == "cuda"

    def work() -> None:
        try:
            if pin:  # this thread's CUDA calls on the rank's own GPU (pinning would otherwise open one on GPU 0)
                import torch

                torch.cuda.set_device(device)
            for batch in batches:
                batch = prepare(batch) if prepare is not None else batch
                if not put(pin_batch(batch) if pin else batch):
                    return
            put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)

    thread = threading.Thread(target=work, name="vlmctl-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def pin_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with its CPU tensors in pinned (page-locked) host memory: a copy from pageable memory to the GPU holds
    the host while the driver stages it, even with `non_blocking`; from pinned memory it is queued and returns."""
    import torch

    def pin(v):
        if isinstance(v, dict):  # a vision tower's precomputed inputs (`train.tower_inputs`)
            return {k: pin(x) for k, x in v.items()}
        return v.pin_memory() if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_pinned() else v

    return {k: pin(v) for k, v in batch.items()}


def to_device(batch: dict[str, Any], device) -> dict[str, Any]:
    """`batch` with its tensors (and those of a dict value: a vision tower's precomputed inputs) on `device`, copied
    without a host sync where they are pinned."""
    def move(v):
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        return v.to(device, non_blocking=True) if hasattr(v, "to") else v

    return {k: move(v) for k, v in batch.items()}


class StepTimer:
    """One rank's forward + backward seconds in a step (CUDA events on a GPU, host clocks otherwise) and its
    seconds blocked waiting for the data loader (host clock)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.data_s = 0.0

    def mark(self):
        """A point in time on the device's stream (a recorded CUDA event) or on the host clock."""
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.monotonic()

    def span(self, start) -> None:
        """Count the time from `start` (a `mark`) to now as compute."""
        self.spans.append((start, self.mark()))

    def next_batch(self, batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
        """`next(batches)`, its blocking time counted as data wait."""
        start = time.monotonic()
        batch = next(batches)
        self.data_s += time.monotonic() - start
        return batch

    def compute_s(self) -> float:
        """The spans' total seconds; on a GPU this waits for the last span's end (the step's one synchronize)."""
        if not self.spans:
            return 0.0
        if self.cuda:
            self.spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1000.0
        return float(sum(b - a for a, b in self.spans))


@dataclass
class TrainState:
    step: int = 0
    consumed: int = 0  # micro-batches consumed per rank since the start of training
    bad_steps: int = 0
    tokens: int = 0  # real tokens seen, global
    best: dict[str, Any] | None = None  # validation.Best of the run so far (`train.eval_steps`), as a dict

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any], dp_size: int | None = None) -> "TrainState":
        """The position a checkpoint's trainer_state.json records. Resumed on `dp_size` data-parallel ranks where
        the checkpoint had another number (its `dp_size`, else `world_size`), the per-rank count is rescaled so the
        run continues at the same global micro-batch: the samplers deal one global sequence of micro-batches."""
        consumed = int(saved["consumed_micro_batches"])
        before = saved.get("dp_size") or saved.get("world_size")
        if dp_size and before and int(before) != dp_size:
            consumed = consumed * int(before) // dp_size
        return cls(step=saved["step"], consumed=consumed, bad_steps=saved.get("bad_steps", 0),
                   tokens=saved.get("tokens_seen", 0), best=saved.get("best"))


@dataclass
class StepResult:
    loss: float | None  # None for a skipped (bad) step
    grad_norm: float | None
    label_tokens: int
    text_tokens: int
    visual_tokens: int
    dummy_images: int
    samples: int
    stop: bool
    bad: bool
    flops: float = 0.0  # training FLOPs of the step's global batch (0 without a cost model)
    lr: float | None = None  # the learning rate of the step's update (before the scheduler stepped)
    # per data-parallel rank, in rank order: forward + backward seconds, seconds waiting for the data loader, FLOPs
    rank_compute_s: list[float] = field(default_factory=list)
    rank_data_wait_s: list[float] = field(default_factory=list)
    rank_flops: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's own (`Objective.metrics`), logged as they are


@dataclass
class Trainer:
    """The loop. `save(step, state, reason)` and `log(row)` are given by the worker (checkpoint and metrics).

    `engine`: the rank's `distributed.engine.Engine`; `objective`: the `train.objectives.Objective` trained on.

    `flops_of(batch)`: training FLOPs of one collated micro-batch (`flops.CostModel.batch_flops`), computed on the
    CPU batch before its device copy; the row's `mfu` comes from their sum. `dp_group`: the data-parallel process
    group the loss and counts are reduced over (`ParallelDims.dp_group`; None = the default group, the world).
    `sp_group`: this rank's sequence-parallel group (`ParallelDims.sp_group`), whose ranks share a batch and each
    compute part of its loss; None without sequence parallelism. `gc_freeze_step`: after that many steps of this
    process its heap is frozen out of the garbage collector's reach (`serve.heap.freeze_heap`, `train.gc_freeze_step`; 0: never).
    """

    engine: Any
    objective: Any
    batches: Iterator[dict[str, Any]]
    env: Any  # distributed.env.DistEnv
    state: TrainState
    total_steps: int
    grad_accum: int
    batches_per_epoch: int
    save_steps: int
    logging_steps: int
    max_bad_steps: int
    save: Any
    log: Any
    progress: Any
    flops_of: Any = None  # callable(collated CPU micro-batch) -> FLOPs, or None (no MFU)
    peak_flops: float | None = None  # per device, FLOP/s
    device_name: str = "cpu"  # recorded in every metrics row
    dp_group: Any = None
    sp_group: Any = None
    validator: Any = None
    gc_freeze_step: int = 0  # steps of this process after which its heap is frozen (`train.gc_freeze_step`; 0: never)
    frozen_objects: int = 0  # objects the freeze moved out of the collector's reach (0: not frozen)
    _steps_run: int = field(default=0, init=False)  # steps this process ran (a resumed run counts from its restart)
    _signal: int | None = field(default=None, init=False)
    _checked: bool = field(default=False, init=False)
    _extra: dict = field(default_factory=dict, init=False)  # the window's summed objective metrics

    def install_signal_handlers(self) -> dict:
        """SIGTERM/SIGINT: finish the current step, save a checkpoint, stop (SLURM preemption, Ctrl-C).
        Returns the previous handlers."""
        def handler(signum, frame):
            self._signal = signum

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def train(self) -> str:
        """Run steps until `total_steps` or a signal; returns "done", "interrupted" (SIGINT on this rank) or
        "stopped" (SIGTERM, or a signal on another rank)."""
        previous = self.install_signal_handlers()
        try:
            outcome = self._train()
            return "interrupted" if outcome == "stopped" and self._signal == signal.SIGINT else outcome
        finally:
            self.release_heap()
            for sig, old in previous.items():
                signal.signal(sig, old)

    def release_heap(self) -> None:
        """Give a heap `train_step` froze back to the collector (`gc.unfreeze`), for a process that goes on after
        training (the export, a test session)."""
        if self.frozen_objects:
            from vlmctl.serve.heap import unfreeze_heap

            unfreeze_heap()
            self.frozen_objects = 0

    def _train(self) -> str:
        interval: list[StepResult] = []
        t0, paused = time.monotonic(), 0.0  # paused: seconds of the interval spent saving, not training
        while self.state.step < self.total_steps:
            result = self.train_step()
            self.state.step += 1
            interval.append(result)
            if result.bad:
                self.state.bad_steps += 1
                if self.state.bad_steps > self.max_bad_steps:
                    raise VlmctlError(
                        f"{self.state.bad_steps} steps had a NaN/inf loss or gradient norm (limit train.max_bad_steps={self.max_bad_steps})",
                        hint="lower train.learning_rate, use bf16 instead of fp16, or check the data at this step")
            step = self.state.step
            val = self._validate(step)  # the validation fields of the row, when due (`train.eval_steps`)
            row = None
            if val or step % self.logging_steps == 0 or step == self.total_steps or result.stop:
                seconds = time.monotonic() - t0 - paused - (val or {}).get("val_s", 0.0)
                row = {**self._row(interval, seconds, save_s=paused), **(val or {})}
                self.log(row)
                interval, t0, paused = [], time.monotonic(), 0.0
            self.progress.update(step, row)
            if result.stop:
                self.save(step, self.state, "signal")
                return "stopped"
            if step % self.save_steps == 0 or step == self.total_steps:
                paused += self._timed_save(step, "interval")
            elif val and self.validator.checkpoint_reason:  # a new best, or the last step before stopping
                paused += self._timed_save(step, self.validator.checkpoint_reason)
            if val and self.validator.stopping:
                self.progress.print(self.validator.stop_message())
                return "done"
        return "done"

    def _validate(self, step: int) -> dict[str, Any] | None:
        """The validation fields of this step's metrics row (`validation.Validator.evaluate`, and its seconds as
        `val_s`) when due, else None; the best so far goes into the state (and so into checkpoints)."""
        if self.validator is None or not self.validator.due(step, self.total_steps):
            return None
        start = time.monotonic()
        val = self.validator.evaluate(step)
        self.state.best = self.validator.best.as_dict()
        stop = {"early_stop": True} if self.validator.stopping else {}  # loss.png marks the step
        return {**val, **stop, "val_s": round(time.monotonic() - start, 3)}

    def _timed_save(self, step: int, reason: str) -> float:
        """`save` a checkpoint; returns its seconds, which the next metrics row leaves out of its throughput."""
        start = time.monotonic()
        self.save(step, self.state, reason)
        return time.monotonic() - start

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (the ranks the global batch is split over)."""
        import torch.distributed as dist

        return dist.get_world_size(self.dp_group)

    @property
    def sp_size(self) -> int:
        """Sequence-parallel ranks per group (1 without sequence parallelism)."""
        import torch.distributed as dist

        return dist.get_world_size(self.sp_group) if self.sp_group is not None else 1

    def train_step(self) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches of this rank."""
        import torch
        import torch.distributed as dist

        timer = StepTimer(self.env.device)
        lr = self.engine.lr  # the rate of this step's update: the schedule moves on when it steps (DeepSpeed: in micro_step)
        if has_hook(self.objective, "reuses_window") and self.objective.reuses_window(self.state.step):
            window = self.objective.prepare_window(self.engine, None, step=self.state.step)  # GRPO's num_iterations
        else:
            window = [timer.next_batch(self.batches) for _ in range(self.grad_accum)]
            self.state.consumed += len(window)
            if has_hook(self.objective, "prepare_window"):  # e.g. GRPO: rollouts generated, scored, made into rows
                window = self.objective.prepare_window(self.engine, window, step=self.state.step)
        flops = float(sum(self.flops_of(b) for b in window)) if self.flops_of is not None else 0.0
        # The loss is a mean over the assistant tokens of the whole global batch: count them first. (This first
        # collective is also where the ranks wait for one whose data came late, before any compute is timed.)
        if not self._checked:  # the first window of this process: the batches hold what the objective reads
            check_batch(self.objective, window[0])
            self._checked = True
        total_tokens = float(sum(self.objective.label_tokens(b) for b in window))
        if self.dp_size > 1:  # with one data-parallel rank no device round trip: it would wait for the last update
            label_tokens = torch.tensor([total_tokens], device=self.env.device)
            dist.all_reduce(label_tokens, group=self.dp_group)
            total_tokens = float(label_tokens)
        # gradients are averaged over the data-parallel and sequence-parallel ranks (`ParallelDims.grad_mesh`)
        loss_sum, bad = self._accumulate(window, scale=self.dp_size * self.sp_size / max(total_tokens, 1.0), timer=timer)
        # the stats leave the device before the update is queued: reading them does not wait for the update
        stats = self._reduce_stats(window, loss_sum, flops)
        grad_norm = self.engine.step(skip=bad)
        bad = bad or grad_norm is None and self.engine.none_norm_skips
        stats, extra = self._read_stats(stats)
        ranks = self._gather_ranks([timer.compute_s(), timer.data_s, flops])
        text, visual = int(stats[1]), int(stats[2])
        self.state.tokens += text + visual
        self._steps_run += 1
        if self._steps_run == self.gc_freeze_step:
            from vlmctl.serve.heap import freeze_heap  # the server's own freeze after its warm-up

            self.frozen_objects = freeze_heap()
        return StepResult(
            loss=None if bad else float(stats[0]) / max(total_tokens, 1.0), grad_norm=grad_norm, label_tokens=int(total_tokens),
            text_tokens=text, visual_tokens=visual, dummy_images=int(stats[3]), samples=int(stats[4]),
            stop=bool(stats[6] > 0), bad=bad, flops=float(stats[5]), lr=lr,
            rank_compute_s=[r[0] for r in ranks], rank_data_wait_s=[r[1] for r in ranks], rank_flops=[r[2] for r in ranks],
            metrics={} if bad else self.objective.metrics(extra, total_tokens),
        )

    def _gather_ranks(self, values: list[float]) -> list[list[float]]:
        """`values` of every data-parallel rank, in rank order (one all-gather; none with a single rank)."""
        import torch
        import torch.distributed as dist

        if self.dp_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        every = [torch.zeros_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(every, mine, group=self.dp_group)
        return [t.tolist() for t in every]

    def _accumulate(self, window: list[dict[str, Any]], scale: float, timer: StepTimer | None = None):
        """Forward and backward of each micro-batch (gradients synchronized on the last), timed by `timer`; returns
        (summed loss as a float64 tensor, whether a micro-batch was skipped for a non-finite loss). The objective's
        extra metrics of the back-propagated micro-batches are summed into `_extra`."""
        import torch
        import torch.distributed as dist

        device = self.env.device
        timer = timer or StepTimer(device)
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self._extra = {}
        bad = False
        for i, batch in enumerate(window):
            batch = to_device(batch, device)
            with self.engine.sync(last=i == len(window) - 1):
                start = timer.mark()
                out = self.engine.forward(self.objective, batch)
                loss = out.loss
                timer.span(start)  # before the finiteness check, where ranks wait for each other
                # over every rank (not only the data-parallel ones): all of them must skip the same backward
                finite = torch.tensor([1.0 if bool(torch.isfinite(loss.detach())) else 0.0], device=device)
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
                if float(finite) == 1.0:
                    start = timer.mark()
                    self.engine.backward(loss, scale)
                    timer.span(start)
                    loss_sum += loss.detach().double()
                    for name, value in out.metrics.items():
                        self._extra[name] = self._extra.get(name, 0.0) + float(value)
                else:
                    bad = True
            self.engine.micro_step()
        return loss_sum, bad

    def _reduce_stats(self, window: list[dict[str, Any]], loss_sum, flops: float) -> tuple[HostValues, list[str]]:
        """[loss sum, text tokens, visual tokens, dummy images, samples, FLOPs, stop flag, the objective's extra
        metric sums of the window] summed over the data-parallel ranks (float64), on their way to the host
        (`HostValues`: queued without a host sync), and the extra metrics' names. One all-reduce carries them all;
        with one data-parallel rank none runs. `_read_stats` reads them."""
        import torch
        import torch.distributed as dist

        from vlmctl.inference.inputs import to_device as to_device_async

        if self.sp_group is not None:  # each sequence rank holds part of its batch's loss
            loss_sum = loss_sum.clone()
            dist.all_reduce(loss_sum, group=self.sp_group)
        names = sorted(self._extra)  # every rank holds the same names: the objective's, for every good micro-batch
        host = torch.tensor([
            0.0,  # the loss sum, added on the device
            float(sum(b["num_text_tokens"] for b in window)),
            float(sum(b["num_visual_tokens"] for b in window)),
            float(sum(b["num_dummy_images"] for b in window)),
            float(sum(b["num_samples"] if "num_samples" in b else int(b["input_ids"].shape[0]) - b["num_dummy_images"] for b in window)),
            flops,
            1.0 if self._signal is not None else 0.0,
            *(self._extra[name] for name in names),
        ], dtype=torch.float64)
        stats = to_device_async(host, self.env.device)  # a copy from pageable memory would wait for the device's queue
        stats[0] += loss_sum.to(torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(stats, group=self.dp_group)
        if self.dp_size != dist.get_world_size():  # other parallel dimensions: a signal stops every rank
            flag = stats[6:7].clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stats[6:7] = flag
        return HostValues(stats), names

    @staticmethod
    def _read_stats(queued: tuple[HostValues, list[str]]):
        """The values `_reduce_stats` queued: ([loss sum, text tokens, visual tokens, dummy images, samples, FLOPs,
        stop flag] as a float64 host tensor, the extra metric sums by name). Waits for their copy alone."""
        values, names = queued
        stats = values.get()
        extra = {name: float(stats[7 + i]) for i, name in enumerate(names)}
        return stats[:7], extra

    def _row(self, interval: list[StepResult], seconds: float, save_s: float = 0.0) -> dict[str, Any]:
        """The metrics row of `interval`: `seconds` of training (checkpoint time excluded), `save_s` the seconds
        spent saving in the interval (reported apart so tokens/s after a checkpoint stays comparable)."""
        import torch

        last = interval[-1]
        n = len(interval)
        good = [r.loss for r in interval if r.loss is not None]
        text = sum(r.text_tokens for r in interval)
        visual = sum(r.visual_tokens for r in interval)
        tps = (text + visual) / max(seconds, 1e-9)
        mfu = None
        if self.flops_of is not None:
            from vlmctl.train.flops import mfu as utilization

            mfu = utilization(sum(r.flops for r in interval), seconds, self.peak_flops, self.env.world_size)
        memory = None
        if self.env.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.env.device) / 2**30
        from vlmctl.train.metrics import straggler_stats

        return {
            "step": self.state.step,
            "epoch": round(self.state.consumed / self.batches_per_epoch, 4),
            "loss": last.loss,
            "loss_avg": sum(good) / len(good) if good else None,
            "lr": self.engine.lr if last.lr is None else last.lr,
            "grad_norm": last.grad_norm,
            "label_tokens": last.label_tokens,
            "text_tokens": text,
            "visual_tokens": visual,
            "tokens_per_s": tps,
            "text_tokens_per_s": text / max(seconds, 1e-9),
            "visual_tokens_per_s": visual / max(seconds, 1e-9),
            "step_time_s": seconds / n,
            "save_s": round(save_s, 3),
            "mfu": mfu,
            "memory_gib": memory,
            "dummy_images": sum(r.dummy_images for r in interval),
            "bad_steps": self.state.bad_steps,
            "tokens_seen": self.state.tokens,
            "device": self.device_name,
            **straggler_stats(interval, seconds),
            **last.metrics,
        }
