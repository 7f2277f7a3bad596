"""`vlmctl train` units: launch commands, samplers, DeepSpeed config, the step's bad-step handling, schedules and
the optimizer stepped in backward. No training run here (those are in tests/integration/test_train_runs.py)."""

from __future__ import annotations

import json
import re

import pytest

from cli_runner import run_cli as run_cli_inprocess
from real_data import REAL

RUN_TIMEOUT = 150
# what the tiny models' tokenizer is trained on: the generated questions' words
TOKENIZER_TEXTS = ["What color is the triangle? How many circles are there? Is the square left of the circle? "
                   "What shape is the red object? Answer with one word. red green blue yellow purple yes no 0 1 2 3"] * 20





def test_dry_run_prints_each_launcher_command(ready_config, capsys):
    cfg = ready_config("project: {name: p}\ntrain: {strategy: fsdp, nproc_per_node: 2}\n")
    code, out, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "train.run_name=r1"], capsys)
    assert code == 0, err
    run_dir = cfg.parent / "outputs" / "runs" / "r1"
    # 29500 unless another process holds it (single-node runs then take a free port)
    assert re.search(r"torchrun --nproc-per-node 2 --nnodes 1 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint 127\.0\.0\.1:\d+ ", out)
    assert f"-m vlmctl.train.worker {run_dir}" in out
    assert not run_dir.exists()  # a dry run writes nothing
    code, out, _ = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--nnodes", "2", "--node-rank", "1",
                                      "--master-addr", "10.0.0.1", "--master-port", "6000", "train.run_name=r1"], capsys)
    assert code == 0 and "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:6000" in out
    code, out, _ = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--launcher", "accelerate", "train.run_name=r1"], capsys)
    assert code == 0
    assert "accelerate launch --num_processes 2 --num_machines 1 --machine_rank 0 --main_process_ip 127.0.0.1" in out
    assert f"--multi_gpu --module vlmctl.train.worker {run_dir}" in out
    code, out, _ = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--launcher", "none", "train.run_name=r1"], capsys)
    assert code == 0 and f"-m vlmctl.train.worker {run_dir}" in out and "torchrun" not in out
    # nproc auto = visible GPUs, else 1
    code, out, _ = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--nproc-per-node", "auto"], capsys)
    import torch

    assert code == 0 and f"--nproc-per-node {torch.cuda.device_count() or 1} " in out
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--nnodes", "2"], capsys)
    assert code == 2 and "master-addr" in err


def test_slurm_writes_a_requeue_friendly_script(write_config, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch here: the script path is printed instead
    cfg = write_config("project: {name: p}\ntrain: {launcher: slurm, nproc_per_node: 4, nnodes: 2, master_addr: head}\n")
    code, out, err = run_cli_inprocess(["-c", str(cfg), "train", "train.run_name=s1"], capsys)
    assert code == 0, err
    run_dir = cfg.parent / "outputs" / "runs" / "s1"
    script = (run_dir / "sbatch.sh").read_text()
    assert "sbatch" in out and str(run_dir / "sbatch.sh") in out
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --requeue", "#SBATCH --signal=TERM@120",
                 '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"', f"-m vlmctl.train.worker {run_dir}"):
        assert line in script
    # a requeued job resumes from the run's last checkpoint
    assert "resume: auto" in (run_dir / "config.yaml").read_text()


def test_resume_without_a_checkpoint_is_a_clear_error(write_config, capsys):
    cfg = write_config("project: {name: p}\n")
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--resume", "--launcher", "none"], capsys)
    assert code == 2 and "no run with a checkpoint" in err


def test_missing_data_or_model_fails_before_spawning(write_config, capsys, tmp_path):
    cfg = write_config("project: {name: p}\n")
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--launcher", "torchrun"], capsys)
    assert code == 2 and "vlmctl data prepare" in err  # a data source that does not exist (README: exit codes)
    assert not (tmp_path / "outputs" / "runs").exists()


def test_a_plan_the_device_cannot_train_with_is_refused_before_anything_starts(write_config, capsys, tmp_path):
    cfg = write_config("project: {name: p}\n")
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--launcher", "torchrun", "train.precision=fp16",
                                      "train.strategy=ddp"], capsys)
    assert code == 2 and "fp16 needs loss scaling" in err  # before the data and model checks, before torchrun
    assert not (tmp_path / "outputs" / "runs").exists()


def test_post_training_runs_are_named_by_their_objective(write_config):
    from vlmctl.config import load_config
    from vlmctl.train.launch import planned_run_dir, run_prefix

    cfg = write_config("project: {name: demo}\ntrain: {stage: full}\n")
    assert planned_run_dir(load_config(cfg)).name.startswith("demo-full-")
    for objective in ("dpo", "grpo"):
        named = load_config(cfg, [f"train.objective={objective}"])
        assert run_prefix(named) == f"demo-{objective}-" and planned_run_dir(named).name.startswith(f"demo-{objective}-")


def test_checkpoint_discovery_ignores_partial_folders_and_prunes_the_oldest(tmp_path):
    from vlmctl.train.checkpoint import latest_checkpoint, prune

    for step in (2, 4, 6, 8):
        (tmp_path / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-checkpoint-10").mkdir()  # being written when the job died
    (tmp_path / "checkpoints" / "checkpoint-12").mkdir()  # no trainer_state.json: incomplete
    assert latest_checkpoint(tmp_path).name == "checkpoint-8"
    removed = prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == [".tmp-checkpoint-10", "checkpoint-2", "checkpoint-4"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-8" and not (tmp_path / "checkpoints" / "checkpoint-4").exists()


# ------------------------------------------------------------------------------------------ sampler, config


def test_sampler_deals_global_batches_and_resumes_at_the_next_batch():
    import numpy as np

    from vlmctl.data.loader import DistributedBatchSampler

    lengths = np.arange(100) % 17
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    ranks = [DistributedBatchSampler(lengths, micro_batch_size=3, world_size=2, rank=r, seed=1, group_by_length=True) for r in range(2)]
    single = DistributedBatchSampler(lengths, micro_batch_size=6, world_size=1, rank=0, seed=1, group_by_length=True)
    assert ranks[0].batches_per_epoch == 16  # 100 // 6: the incomplete global batch is dropped
    a, b, one = take(ranks[0], 20), take(ranks[1], 20), take(single, 20)
    for x, y, z in zip(a, b, one):  # 2 ranks x 3 == 1 rank x 6, sample for sample
        assert sorted(x + y) == sorted(z) and not set(x) & set(y)
    epoch0 = [i for x, y in zip(a[:16], b[:16]) for i in x + y]
    assert len(set(epoch0)) == 96
    spread = [abs(int(lengths[x].sum()) - int(lengths[y].sum())) for x, y in zip(a, b)]
    assert max(spread) <= 17  # length grouping: similar lengths, dealt with a stride
    resumed = DistributedBatchSampler(lengths, micro_batch_size=3, world_size=2, rank=0, seed=1, group_by_length=True)
    resumed.set_position(7)
    assert take(resumed, 13) == a[7:]


def test_source_weights_change_how_often_samples_are_drawn():
    import numpy as np

    from vlmctl.data.loader import epoch_indices

    weights = np.array([2.0] * 10 + [0.5] * 10)
    order = epoch_indices(20, weights, seed=0, epoch=0)
    counts = np.bincount(order, minlength=20)
    assert (counts[:10] == 2).all() and counts[10:].sum() == 5 and counts[10:].max() == 1


@pytest.mark.parametrize("stage", [2, 3])
def test_llava_deepspeed_json_auto_values_are_filled(stage):
    import torch

    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.distributed.deepspeed import deepspeed_config

    path = REAL / "llava_examples" / f"deepspeed_zero{stage}.json"
    train = TrainSection(strategy=f"zero{stage}", micro_batch_size=4, gradient_accumulation_steps=2, deepspeed_config=path)
    cfg = deepspeed_config(train, dp_size=8, dtype=torch.bfloat16, hidden_size=1024, stage=stage)
    assert "auto" not in json.dumps(cfg)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2 and cfg["train_batch_size"] == 64
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024
    if stage == 3:
        assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 10240
    with pytest.raises(ConfigError, match="ZeRO stage"):
        deepspeed_config(train, dp_size=8, dtype=torch.bfloat16, hidden_size=1024, stage=5 - stage)


# --------------------------------------------------------------------------------- stages and LoRA (in-process)


# ------------------------------------------------------------------------------------------- bad-step handling


def _tiny_lm():
    """A two-layer token model with a `poison` input that multiplies its logits (NaN poisons a step)."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def forward(self, input_ids, attention_mask=None, poison=None, use_cache=None):
            logits = self.head(self.emb(input_ids))
            return type("Out", (), {"logits": logits if poison is None else logits * poison})()

    return Tiny()


def _tiny_batch(bad: bool = False) -> dict:
    import torch

    ids = torch.tensor([[1, 2, 3, 4]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "poison": torch.tensor(float("nan") if bad else 1.0), "num_label_tokens": 3, "num_text_tokens": 4,
            "num_visual_tokens": 0, "num_dummy_images": 0}


@pytest.fixture
def one_rank(monkeypatch):
    """This process as a one-rank gloo group (the loop's collectives), destroyed after the test."""
    import torch.distributed as dist

    from vlmctl.distributed.env import init_distributed

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    yield env
    dist.destroy_process_group()


def _tiny_trainer(env, model, scheduler, batches, rows, *, total_steps: int, max_bad: int = 10):
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.loop import Trainer, TrainState
    from vlmctl.train.objectives import SFTObjective

    return Trainer(engine=TorchEngine(model, scheduler.optimizer, scheduler, max_grad_norm=1.0, device=env.device),
                   objective=SFTObjective(), batches=batches, env=env, state=TrainState(), total_steps=total_steps,
                   grad_accum=1, batches_per_epoch=100, save_steps=100, logging_steps=1, max_bad_steps=max_bad,
                   save=lambda *a: None, log=rows.append, progress=type("P", (), {"update": lambda *a: None})())


def test_nan_loss_steps_are_skipped_then_the_run_aborts(one_rank):
    import torch

    from vlmctl.errors import VlmctlError

    model = _tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    pattern = iter([False, True, False, True, True])
    rows = []
    trainer = _tiny_trainer(one_rank, model, sched, (_tiny_batch(next(pattern)) for _ in range(100)), rows,
                            total_steps=5, max_bad=1)
    snapshots = []
    original = trainer.train_step

    def spy():
        before = [p.detach().clone() for p in model.parameters()]
        result = original()
        snapshots.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        return result

    trainer.train_step = spy
    with pytest.raises(VlmctlError, match="max_bad_steps=1"):
        trainer.train()
    # step 1 trains, step 2 (NaN) leaves the weights alone, step 3 trains, step 4 is the second bad one: abort
    assert snapshots == [False, True, False, True]
    assert [r["bad_steps"] for r in rows] == [0, 1, 1]
    assert rows[1]["grad_norm"] is None and rows[1]["loss"] is None and rows[2]["loss"] > 0


def test_each_step_is_logged_with_the_learning_rate_its_update_used(one_rank):
    import torch

    from vlmctl.config import TrainSection
    from vlmctl.train.setup import build_scheduler

    # warm-up of 3% of 4 steps rounds to one step: step 1 updates at lr 0, the next ones at the peak
    model = _tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = build_scheduler(opt, TrainSection(lr_scheduler="constant", warmup_ratio=0.03, learning_rate=1e-3), total_steps=4)
    rows, moved = [], []
    trainer = _tiny_trainer(one_rank, model, sched, (_tiny_batch() for _ in range(100)), rows, total_steps=3)
    original = trainer.train_step

    def spy():
        before = [p.detach().clone() for p in model.parameters()]
        result = original()
        moved.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        return result

    trainer.train_step = spy
    trainer.train()
    assert moved == [False, True, True]
    assert [(r["step"], r["lr"]) for r in rows] == [(1, 0.0), (2, 1e-3), (3, 1e-3)]


# ----------------------------------------------------------------------------------------------------- packing


def test_packed_sampler_bins_fit_agree_across_ranks_and_resume():
    import numpy as np

    from vlmctl.data.loader import PackedBatchSampler
    from vlmctl.errors import DataError

    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 120, size=300)
    lengths[[5, 77]] = 500  # longer than the budget: never drawn, counted
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    ranks = [PackedBatchSampler(lengths, tokens_per_batch=256, world_size=2, rank=r, seed=3) for r in range(2)]
    single = PackedBatchSampler(lengths, tokens_per_batch=256, world_size=1, rank=0, seed=3)
    assert ranks[0].too_long == 2 and ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == single.batches_per_epoch // 2
    n = ranks[0].batches_per_epoch
    a, b, one = take(ranks[0], n + 5), take(ranks[1], n + 5), take(single, 2 * n)
    for x, y in zip(a, b):
        assert sum(lengths[x]) <= 256 and sum(lengths[y]) <= 256 and not set(x) & set(y)
    # 2 ranks x 1 bin == 1 rank x 2 consecutive bins (same samples per optimizer step with accumulation 2)
    assert [bin for pair in zip(a[:n], b[:n]) for bin in pair] == one[:2 * n]
    epoch0 = [i for x in a[:n] + b[:n] for i in x]
    assert len(epoch0) == len(set(epoch0)) and not {5, 77} & set(epoch0)
    assert len(epoch0) >= 298 - 2 * 256 // 10  # at most the dropped tail's global micro-batch is left out
    assert sum(lengths[epoch0]) >= 0.9 * 256 * 2 * n  # first-fit decreasing fills the bins
    assert a[n:] != a[:5]  # the next epoch packs its own shuffle
    resumed = PackedBatchSampler(lengths, tokens_per_batch=256, world_size=2, rank=0, seed=3)
    resumed.set_position(n - 2)  # across the epoch boundary
    assert take(resumed, 7) == a[n - 2:n + 5]
    with pytest.raises(DataError, match="fewer than the 64 ranks"):
        PackedBatchSampler(lengths[:20], tokens_per_batch=256, world_size=64)



@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
def test_every_schedule_warms_up(name):
    import torch

    from vlmctl.config import TrainSection
    from vlmctl.train.setup import build_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, TrainSection(lr_scheduler=name, warmup_ratio=0.1, learning_rate=1e-3), total_steps=100)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and 0 < lrs[5] < lrs[9] < 1e-3
    assert abs(lrs[10] - 1e-3) < 1e-9



@pytest.mark.parametrize("override, message", [
    ("train.max_grad_norm=1.0", "max_grad_norm"),
    ("train.gradient_accumulation_steps=2", "gradient_accumulation_steps"),
    ("train.strategy=zero2", "DeepSpeed"),
])
def test_optimizer_in_backward_refuses_what_it_cannot_honour(override, message):
    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.train.setup import check_optimizer_in_backward

    key, value = override.removeprefix("train.").split("=")
    base = {"optimizer_in_backward": True, "max_grad_norm": 0.0}
    train = TrainSection(**{**base, key: value})
    with pytest.raises(ConfigError, match=message):
        check_optimizer_in_backward(train, dp_size=1)
    with pytest.raises(ConfigError, match="ddp"):
        check_optimizer_in_backward(TrainSection(**base, strategy="ddp"), dp_size=2)
    check_optimizer_in_backward(TrainSection(**base, strategy="fsdp"), dp_size=2)


def test_optimizer_in_backward_steps_during_backward_and_frees_gradients():
    import torch

    from vlmctl.train.optimizer import OptimizerInBackward
    from vlmctl.train.setup import build_scheduler
    from vlmctl.config import TrainSection

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    oib = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    oib.load_state_dict(ref.state_dict())
    groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim == 2], "lr": 1e-2, "weight_decay": 0.1},  # noqa: E731
                        {"params": [p for p in m.parameters() if p.ndim == 1], "lr": 1e-2, "weight_decay": 0.0}]
    train = TrainSection(lr_scheduler="linear", warmup_ratio=0.25, learning_rate=1e-2)
    opt_ref = torch.optim.AdamW(groups(ref), betas=(0.9, 0.99), eps=1e-8)
    opt_oib = OptimizerInBackward(groups(oib), make=lambda g: torch.optim.AdamW(g, betas=(0.9, 0.99), eps=1e-8))
    sched_ref, sched_oib = build_scheduler(opt_ref, train, 8), build_scheduler(opt_oib, train, 8)
    for step in range(6):
        x = torch.randn(4, 6)
        ref(x).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        before = [p.detach().clone() for p in oib.parameters()]
        oib(x).pow(2).sum().backward()
        assert all(p.grad is None for p in oib.parameters())  # stepped and freed inside backward
        assert step == 0 or any(not torch.equal(a, p) for a, p in zip(before, oib.parameters()))
        opt_ref.step()
        opt_ref.zero_grad()
        assert abs(opt_oib.grad_norm() - float(norm)) < 1e-5 * float(norm)
        sched_ref.step()
        sched_oib.step()
        assert [g["lr"] for g in opt_oib.param_groups][0] == opt_ref.param_groups[0]["lr"]
        for a, b in zip(ref.parameters(), oib.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.5, 100.0, 0.0])
def test_engine_clips_only_above_the_limit_and_reports_the_norm_before_clipping(max_norm):
    import torch

    from vlmctl.distributed.engine import TorchEngine

    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))))

    opt = Spy(model.parameters(), lr=0.1)
    engine = TorchEngine(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), max_grad_norm=max_norm,
                           device=torch.device("cpu"))
    assert abs(engine.step(skip=False) - norm) < 1e-5 * norm
    expected = min(norm, max_norm) if max_norm > 0 else norm
    assert abs(seen[0] - expected) < 1e-4 * expected


def test_fp32_on_cuda_picks_sdpa_and_refuses_the_bf16_only_kernels():
    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.config.plan import DeviceFacts, build_plan, check_plan

    cuda = DeviceFacts(kind="cuda", varlen=True)  # planning needs no GPU
    assert build_plan(TrainSection(precision="fp32"), cuda).attention.value == "sdpa"
    assert build_plan(TrainSection(), cuda).attention.value == "varlen"
    train = TrainSection(precision="fp32", attn_implementation="varlen")
    with pytest.raises(ConfigError, match="bf16"):
        check_plan(build_plan(train, cuda), train)


def test_the_launcher_turns_the_ranks_step_lines_into_one_progress_bar_on_a_terminal():
    import io

    from rich.console import Console

    from vlmctl.train.launch import ConsoleEcho

    echo, out, stream = ConsoleEcho(), io.StringIO(), io.StringIO()
    echo.console = Console(file=out, force_terminal=True)
    echo.write("starting\n", stream)
    echo.write("step 2/8 loss 1.2345 | lr 1.00e-04 eta 12s\n", stream)
    echo.write("saved checkpoint-2\n", stream)
    echo.write("step 4/8 loss 0.9000 | lr 1.00e-04 eta 6s\n", stream)
    echo.close()
    assert stream.getvalue() == "starting\n"  # before the bar: passed through as it came
    assert echo.bar.tasks[0].completed == 4 and echo.bar.tasks[0].total == 8
    assert echo.bar.tasks[0].fields["info"] == "loss 0.9000 | lr 1.00e-04"
    assert "saved checkpoint-2" in out.getvalue()
    # off a terminal every line passes through unchanged
    plain, stream = ConsoleEcho(), io.StringIO()
    plain.write("step 2/8 loss 1.2 eta 1s\n", stream)
    assert stream.getvalue() == "step 2/8 loss 1.2 eta 1s\n" and plain.bar is None


def test_a_resume_on_another_number_of_ranks_continues_at_the_same_global_micro_batch():
    from vlmctl.train.loop import TrainState

    saved = {"step": 5, "consumed_micro_batches": 10, "world_size": 4, "dp_size": 4}
    assert TrainState.from_checkpoint(saved, dp_size=4).consumed == 10
    assert TrainState.from_checkpoint(saved, dp_size=2).consumed == 20  # 40 global micro-batches, 2 ranks
    assert TrainState.from_checkpoint(saved, dp_size=8).consumed == 5
    # checkpoints written before dp_size was recorded: their world size
    assert TrainState.from_checkpoint({"step": 1, "consumed_micro_batches": 3, "world_size": 2}, dp_size=1).consumed == 6
