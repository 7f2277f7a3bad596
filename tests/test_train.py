"""`vlmctl train`: launch commands, samplers, DeepSpeed config, stages/LoRA, packing, and real multi-process runs on
CPU.

The multi-process tests share one built tiny model and one prepared data set (session fixture) and run 8 steps
of 2 ranks x one packed row of up to 192 tokens (about two image samples; `train.packing` is on by default). Every one of them has a timeout: a hang (e.g. a rank skipping the vision tower under
FSDP/ZeRO-3) fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import run_cli as run_cli_inprocess
from real_data import REAL

RUN_TIMEOUT = 150
# what the tiny models' tokenizer is trained on: the generated questions' words
TOKENIZER_TEXTS = ["What color is the triangle? How many circles are there? Is the square left of the circle? "
                   "What shape is the red object? Answer with one word. red green blue yellow purple yes no 0 1 2 3"] * 20


# ----------------------------------------------------------------------------------------------------- fixtures


def _write_shards(folder: Path, n: int) -> None:
    """Generated shapes VQA samples; every third one is text-only (question without its image)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.data.synthetic import generate_shapes_vqa

    raw = generate_shapes_vqa(folder / "raw", num_samples=n, image_size=64)
    samples = []
    for i, rec in enumerate(json.loads(raw.read_text())):
        question = rec["conversations"][0]["value"].replace("<image>\n", "")
        answer = {"role": "assistant", "content": [{"type": "text", "text": rec["conversations"][1]["value"]}]}
        if i % 3 == 2:
            user = {"role": "user", "content": [{"type": "text", "text": question}]}
            samples.append(Sample(id=rec["id"], messages=[user, answer], source="text_only"))
        else:
            user = {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": question}]}
            img = (folder / "raw" / rec["image"]).read_bytes()
            samples.append(Sample(id=rec["id"], messages=[user, answer], images=[img], source="shapes_vqa.json"))
    out = folder / "prepared" / "train"
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([s.to_row() for s in samples], schema=arrow_schema()), out / "shard-00000.parquet")


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """A project folder with a built tiny model, prepared shards and a vlmctl.yaml for 2-rank FSDP."""
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    root = tmp_path_factory.mktemp("train")
    _write_shards(root / "data", 96)
    build_model(ModelSection(preset="tiny", init="random", output_dir=root / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: t}}
data: {{prepared_dir: data/prepared, max_length: 512}}
model: {{preset: tiny, init: random, output_dir: model}}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  learning_rate: 2.0e-3
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 192
  max_steps: 8
  save_steps: 4
  logging_steps: 1
  num_workers: 0
  output_dir: runs
""")
    return root


def _free_port() -> int:
    from vlmctl.train.parallel import free_port

    return free_port()


def _cli(project: Path, *args: str) -> subprocess.Popen:
    """Start `vlmctl train` in its own process group (so a hung run can be killed with all its ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), "train", "--master-port", str(_free_port()), *args]
    return subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run_cli(project: Path, *args: str, timeout: int = RUN_TIMEOUT) -> str:
    proc = _cli(project, *args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training did not finish within {timeout}s (hang?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


@pytest.fixture(scope="session")
def fsdp_run(project) -> Path:
    """The reference run: torchrun, 2 ranks, FSDP2, 8 steps, checkpoints at 4 and 8."""
    _run_cli(project, "--launcher", "torchrun", "--nproc-per-node", "2", "train.run_name=fsdp")
    return project / "runs" / "fsdp"


# ------------------------------------------------------------------------------------------- launch commands




def test_dry_run_prints_each_launcher_command(write_config, capsys):
    cfg = write_config("project: {name: p}\ntrain: {strategy: fsdp, nproc_per_node: 2}\n")
    code, out, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "train.run_name=r1"], capsys)
    assert code == 0, err
    run_dir = cfg.parent / "outputs" / "runs" / "r1"
    assert "torchrun --nproc-per-node 2 --nnodes 1 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500" in out
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
    assert code == 1 and "vlmctl data prepare" in err
    assert not (tmp_path / "outputs" / "runs").exists()


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
    from vlmctl.train.parallel import deepspeed_config

    path = REAL / "llava_examples" / f"deepspeed_zero{stage}.json"
    train = TrainSection(strategy=f"zero{stage}", micro_batch_size=4, gradient_accumulation_steps=2, deepspeed_config=path)
    cfg = deepspeed_config(train, world_size=8, dtype=torch.bfloat16, hidden_size=1024, stage=stage)
    assert "auto" not in json.dumps(cfg)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2 and cfg["train_batch_size"] == 64
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024
    if stage == 3:
        assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 10240
    with pytest.raises(ConfigError, match="ZeRO stage"):
        deepspeed_config(train, world_size=8, dtype=torch.bfloat16, hidden_size=1024, stage=5 - stage)


# --------------------------------------------------------------------------------- stages and LoRA (in-process)


def _loaded(project):
    from vlmctl.models import load_model

    return load_model(project / "model", dtype="fp32")


def test_align_and_lora_set_requires_grad_on_exactly_the_right_parameters(project):
    from vlmctl.config import LoraSection
    from vlmctl.train import parallel

    model, _, family = _loaded(project)
    parts = parallel.model_parts(model, family)
    counts = parallel.apply_stage(model, parts, parallel.trainable_parts("align", None))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("model.multi_modal_projector.") for n in trainable)
    assert counts["vision"] == counts["llm"] == 0 and counts["projector"] > 0
    assert parallel.trainable_parts("finetune", ["projector"]) == {"vision", "llm"}

    model, _, family = _loaded(project)
    parts = parallel.model_parts(model, family)
    trainable_parts = parallel.trainable_parts("finetune", None)
    parallel.apply_stage(model, parts, trainable_parts)
    peft_model = parallel.apply_lora(model, LoraSection(r=4, alpha=8, dropout=0.0), parts, trainable_parts)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if ".lora_" in n]
    assert lora and all(".language_model.layers." in n for n in lora)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    others = [n for n in trainable if ".lora_" not in n]
    assert others and all("multi_modal_projector.modules_to_save" in n for n in others)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _changed(before: dict, after: dict) -> set[str]:
    import torch

    assert set(after) <= set(before)
    return {k for k in after if not torch.equal(before[k], after[k])}


def assert_trained_exactly(project: Path, run: Path, what: str) -> None:
    """The final export differs from the built model in exactly the weights `what` ("projector" or "lora") trains.

    Saved files use transformers' checkpoint layout (keys may lack the `model.` prefix): match by part name.
    """
    import re

    before = _weights(project / "model")
    changed = _changed(before, _weights(run / "final"))
    projector = {k for k in before if "multi_modal_projector." in k}
    if what == "projector":
        assert changed == projector
        return
    lora_target = re.compile(r".*language_model\.(model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
    llm = changed - projector
    # merged adapters change every targeted weight; biases, norms, embeddings and the vision tower stay as built
    assert llm == {k for k in before if lora_target.fullmatch(k)}
    assert changed & projector


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("mode", ["align", "lora"])
def test_in_process_run_changes_exactly_the_trained_weights(project, mode, capsys):
    overrides = ["train.max_steps=3", "train.save_steps=100", "train.strategy=ddp", f"train.run_name=none-{mode}"]
    if mode == "align":  # padded micro-batches here; the LoRA run packs
        overrides += ["train.stage=align", "train.report_to=[tensorboard]", "train.packing=false"]
    else:
        overrides += ["train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8", "train.lora.dropout=0"]
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", *overrides], capsys)
    assert code == 0, out + err
    run = project / "runs" / f"none-{mode}"
    assert_trained_exactly(project, run, "projector" if mode == "align" else "lora")
    assert (run / "loss.png").is_file()
    if mode == "align":
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    if mode == "lora":
        state = json.loads((run / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
        assert state["lora"]["r"] == 4
        # target_modules: the adapted modules' names as a JSON list that peft accepts
        targets = state["lora"]["target_modules"]
        assert isinstance(targets, list) and "model.language_model.layers.0.self_attn.q_proj" in targets
        assert {t.rsplit(".", 1)[-1] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert all(t.startswith("model.language_model.layers.") for t in targets)
        from peft import LoraConfig

        assert LoraConfig(**{k: v for k, v in state["lora"].items() if k in LoraConfig.__dataclass_fields__}).target_modules == set(targets)
        rows = metrics(run)
        assert state["device"] == "cpu" and all(r["device"] == "cpu" for r in rows)
        seen = [r["tokens_seen"] for r in rows]
        assert seen == sorted(seen) and seen[0] == rows[0]["text_tokens"] + rows[0]["visual_tokens"]
        assert state["tokens_seen"] == seen[-1]
    from transformers import AutoModelForImageTextToText, AutoProcessor

    AutoModelForImageTextToText.from_pretrained(run / "final")
    AutoProcessor.from_pretrained(run / "final")


# ----------------------------------------------------------------------------------- multi-process (torchrun)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_torchrun_fsdp_two_ranks_trains_and_checkpoints(fsdp_run):
    rows = metrics(fsdp_run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["loss"] for r in rows[-3:]) / 3 < sum(r["loss"] for r in rows[:3]) / 3 - 0.3
    ckpts = sorted(p.name for p in (fsdp_run / "checkpoints").iterdir())
    assert ckpts == ["checkpoint-4", "checkpoint-8"]
    state = json.loads((fsdp_run / "checkpoints" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["world_size"] == 2 and state["strategy"] == "fsdp" and state["family"] == "llava"
    assert (fsdp_run / "checkpoints" / "checkpoint-8" / ".metadata").is_file()
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(fsdp_run / "checkpoints" / "checkpoint-8")).read_metadata().state_dict_metadata
    assert "model.model.language_model.layers.0.self_attn.q_proj.weight" in keys
    assert "model.model.vision_tower.encoder.layers.0.mlp.fc1.weight" in keys
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(fsdp_run / "final")
    assert (fsdp_run / "config.yaml").is_file()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_text_only_rank_runs_a_dummy_image_and_does_not_hang(fsdp_run):
    # With every third sample text-only and 2 samples per rank, some steps give one rank only text: that rank
    # appends a zero-weighted dummy image so FSDP's collective gathers of the vision tower line up.
    assert sum(r["dummy_images"] for r in metrics(fsdp_run)) > 0


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_fsdp_two_ranks_match_single_process_with_the_same_global_batch(project, fsdp_run, capsys):
    # the packed bin list does not depend on the world size: 2 ranks x 1 row == 1 rank x 2 accumulated rows
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none",
                                        "train.gradient_accumulation_steps=2", "train.run_name=single"], capsys)
    assert code == 0, out + err
    single = losses(project / "runs" / "single")
    two = losses(fsdp_run)
    assert len(single) == len(two) == 8
    for a, b in zip(single, two):
        assert abs(a - b) < 1e-4 * abs(a)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_kill_9_then_resume_reproduces_the_uninterrupted_curve(project, fsdp_run):
    run = project / "runs" / "killed"
    proc = _cli(project, "train.run_name=killed")
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (run / "checkpoints" / "checkpoint-4").is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint-4 in time"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # launcher, torchrun and both ranks at once, like a lost node
    proc.wait()
    # Whatever the ranks wrote after step 4 is gone with a real crash at that point.
    for p in (run / "checkpoints").iterdir():
        if p.name != "checkpoint-4":
            subprocess.run(["rm", "-rf", str(p)], check=True)
    subprocess.run(["rm", "-rf", str(run / "final")], check=True)
    _run_cli(project, "--resume", "train.run_name=killed")
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == losses(fsdp_run)  # bitwise on CPU
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_sigterm_finishes_the_step_saves_and_exits(project):
    run = project / "runs" / "term"
    proc = _cli(project, "train.run_name=term", "train.max_steps=200", "train.save_steps=1000")
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (run / "metrics.jsonl").is_file() or len(metrics(run)) < 2:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no steps logged in time"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    ckpts = list((run / "checkpoints").iterdir())
    assert len(ckpts) == 1
    state = json.loads((ckpts[0] / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["step"] == metrics(run)[-1]["step"] < 200
    assert "stopped by signal" in out and "--resume" in out
    assert not (run / "final").exists()


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_torchrun_deepspeed_two_ranks_trains_checkpoints_and_resumes(project, stage):
    # The first DeepSpeed run on a machine compiles its CPU communication op (1-2 min, cached afterwards).
    # 100-token rows: one image sample, or only text samples (then the dummy image runs the vision tower)
    _run_cli(project, "--strategy", stage, f"train.run_name={stage}", "train.max_steps=6", "train.save_steps=3",
             "train.tokens_per_batch=100", timeout=2 * RUN_TIMEOUT)
    run = project / "runs" / stage
    rows = metrics(run)
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert sum(r["dummy_images"] for r in rows) > 0  # a text-only rank did not hang ZeRO
    for step in (3, 6):
        ckpt = run / "checkpoints" / f"checkpoint-{step}"
        assert (ckpt / "latest").read_text().strip() == f"global_step{step}"
        assert json.loads((ckpt / "trainer_state.json").read_text())["format"] == "deepspeed"
    assert (run / "final" / "model.safetensors").is_file()
    if stage == "zero3":  # DeepSpeed's own load path: resume from step 3 reproduces steps 4-6 exactly
        subprocess.run(["rm", "-rf", str(run / "checkpoints" / "checkpoint-6"), str(run / "final")], check=True)
        _run_cli(project, "--strategy", stage, "--resume", f"train.run_name={stage}", "train.max_steps=6", "train.save_steps=3",
                 "train.tokens_per_batch=100")
        assert losses(run) == [r["loss"] for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_torchrun_fsdp_lora_with_accumulation_trains_only_adapters_and_projector(project):
    _run_cli(project, "train.run_name=fsdp-lora", "train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8",
             "train.lora.dropout=0", "train.gradient_accumulation_steps=2", "train.max_steps=3", "train.save_steps=3")
    run = project / "runs" / "fsdp-lora"
    assert len(metrics(run)) == 3
    assert_trained_exactly(project, run, "lora")


@pytest.mark.timeout(RUN_TIMEOUT)
def test_accumulation_matches_a_larger_micro_batch(project, capsys):
    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.group_by_length=false", "train.packing=false",
            "train.max_steps=3", "train.save_steps=100"]
    # the second run also applies the processor in a DataLoader worker process
    for name, extra in (("mb4", ["train.micro_batch_size=4"]), ("mb2x2", ["train.gradient_accumulation_steps=2", "train.num_workers=1"])):
        code, out, err = run_cli_inprocess([*base, f"train.run_name={name}", *extra], capsys)
        assert code == 0, out + err
    for a, b in zip(losses(project / "runs" / "mb4"), losses(project / "runs" / "mb2x2")):
        assert abs(a - b) < 1e-5 * abs(a)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_accelerate_launch_ddp_two_ranks(project):
    # padded micro-batches across processes (packing is covered by the fsdp runs)
    out = _run_cli(project, "--launcher", "accelerate", "--strategy", "ddp", "train.run_name=ddp", "train.max_steps=4", "train.save_steps=4",
                   "train.packing=false")
    run = project / "runs" / "ddp"
    rows = metrics(run)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["strategy"] == "ddp"
    assert "accelerate launch" in out


# ------------------------------------------------------------------------------------------- bad-step handling


def test_nan_loss_steps_are_skipped_then_the_run_aborts(monkeypatch):
    import torch
    import torch.distributed as dist

    from vlmctl.errors import VlmctlError
    from vlmctl.train.loop import TorchStepper, Trainer, TrainState
    from vlmctl.train.parallel import init_distributed

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def forward(self, input_ids, attention_mask=None, poison=None, use_cache=None):
            logits = self.head(self.emb(input_ids))
            return type("Out", (), {"logits": logits * poison})()

    def batch(bad: bool) -> dict:
        ids = torch.tensor([[1, 2, 3, 4]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                "poison": torch.tensor(float("nan") if bad else 1.0), "num_label_tokens": 3, "num_text_tokens": 4,
                "num_visual_tokens": 0, "num_dummy_images": 0}

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        pattern = iter([False, True, False, True, True])
        rows = []

        def make(max_bad):
            return Trainer(stepper=TorchStepper(model, opt, sched, max_grad_norm=1.0, device=env.device),
                           batches=(batch(next(pattern)) for _ in range(100)), env=env, state=TrainState(), total_steps=5,
                           grad_accum=1, batches_per_epoch=100, save_steps=100, logging_steps=1, max_bad_steps=max_bad,
                           save=lambda *a: None, log=rows.append, progress=type("P", (), {"update": lambda *a: None})())

        trainer = make(max_bad=1)
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
    finally:
        dist.destroy_process_group()


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


def _capture_packed_sampler(monkeypatch) -> list:
    """Record the PackedBatchSampler a run creates (to replay its bins as padded micro-batches)."""
    from vlmctl.data import loader

    made = []
    original = loader.PackedBatchSampler.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(loader.PackedBatchSampler, "__init__", init)
    return made


def _assert_packed_equals_padded(project: Path, name: str, capsys, monkeypatch, steps: int = 4, extra: tuple = ()) -> list[dict]:
    """Train `steps` packed steps, then the same samples per step as padded micro-batches: same losses and norms."""
    from vlmctl.data import loader

    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.strategy=ddp", f"train.max_steps={steps}",
            "train.save_steps=100", "train.warmup_ratio=0", *extra]
    made = _capture_packed_sampler(monkeypatch)
    code, out, err = run_cli_inprocess([*base, f"train.run_name={name}-packed"], capsys)
    assert code == 0, out + err
    assert len(made) == 1
    sampler = made[0]
    monkeypatch.setattr(loader, "DistributedBatchSampler", lambda *a, **k: sampler)  # replay the packed bins, padded
    code, out, err = run_cli_inprocess([*base, f"train.run_name={name}-padded", "train.packing=false"], capsys)
    assert code == 0, out + err
    packed, padded = metrics(project / "runs" / f"{name}-packed"), metrics(project / "runs" / f"{name}-padded")
    assert len(packed) == len(padded) == steps
    for p, q in zip(packed, padded):
        assert (p["label_tokens"], p["text_tokens"], p["visual_tokens"]) == (q["label_tokens"], q["text_tokens"], q["visual_tokens"])
        assert p["loss"] == pytest.approx(q["loss"], rel=2e-5)
        assert p["grad_norm"] == pytest.approx(q["grad_norm"], rel=2e-4)
    return packed


@pytest.mark.timeout(RUN_TIMEOUT)
def test_packed_run_matches_padded_run_on_the_same_batches(project, capsys, monkeypatch):
    rows = _assert_packed_equals_padded(project, "eq-llava", capsys, monkeypatch)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.fixture(scope="module")
def qwen_project(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL preset (mRoPE, image-only processor) with the same generated data."""
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    root = tmp_path_factory.mktemp("train-qwen")
    _write_shards(root / "data", 36)
    build_model(ModelSection(preset="tiny-qwen2.5-vl", init="random", output_dir=root / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (root / "vlmctl.yaml").write_text("""
project: {name: q}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny-qwen2.5-vl, init: random, output_dir: model}
train: {stage: full, precision: fp32, learning_rate: 2.0e-3, tokens_per_batch: 96, logging_steps: 1, num_workers: 0, output_dir: runs}
""")
    return root


@pytest.mark.timeout(RUN_TIMEOUT)
def test_qwen2_5_vl_packed_run_with_mrope_matches_padded(qwen_project, capsys, monkeypatch):
    # Padded Qwen-VL batches get their mRoPE positions from the model itself, row by row; the packed run passes
    # (4, 1, T) positions computed per sample. Equal losses mean the packed positions are right.
    from vlmctl.train import worker

    shapes = []
    original = worker.mrope_prepare

    def spy(*args, **kwargs):
        prepare = original(*args, **kwargs)

        def wrapped(batch):
            out = prepare(batch)
            shapes.append((tuple(out["position_ids"].shape), out["input_ids"].shape[1], len(out["seq_lens"])))
            return out

        return wrapped

    monkeypatch.setattr(worker, "mrope_prepare", spy)
    rows = _assert_packed_equals_padded(qwen_project, "eq-qwen", capsys, monkeypatch, steps=3)
    # prepared ahead of the step (loop.prefetch): at least the 3 consumed rows
    assert len(shapes) >= 3 and all(s == (4, 1, t) and n > 1 for s, t, n in shapes)
    assert sum(r["visual_tokens"] for r in rows) > 0


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
def test_every_schedule_warms_up(name):
    import torch

    from vlmctl.config import TrainSection
    from vlmctl.train.worker import build_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, TrainSection(lr_scheduler=name, warmup_ratio=0.1, learning_rate=1e-3), total_steps=100)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and 0 < lrs[5] < lrs[9] < 1e-3
    assert abs(lrs[10] - 1e-3) < 1e-9


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_optimizer_in_backward_matches_adamw_and_resumes_bitwise(project):
    # the per-parameter AdamW stepped in backward is the same update as one AdamW stepped after it (no clipping)
    _run_cli(project, "train.run_name=adamw-noclip", "train.max_grad_norm=0")
    _run_cli(project, "train.run_name=oib", "train.max_grad_norm=0", "train.optimizer_in_backward=true")
    ref, oib = metrics(project / "runs" / "adamw-noclip"), metrics(project / "runs" / "oib")
    assert len(ref) == len(oib) == 8
    for a, b in zip(ref, oib):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    # its DCP checkpoint (one optimizer per parameter) resumes to the same curve
    run = project / "runs" / "oib"
    subprocess.run(["rm", "-rf", str(run / "checkpoints" / "checkpoint-8"), str(run / "final")], check=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in oib[:4]))
    _run_cli(project, "--resume", "train.run_name=oib", "train.max_grad_norm=0", "train.optimizer_in_backward=true")
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in oib]


@pytest.mark.parametrize("override, message", [
    ("train.max_grad_norm=1.0", "max_grad_norm"),
    ("train.gradient_accumulation_steps=2", "gradient_accumulation_steps"),
    ("train.strategy=zero2", "DeepSpeed"),
])
def test_optimizer_in_backward_refuses_what_it_cannot_honour(override, message):
    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.train.worker import check_optimizer_in_backward

    key, value = override.removeprefix("train.").split("=")
    base = {"optimizer_in_backward": True, "max_grad_norm": 0.0}
    train = TrainSection(**{**base, key: value})
    with pytest.raises(ConfigError, match=message):
        check_optimizer_in_backward(train, world_size=1)
    with pytest.raises(ConfigError, match="ddp"):
        check_optimizer_in_backward(TrainSection(**base, strategy="ddp"), world_size=2)
    check_optimizer_in_backward(TrainSection(**base, strategy="fsdp"), world_size=2)


def test_optimizer_in_backward_steps_during_backward_and_frees_gradients():
    import torch

    from vlmctl.train.optimizer import OptimizerInBackward
    from vlmctl.train.worker import build_scheduler
    from vlmctl.config import TrainSection

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    oib = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    oib.load_state_dict(ref.state_dict())
    groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim == 2], "lr": 1e-2, "weight_decay": 0.1},  # noqa: E731
                        {"params": [p for p in m.parameters() if p.ndim == 1], "lr": 1e-2, "weight_decay": 0.0}]
    train = TrainSection(lr_scheduler="linear", warmup_ratio=0.25, learning_rate=1e-2)
    opt_ref = torch.optim.AdamW(groups(ref), betas=(0.9, 0.99), eps=1e-8)
    opt_oib = OptimizerInBackward(groups(oib), betas=(0.9, 0.99), eps=1e-8, fused=False)
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
def test_stepper_clips_only_above_the_limit_and_reports_the_norm_before_clipping(max_norm):
    import torch

    from vlmctl.train.loop import TorchStepper

    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))))

    opt = Spy(model.parameters(), lr=0.1)
    stepper = TorchStepper(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), max_grad_norm=max_norm,
                           device=torch.device("cpu"))
    assert abs(stepper.step(skip=False) - norm) < 1e-5 * norm
    expected = min(norm, max_norm) if max_norm > 0 else norm
    assert abs(seen[0] - expected) < 1e-4 * expected


def test_fp32_on_cuda_picks_sdpa_and_refuses_the_bf16_only_kernels():
    import torch

    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.train.worker import resolve_attention

    cuda = torch.device("cuda")  # resolving names needs no GPU
    assert resolve_attention(TrainSection(precision="fp32"), cuda) == "sdpa"
    with pytest.raises(ConfigError, match="bf16"):
        resolve_attention(TrainSection(precision="fp32", attn_implementation="varlen"), cuda)
