"""The `auto` values of `train.tokens_per_batch`, `train.micro_batch_size`, `train.activation_checkpointing` and
`train.fp8`.

On a GPU with a torch strategy (ddp, fsdp) every rank runs a short probe on the wrapped model before the data
loader is built: for each activation checkpointing mode (off, vision tower only, op, every 2nd layer, full) it
measures the peak GPU memory of a forward + backward pass (`torch.cuda.max_memory_allocated`, max over ranks) on rows of two sizes built
from the training data's heaviest samples (most FLOPs per token), fits peak = base + per_unit x size, adds the AdamW state the first
optimizer step will allocate (two moments per trainable parameter in the stored dtype), and takes the largest size
that stays within `MEMORY_FRACTION` of the GPU's memory (less what other processes hold). That size is run once
to check it fits and twice more, on a typical row (samples in a fixed random order), to time it (the second pass:
the first refills the allocator's cache, emptied after every trial); the mode with the most tokens (samples) per
second wins, counting for each row its share of one optimizer step (timed once before the trials, `measure_step`:
a fixed cost per step that weighs more on short rows). A size is a
row's token budget with packing, the samples of a padded micro-batch without.

Where the plan leaves `train.fp8` to the probe (`auto` on a GPU with float8 tensor cores, the language model's full
weights trained), the layers large enough for tensorwise float8 were converted (`distributed.parallelize` step 0)
and compute in bf16 while the modes are searched; then `float8_trial` times the chosen mode and size with them in
float8 (at fewer tokens where float8 needs more memory than the bf16 rows were fitted to) and again in bf16, and
keeps float8 where it was faster by more than `FP8_MARGIN`.

The choice is printed, written to `RUN_DIR/autotune.json` (every trial: mode, size, peak GiB, seconds) and into
the run's plan (`RUN_DIR/plan.json`, `vlmctl.config.plan.settle_probe`); a resumed run reuses it, so its batches
and data order stay those of the first run. Which keys the probe settles, and the fixed values elsewhere (CPU,
DeepSpeed, whose engine accumulates gradients across backward passes), are the plan's decisions
(`vlmctl.config.plan.build_plan`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmctl.config.plan import (DEFAULT_MICRO_BATCH, DEFAULT_TOKENS, PROBED_KEYS, pending, settle_probe,  # noqa: F401
                                write_plan)

# numpy and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

MEMORY_FRACTION = 0.92  # of the GPU's memory a choice may plan for: the rest absorbs fragmentation and the
#                         optimizer step's temporaries
MAX_TOKENS = 65536  # beyond this a longer row adds little speed and makes epochs coarse
MAX_MICRO_BATCH = 256
TOKEN_STEP = 512  # packed budgets are multiples of this
CANDIDATES = ("off", "vision", "op", 2, "full")
CHECKS = 3  # trials at a predicted size before settling for the largest size measured to fit
RECORD = "autotune.json"
FP8_MARGIN = 0.02  # float8 must beat bf16's rate by more than this share: the timing of one pass varies ~1-2%


@dataclass
class Trial:
    """One probe pass: checkpointing `mode`, `size` (tokens per row, or samples per micro-batch), the peak GPU
    memory in bytes (max over ranks, optimizer state excluded), the forward + backward seconds (max over ranks) and
    whether it ran out of memory."""

    mode: Any
    size: int
    peak_bytes: int
    seconds: float
    oom: bool = False


@dataclass
class Choice:
    """What `auto` resolved to, and why."""

    tokens_per_batch: int | None = None
    micro_batch_size: int | None = None
    activation_checkpointing: Any = None
    reason: str = ""
    budget_bytes: int | None = None
    state_bytes: int | None = None
    trials: list[Trial] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)  # mode -> size units per second at its chosen size
    step_seconds: float = 0.0  # the optimizer step's share of a row, counted in the rates
    fp8: str | None = None  # the float8 trial's choice for train.fp8: auto (tensorwise or off); None: no trial
    fp8_reason: str = ""

    def apply(self, train) -> list[str]:
        """Write the chosen values into `train` (a run's resolved copy) where the probe was to settle them
        (`vlmctl.config.plan.settle_probe`); returns "key=value" for each."""
        return settle_probe(None, train, self)[1]


def wants(plan) -> set[str]:
    """The keys the probe settles on each rank by the run's `plan` (a RunPlan): the batch size of the batching in
    use, and activation checkpointing, where the config left them to auto on a GPU with ddp/fsdp."""
    return plan.probing


def fixed_record(plan) -> Choice | None:
    """The plan's auto values that no probe measured (the batching not in use; all of them where no probe runs), as
    the Choice a run's `autotune.json` records; None when the plan has none (nothing was auto)."""
    fixed = {k: getattr(plan, k) for k in PROBED_KEYS if getattr(plan, k).auto and k not in plan.probing}
    if not fixed:
        return None
    reasons = [d.reason for d in fixed.values() if not d.reason.startswith("not used")]
    return Choice(**{k: d.value for k, d in fixed.items()}, reason=(reasons or [d.reason for d in fixed.values()])[0])


# ------------------------------------------------------------------------------------------------- the search


def fit_size(small: Trial, large: Trial, budget: int, state: int, *, floor: int, cap: int, step: int) -> int:
    """The largest size (a multiple of `step`, within [floor, cap]) whose predicted peak, base + slope x size from
    the two trials plus `state` bytes, stays within `budget`; 0 when even `floor` does not fit."""
    if large.size == small.size:
        slope = small.peak_bytes / max(small.size, 1)
        base = 0.0
    else:
        slope = max((large.peak_bytes - small.peak_bytes) / (large.size - small.size), 1.0)
        base = small.peak_bytes - slope * small.size
    size = int((budget - state - base) // slope)
    size = min(cap, size - size % step if size >= step else size)
    return size if size >= floor else 0


def _round(size: int, step: int) -> int:
    return size - size % step if size >= step else size


def _reported(run: Callable[..., Trial], state: int, log) -> Callable[..., Trial]:
    """`run` that logs one line per trial (mode, tokens, peak GiB with `state` bytes added, seconds): a probe's first
    trials compile the layers (a minute or more on a large model), and a start-up that runs into a time limit
    shows how far it got."""

    def reported(mode, size: int, timed: bool = False) -> Trial:
        trial = run(mode, size, timed=timed)
        what = "out of memory" if trial.oom else f"peak {(trial.peak_bytes + state) / 2**30:.1f} GiB"
        log(f"  trial {mode}, {size} tokens{' (timed)' if timed else ''}: {what}, {trial.seconds:.1f} s")
        return trial

    return reported


def search(run: Callable[[Any, int], Trial], *, modes, sizes: tuple[int, int], budget: int, state: int, floor: int,
           cap: int, step: int, overhead: float = 0.0, log=lambda msg: None) -> Choice:
    """For each mode: two trials at `sizes` -> predicted largest fitting size (`_largest_fit`) -> a timed trial; the
    mode with the best size / (seconds + `overhead`) wins (on a tie the one with the larger size). `overhead`: the
    seconds a row costs outside forward + backward (its share of the optimizer step), which weigh more on short rows.
    `run(mode, size, timed=False)` returns a Trial; the timed trial passes `timed=True` (the caller may time it on a
    typical batch rather than the heaviest). Returns the Choice with `size` in `tokens_per_batch` (callers move it
    for padded batches) and every trial; reason names the winner.
    When no mode fits `floor`, the mode that fits the largest size is taken at that size."""
    trials: list[Trial] = []
    rates: dict[str, float] = {}
    best: tuple[float, int, Any] | None = None
    fallback: tuple[int, Any] | None = None
    run = _reported(run, state, log)
    for mode in modes:
        a, b = run(mode, sizes[0]), run(mode, sizes[1])
        trials += [a, b]
        if a.oom:
            continue
        size = _largest_fit(run, mode, a, b, trials, budget=budget, state=state, cap=cap, step=step)
        if size <= 0:
            continue
        if size < floor:
            if fallback is None or size > fallback[0]:
                fallback = (size, mode)
            continue
        timed = run(mode, size, timed=True)
        trials.append(timed)
        if timed.oom or timed.seconds <= 0:
            continue
        rate = size / (timed.seconds + overhead)
        rates[str(mode)] = rate
        log(f"  {mode}: {size} -> {rate:,.0f}/s, peak {(timed.peak_bytes + state) / 2**30:.1f} GiB")
        if best is None or (rate, size) > best[:2]:
            best = (rate, size, mode)
    if best is None:
        if fallback is None:
            raise RuntimeError("no activation checkpointing mode fits the smallest probe in GPU memory")
        size, mode = fallback
        return Choice(tokens_per_batch=size, activation_checkpointing=mode, trials=trials, rates=rates,
                      budget_bytes=budget, state_bytes=state, step_seconds=overhead,
                      reason=f"nothing fits the longest sample ({floor}); {mode} fits the most")
    rate, size, mode = best
    return Choice(tokens_per_batch=size, activation_checkpointing=mode, trials=trials, rates=rates, budget_bytes=budget,
                  state_bytes=state, step_seconds=overhead, reason=f"probe: fastest that fits ({rate:,.0f}/s)")


def _largest_fit(run, mode, a: Trial, b: Trial, trials: list[Trial], *, budget: int, state: int, cap: int,
                 step: int) -> int:
    """The largest size of `mode` measured to fit `budget` with `state` bytes added, from its two trials `a` and `b`:
    the linear prediction is checked by a trial (appended to `trials`); a miss refits through the miss, or bisects
    towards the largest size known to fit after running out of memory, at most CHECKS times. 0 when none fits."""
    good = b if not b.oom and b.peak_bytes + state <= budget else a
    size = fit_size(a, b if not b.oom else a, budget, state, floor=1, cap=cap, step=step)
    for _ in range(CHECKS):
        if size <= good.size:
            break
        check = run(mode, size)
        trials.append(check)
        if not check.oom and check.peak_bytes + state <= budget:
            return size
        if check.oom:
            size = _round((good.size + size) // 2, step)
        else:
            size = min(size - step, fit_size(good, check, budget, state, floor=1, cap=cap, step=step))
    return good.size if good.peak_bytes + state <= budget else 0


# ------------------------------------------------------------------------------------------- on the GPU


def optimizer_state_bytes(model, stored_bytes: int) -> int:
    """Bytes of the AdamW moments the first step allocates on this rank: 2 x the local (sharded) elements of the
    trainable parameters x `stored_bytes`."""
    n = 0
    for p in model.parameters():
        if p.requires_grad:
            n += (p.to_local() if hasattr(p, "to_local") else p).numel()
    return 2 * n * stored_bytes


def memory_budget(device) -> int:
    """Bytes a choice may plan for on `device`: MEMORY_FRACTION of its memory, less what is held outside this
    process's caching allocator (CUDA context, NCCL buffers, other processes)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    return int(MEMORY_FRACTION * total) - outside


def probe_rows(lengths, make_batch, *, packing: bool, costs=None):
    """`rows(size)` -> one batch of the data's most memory-hungry samples: a packed row filled to at most `size`
    tokens, or `size` samples padded to the longest (the longest samples first, repeated as needed). `lengths` is
    the per-sample token count (np.ndarray); `make_batch(indices)` collates those samples.
    `rows(size, heaviest=False)` fills the row from the samples in a fixed random order instead: a typical row,
    whose speed is what training sees (a row of the heaviest samples runs more vision tower per token than most).

    With `costs` (estimated training FLOPs per sample, `vlmctl.train.flops.CostModel.sample_costs`) a packed row
    takes the samples of the most FLOPs per token first (longest first among equals): a visual token costs the
    vision tower's activations for its patches besides the language model's, so a row of image-heavy samples
    needs more memory than a row of the same length of long text, and the probe must plan for the heaviest row
    training can draw."""
    import numpy as np

    lengths = np.asarray(lengths)
    if packing and costs is not None:
        per_token = np.asarray(costs, dtype=np.float64) / np.maximum(lengths, 1)
        order = [int(i) for i in np.lexsort((-lengths, -per_token))]
    else:
        order = [int(i) for i in np.argsort(-lengths, kind="stable")]

    typical = [int(i) for i in np.random.default_rng(0).permutation(len(lengths))]

    def rows(size: int, heaviest: bool = True):
        sequence = order if heaviest else typical
        if not packing:
            return make_batch([sequence[i % len(sequence)] for i in range(size)])
        picked, used = [], 0
        fitting = [i for i in sequence if lengths[i] <= size]
        while fitting:
            added = False
            for i in fitting:
                if used + int(lengths[i]) <= size:
                    picked.append(i)
                    used += int(lengths[i])
                    added = True
            if not added:
                break
        return make_batch(picked)

    return rows


def measure_pass(engine, objective, batch, device, group=None) -> tuple[int, float]:
    """Peak GPU bytes and seconds of one forward + backward of `batch` through `engine` with `objective`'s loss
    (gradients then dropped), max over ranks."""
    import torch
    import torch.distributed as dist

    from vlmctl.train.loop import to_device

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = engine.forward(objective, to_device(batch, device)).loss
    engine.backward(loss, 1.0 / max(1, int(objective.label_tokens(batch) or 1)))
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del loss
    engine.optimizer.zero_grad(set_to_none=True)
    out = torch.tensor([float(torch.cuda.max_memory_allocated(device)), seconds], device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    torch.cuda.empty_cache()
    return int(out[0].item()), float(out[1].item())


def measure_step(engine, device, group=None) -> float:
    """Seconds of one optimizer step of `engine` (a torch engine: gradient norm and AdamW over every trained parameter), max over
    ranks: the part of a training step the probe's forward + backward passes leave out, the same for every row
    size (0.13 s for the 3B's AdamW with stochastic rounding on an H100, docs/benchmarks.md). The fastest of the
    second and third of three steps on zero gradients at learning rate 0 (the first allocates the moments and
    compiles the stochastic-rounding step; the second still ran 5x the training step's figure under FSDP2 on 2 GPUs):
    the weights keep their values (an update and a weight decay of 0 x lr; a bf16 value rounds to itself) and the
    moments are dropped again, so training starts from the state it had. 0.0 when the optimizer already has
    state (a resumed run) or steps inside backward (`train.optimizer_in_backward`)."""
    import torch
    import torch.distributed as dist

    from vlmctl.distributed.engine import total_grad_norm

    optimizer = engine.optimizer
    if optimizer.state or hasattr(optimizer, "grad_norm") or not engine.params:
        return 0.0
    lrs = [param_group["lr"] for param_group in optimizer.param_groups]
    try:
        for param_group in optimizer.param_groups:
            param_group["lr"] = torch.zeros_like(param_group["lr"]) if torch.is_tensor(param_group["lr"]) else 0.0
        for p in engine.params:
            p.grad = torch.zeros_like(p)
        times = []
        for _ in range(3):
            _synchronize(device)
            t0 = time.perf_counter()
            if getattr(optimizer, "clips_on_device", False):  # as TorchEngine.step: the norm, the clipped update
                engine.queue_update()
            else:
                total_grad_norm(engine.params)
                optimizer.step()
            _synchronize(device)
            times.append(time.perf_counter() - t0)
        seconds = min(times[1:])
    finally:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
        for param_group, lr in zip(optimizer.param_groups, lrs):
            param_group["lr"] = lr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = torch.tensor([seconds], device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return float(out.item())


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def candidates(train, layer_groups=None) -> tuple:
    """The checkpointing modes the probe tries for `train.activation_checkpointing: auto`: CANDIDATES, without op
    under compiled decoder layers (`train.compile: on`), and without vision where `layer_groups` ([decoder layers,
    vision blocks]) show no vision block with a trainable parameter (a frozen tower keeps no activations for
    backward, so vision would measure off again). Why no op under compile: compiled, op's per-op policy ran slower
    than every 2nd layer in every probe on an H100 (LoRA 15,033 against 24,657 tokens/s), and its one win in the
    probe (17,101 against full's 17,077) trained at 14,080 (docs/benchmarks.md); its compilation also cost the most
    start-up time (45 s)."""
    modes = tuple(m for m in CANDIDATES if m != "op") if train.compile == "on" else CANDIDATES
    if layer_groups is not None and not any(p.requires_grad for blocks in layer_groups[1:] for block in blocks
                                            for p in block.parameters()):
        modes = tuple(m for m in modes if m != "vision")
    return modes


@contextlib.contextmanager
def paused(optimizer):
    """While open, an optimizer that steps inside backward (`train.optimizer_in_backward`: its `paused` flag) leaves
    the weights alone: the probe's passes run backward without training."""
    pause = getattr(optimizer, "paused", None)
    if pause is not None:
        optimizer.paused = True
    try:
        yield
    finally:
        if pause is not None:
            optimizer.paused = False


def float8_trial(run: Callable[..., Trial], choice: Choice, model, *, budget: int, state: int, overhead: float,
                 floor: int, step: int, log=lambda msg: None) -> None:
    """`train.fp8: auto`'s trial: the converted layers of `model` (`distributed.float8`; none where no language-model
    linear is large enough) run `choice`'s mode and size in float8, then once more in bf16, each timed as `search`
    times a mode (`run(mode, size, timed=True)`: the second of two passes on a typical row; the first compiles the
    layers for float8) with `overhead` seconds of optimizer step per row. The size was fitted to `budget` in bf16:
    where float8's peak (with `state` bytes) exceeds it, float8 runs once more at the size that fits by the mode's
    bytes per size unit (`_float8_size`, a multiple of `step`, at least `floor`). float8 is kept (choice.fp8 =
    "tensorwise", and its size in choice.tokens_per_batch) where its rate beats the better bf16 rate (the search's,
    the one after) by more than `FP8_MARGIN` and it fits; else the layers go back to bf16 (choice.fp8 = "off"). The
    trials join choice.trials; choice.fp8_reason says what was measured."""
    from vlmctl.distributed import float8

    mode, size = choice.activation_checkpointing, choice.tokens_per_batch
    if not float8.float8_layers(model):
        choice.fp8, choice.fp8_reason = "off", "off: no language-model linear is large enough for float8 (torchao's rule)"
        log(f"  float8 trial: {choice.fp8_reason}")
        return
    float8.use_float8(model, True)
    fast = run(mode, size, timed=True)
    fits = lambda t: not t.oom and t.peak_bytes + state <= budget  # noqa: E731
    if not fast.oom and not fits(fast) and (smaller := _float8_size(choice.trials, fast, budget - state, floor, step)):
        choice.trials.append(fast)
        fast = run(mode, smaller, timed=True)
    float8.use_float8(model, False)
    slow = run(mode, size, timed=True)
    choice.trials += [fast, slow]
    rate = lambda t: 0.0 if t.oom or t.seconds <= 0 else t.size / (t.seconds + overhead)  # noqa: E731
    bf16, fp8 = max(rate(slow), choice.rates.get(str(mode), 0.0)), rate(fast)
    measured = (f"{fp8 / bf16 if bf16 else 0:.2f}x bf16 ({fp8:,.0f}/s at {fast.size} vs {bf16:,.0f}/s at {size} per "
                f"row, activation checkpointing {mode})")
    if not fits(fast):
        choice.fp8, choice.fp8_reason = "off", f"off: float8 did not fit in GPU memory ({fast.size} per row, {mode})"
    elif bf16 > 0 and fp8 > bf16 * (1 + FP8_MARGIN):
        float8.use_float8(model, True)
        choice.fp8, choice.fp8_reason = "tensorwise", f"probe: tensorwise float8 {measured}"
        choice.tokens_per_batch = fast.size
    else:
        choice.fp8, choice.fp8_reason = "off", f"off: float8 measured {measured}, not more than {1 + FP8_MARGIN:.2f}x"
    log(f"  float8 trial: {choice.fp8_reason}")


def _float8_size(trials: list[Trial], over: Trial, room: int, floor: int, step: int) -> int:
    """The size at which float8 fits `room` bytes, from `over` (a float8 trial that did not) less its overshoot at
    the mode's bytes per size unit (the slope between its smallest and largest bf16 trials in `trials`), a multiple
    of `step`; 0 below `floor`."""
    done = sorted((t for t in trials if t.mode == over.mode and not t.oom and t.peak_bytes), key=lambda t: t.size)
    slope = over.peak_bytes / max(over.size, 1)
    if len(done) >= 2 and done[-1].size > done[0].size:
        slope = max((done[-1].peak_bytes - done[0].peak_bytes) / (done[-1].size - done[0].size), 1.0)
    size = _round(over.size - math.ceil((over.peak_bytes - room) / slope), step)
    return size if floor <= size < over.size else 0


def probe(train, *, engine, objective, layer_groups, rows, device, lengths, dp_size: int, stored_bytes: int,
          group=None, log=lambda msg: None) -> Choice:
    """Run `search` on the wrapped model behind `engine` with `objective`'s loss: `layer_groups` are the decoder
    layers and vision blocks (checkpointing modes are set on them through `parallelize`'s checkpointing step,
    `distributed.parallelize.checkpoint_layers`), `rows(size)` builds a batch (see `probe_rows`). The modes tried are
    `candidates(train)` when activation_checkpointing is auto, else the configured one; with `train.fp8` still auto,
    `float8_trial` follows at the chosen mode and size. Leaves the chosen mode set on the layers, and their float8
    layers computing as chosen."""
    import torch

    from vlmctl.distributed.parallelize import checkpoint_layers

    modes = (candidates(train, layer_groups) if pending(train.activation_checkpointing)
             else (train.activation_checkpointing,))
    longest = int(max(lengths)) if len(lengths) else 1
    if train.packing:
        total = int(sum(int(x) for x in lengths))
        cap = max(longest, min(MAX_TOKENS, total // max(dp_size, 1)))
        floor, step = longest, TOKEN_STEP
        small = min(cap, max(longest, 2048))
        sizes = (small, min(cap, max(2 * small, small + step)))
        fixed = None if pending(train.tokens_per_batch) else int(train.tokens_per_batch)
    else:
        cap = max(1, min(MAX_MICRO_BATCH, len(lengths) // max(dp_size, 1)))
        floor, step, sizes = 1, 1, (1, min(2, cap))
        fixed = None if pending(train.micro_batch_size) else int(train.micro_batch_size)
    if fixed is not None:  # only the mode is auto: measure at the configured size
        floor, cap, sizes = fixed, fixed, (fixed, fixed)
    state = 0 if engine.optimizer.state else optimizer_state_bytes(engine.model, stored_bytes)

    def run(mode, size: int, timed: bool = False) -> Trial:
        # memory is planned on the heaviest rows; the mode's speed is timed on a typical row of the chosen size
        checkpoint_layers(layer_groups, mode, train)
        try:
            batch = rows(size, heaviest=not timed)
            peak, seconds = measure_pass(engine, objective, batch, device, group)
            if timed:  # the first pass after a trial refills the emptied allocator cache: time the second
                peak2, seconds = measure_pass(engine, objective, batch, device, group)
                peak = max(peak, peak2)
            return Trial(mode=mode, size=size, peak_bytes=peak, seconds=seconds)
        except torch.OutOfMemoryError:
            engine.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return Trial(mode=mode, size=size, peak_bytes=0, seconds=0.0, oom=True)

    with paused(engine.optimizer):
        overhead = measure_step(engine, device, group) / train.gradient_accumulation_steps
        log(f"  optimizer step: {overhead:.3f} s per row, added to each mode's forward + backward")
        budget = memory_budget(device)
        choice = search(run, modes=modes, sizes=sizes, budget=budget, state=state, floor=floor, cap=cap, step=step,
                        overhead=overhead, log=log)
        if pending(train.fp8):
            float8_trial(run, choice, engine.module, budget=budget, state=state, overhead=overhead, floor=floor,
                         step=step, log=log)
    checkpoint_layers(layer_groups, choice.activation_checkpointing, train)
    if not train.packing:
        choice.micro_batch_size, choice.tokens_per_batch = choice.tokens_per_batch, None
    return choice


# ------------------------------------------------------------------------------------------- the record


def load_record(run_dir: Path) -> Choice | None:
    """The choice a previous start of this run recorded, or None."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    data["trials"] = [Trial(**t) for t in data.get("trials", [])]
    return Choice(**data)


def save_record(run_dir: Path, choice: Choice, plan=None) -> None:
    """Write `autotune.json` of `run_dir` and, with `plan` (the RunPlan holding the choice), `plan.json`
    (temporary files, renamed). The project's config.yaml stays as written."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(asdict(choice), indent=2, default=str))
    os.replace(tmp, run_dir / RECORD)
    if plan is not None:
        write_plan(run_dir, plan)


def summary(choice: Choice, applied: list[str]) -> str:
    """One line for the console: what auto chose (checkpointing modes named in words) and why."""
    from vlmctl.distributed.checkpointing import describe

    named = [f"{item} ({describe(choice.activation_checkpointing)})" if item.startswith("activation_checkpointing=")
             else item for item in applied]
    gib = f", plan {choice.budget_bytes / 2**30:.1f} GiB" if choice.budget_bytes else ""
    return f"auto: {', '.join(named)} ({choice.reason}{gib})" if applied else ""



# ------------------------------------------------------------------------------------------- in a run


def record_plan(run_dir: Path, ctx):
    """Rank 0 of a run: write the plan this rank trains with (`ctx.plan`, with its GPU memory) to `plan.json`,
    print it as `vlmctl train --dry-run` printed it, and where no probe runs write the plan's fixed batching values
    to `autotune.json` (`fixed_record`). Returns `ctx`."""
    import sys

    from vlmctl.config.plan import plan_text

    if ctx.env.is_main:
        write_plan(run_dir, ctx.plan)
        print(plan_text(ctx.plan), file=sys.stderr)
        fixed = None if wants(ctx.plan) else fixed_record(ctx.plan)  # CPU, DeepSpeed, the batching not in use
        if fixed is not None:
            save_record(run_dir, fixed)
    return ctx


def tune(cfg, run_dir: Path, ctx, tm, engine, objective, dataset, lengths, log=print) -> Choice | None:
    """Settle the auto keys `wants(cfg.train)` on a wrapped model (`engine`: the loop's torch engine; `objective`:
    the run's): from
    `RUN_DIR/autotune.json` when resuming, else by `probe` on rows of `dataset` (a ShardDataset) collated as
    training collates them (`lengths`: their token counts). Rank 0 records and prints the choice. Returns the
    choice, or None when nothing was auto. A resumed run whose record holds no float8 trial keeps `train.fp8: auto`
    off (its layers compute in bf16, as they did)."""
    from vlmctl.distributed import float8
    from vlmctl.distributed.parallelize import checkpoint_layers

    train, groups = cfg.train, [tm.parts.decoder_layers, tm.parts.vision_layers]
    if not wants(ctx.plan):
        return None
    record = load_record(run_dir) if train.resume is not None else None
    if record is not None:
        trial = pending(train.fp8)
        if trial and record.fp8 is None:
            record.fp8, record.fp8_reason = "off", "off: the run's start-up record holds no float8 trial"
        ctx.plan, applied = settle_probe(ctx.plan, train, record)
        checkpoint_layers(groups, train.activation_checkpointing, train)
        if trial:
            float8.use_float8(engine.module, train.fp8 != "off")
        if ctx.env.is_main:
            write_plan(run_dir, ctx.plan)
            log(f"auto (recorded when the run started): {', '.join(applied)}")
        return record

    if ctx.env.is_main:
        log("auto: probing activation checkpointing and batch size" + (" (then float8)" if pending(train.fp8) else "")
            + " in GPU memory (forward + backward per trial)")
    from vlmctl.train.data import sample_costs

    costs = getattr(dataset, "sample_costs", None)
    if costs is None and train.packing:
        costs = sample_costs(tm.cost_model, dataset, lengths)
    choice = probe_and_apply(train, ctx, tm, engine, objective, lengths, lambda indices, collate: collate([dataset[i] for i in indices]),
                             packing=train.packing, max_length=cfg.data.max_length, costs=costs, log=log)
    if ctx.env.is_main:
        save_record(run_dir, choice, ctx.plan)
    return choice


def probe_and_apply(train, ctx, tm, engine, objective, lengths, collate_rows, *, packing: bool, max_length=None,
                    costs=None, log=print) -> Choice:
    """`probe` on rows of the caller's samples, collated as training collates them, then the choice applied to
    `train` and printed by rank 0. `lengths`: the samples' token counts; `collate_rows(indices, collator)` returns
    the batch of those samples through `collator` (the objective's probe collator, `ObjectiveSpec.collate`: packed
    rows sized to the row, or padded micro-batches);
    `costs`: their estimated training FLOPs, which pick the heaviest rows (`probe_rows`).
    `vlmctl train` (`tune`) and `vlmctl bench` call it on their own data."""
    import numpy as np

    lengths = np.asarray(lengths)

    def make_batch(indices):  # the objective's probe rows (DPO: rows of pairs; GRPO: rows of samples)
        size = int(lengths[indices].sum())
        collator = objective.spec.collate(tm.processor, tm.family, packed=packing, probe=True, max_length=max_length,
                                          tokens_per_batch=max(size, 1) if packing else None)
        batch = collate_rows(indices, collator)
        return tm.prepare(batch) if tm.prepare is not None else batch

    main = ctx.env.is_main
    choice = probe(train, engine=engine, objective=objective, layer_groups=[tm.parts.decoder_layers, tm.parts.vision_layers],
                   rows=probe_rows(lengths, make_batch, packing=packing, costs=costs), device=ctx.env.device, lengths=lengths,
                   dp_size=ctx.dims.dp_size, stored_bytes=ctx.stored.itemsize,
                   # the tp ranks of a group read the same rows: every rank must settle on the same choice
                   group=ctx.dims.dp_group if ctx.dims.tp <= 1 else None,
                   log=log if main else (lambda msg: None))
    ctx.plan, applied = settle_probe(ctx.plan, train, choice)  # recorded in the run's plan
    if main:
        log(summary(choice, applied))
    return choice
