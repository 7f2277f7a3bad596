"""`vlmctl train` with `train.objective: grpo` on a tiny LLaVA and generated shapes-VQA prompts: one process through
the CLI (rollouts generated and scored each step, the loss and reward metrics in metrics.jsonl, rollouts.html, the
final export), two ranks under FSDP2 (each rank generates for its own prompts with synced_gpus; text-only prompts
add a blank-image request so the vision tower's gathers line up), and a SIGTERM + resume, on one process and on two
ranks, that reproduces the uninterrupted run's losses exactly (rollouts are seeded from (seed, step, rank,
micro-batch))."""

from __future__ import annotations

import shutil
import json
import re
import signal
from pathlib import Path

import pytest

from train_runner import run_train, start_train, wait_until

from shapes_shards import write_shapes_shards

RUN_TIMEOUT = 240
STOP_ENV = "GRPO_TEST_SIGTERM_ON_REWARD"
# a reward with variance on a random model: longer answers score higher (the user-function path, module:function);
# with STOP_ENV set it signals its own process, so the stop lands on the first generation step
REWARDS = (f"import os\nimport signal\n\n\ndef longer(completions, references, **kwargs):\n"
           f"    if os.environ.get('{STOP_ENV}'):\n        os.kill(os.getpid(), signal.SIGTERM)\n"
           "    return [len(c) / 10 for c in completions]\n")


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models) -> Path:

    root = tmp_path_factory.mktemp("grpo-train")
    write_shapes_shards(root / "data", 24)
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="bf16"), root / "model")
    shutil.copytree(tiny_models("tiny-qwen2.5-vl", shapes=True, dtype="bf16"), root / "qwen")
    (root / "grpo_rewards.py").write_text(REWARDS)
    (root / "vlmctl.yaml").write_text("""
project: {name: g}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train:
  objective: grpo
  stage: full
  strategy: ddp
  precision: fp32
  learning_rate: 1.0e-3
  warmup_ratio: 0.0
  micro_batch_size: 2
  max_steps: 4
  save_steps: 2
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  grpo:
    group_size: 4
    max_new_tokens: 6
    rewards: [{name: exact_match}, {name: "grpo_rewards:longer", weight: 0.5}]
""")
    return root


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _run_cli(project: Path, *args: str, timeout: int = RUN_TIMEOUT) -> str:
    return run_train(project / "vlmctl.yaml", *args, timeout=timeout)


@pytest.fixture(scope="module")
def one_run(project) -> Path:
    """The reference run: one process, 4 steps of 2 prompts x 4 rollouts, checkpoints at 2 and 4."""
    _run_cli(project, "--launcher", "none", "train.run_name=one")
    return project / "runs" / "one"


def check_rows(rows: list[dict], rollouts: int, kl: bool = False) -> None:
    for r in rows:
        assert r["rollouts"] == rollouts and r["label_tokens"] == rollouts  # sequence aggregation: a mean over rollouts
        assert r["time/rollout_s"] > 0 and r["time/train_s"] > 0 and r["rollouts_per_s"] > 0
        assert 1 <= r["completions/mean_length"] <= 6
        assert r["reward"] == pytest.approx(r["rewards/exact_match/mean"] + 0.5 * r["rewards/grpo_rewards:longer/mean"])
        assert r["rewards/grpo_rewards:longer/mean"] > 0 and r["reward_std"] > 0
        assert r["clip_ratio/region_mean"] == 0.0  # one update per generation: ratio 1
        assert r["grad_norm"] > 0
        if not kl:  # on-policy, the surrogate's value is minus the mean advantage, about 0; its gradient is not
            assert abs(r["loss"]) < 1e-5 and "kl" not in r
    if kl:  # the frozen reference is the starting model: no divergence before the first update, some after
        assert rows[0]["kl"] == 0.0 and all(r["kl"] > 0 for r in rows[1:])


@pytest.mark.timeout(RUN_TIMEOUT)
def test_one_process_grpo_run_logs_rewards_and_rollouts_and_exports(one_run):
    rows = metrics(one_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    check_rows(rows, rollouts=2 * 4)  # 2 prompts x a group of 4
    html = (one_run / "rollouts.html").read_text()
    assert html.index("step 4") < html.index("step 1") and "reference" in html and "advantage" in html
    assert not list(one_run.glob(".*.tmp"))
    line = r"step 4/4 .*reward \d\.\d{3} \| std \d\.\d{3} \| clipped 0\.000 \| length [\d.]+ \| rollout \d+\.\d\ds \| train \d+\.\d\ds"
    assert re.search(line, (one_run / "train.log").read_text())  # the objective's metrics in the step line
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(one_run / "final")


@pytest.mark.timeout(RUN_TIMEOUT)
def test_lora_grpo_trains_the_adapter_against_the_frozen_start_and_exports_it_merged(project):
    _run_cli(project, "--launcher", "none", "train.run_name=lora", "train.stage=finetune", "train.lora.r=8",
             "train.lora.alpha=16", "train.grpo.beta=0.1")
    run = project / "runs" / "lora"
    check_rows(metrics(run), rollouts=2 * 4, kl=True)  # the reference is the model before its adapter
    from safetensors.torch import load_file

    source, final = load_file(project / "model" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert source.keys() == final.keys()  # merged into the base's own weights: no adapter keys left
    changed = {k for k in source if not (source[k].float() == final[k].float()).all()}
    assert changed and all("proj" in k for k in changed)  # the adapted projections only; embeddings and norms kept


FSDP_ARGS = ("--launcher", "torchrun", "--nproc-per-node", "2", "train.strategy=fsdp", "train.grpo.beta=0.04",
             "train.group_by_length=false", "train.balance=off")


@pytest.fixture(scope="module")
def fsdp_run(project) -> Path:
    """Two ranks under FSDP2 with a KL term, 4 steps of 2 ranks x 2 prompts x 4 rollouts, checkpoints at 2 and 4."""
    # unsorted, unbalanced prompts: at step 3 one rank has only text-only prompts while the other has images
    _run_cli(project, *FSDP_ARGS, "train.run_name=fsdp")
    return project / "runs" / "fsdp"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_fsdp_two_ranks_generate_for_their_own_prompts_and_train_with_a_kl_term(fsdp_run):
    # the KL term's frozen reference is sharded like the policy (forward only)
    run = fsdp_run
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    check_rows(rows, rollouts=2 * 2 * 4, kl=True)  # 2 ranks x 2 prompts x 4
    assert 1 in [r["dummy_images"] for r in rows]  # that rank generated with a blank image and did not hang
    assert all(len(r["rank_compute_s"]) == 2 for r in rows)
    assert (run / "rollouts.html").is_file() and (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_qwen2_5_vl_fsdp_two_ranks_train_on_rollouts_with_mrope_positions(project):
    # packed rollout rows get Qwen's per-segment mRoPE positions; a text-only rank generates with a blank image
    _run_cli(project, "--launcher", "torchrun", "--nproc-per-node", "2", "train.strategy=fsdp", "train.run_name=qwen",
             "model.preset=tiny-qwen2.5-vl", "model.output_dir=qwen", "train.group_by_length=false", "train.balance=off",
             "train.max_steps=3", "train.save_steps=100")
    rows = metrics(project / "runs" / "qwen")
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_rows(rows, rollouts=2 * 2 * 4)
    assert 1 in [r["dummy_images"] for r in rows] and sum(r["visual_tokens"] for r in rows) > 0


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def _stopped_and_resumed(project: Path, name: str, *args: str, env: dict | None = None) -> tuple[list[dict], list[str]]:
    """Start run `name` with `args`, SIGTERM it once it logged a step (with `env` STOP_ENV, its reward signals it on
    step 1), so that it checkpoints and exits 128 + SIGTERM before its last step; resume it to the end. Returns its
    metrics rows and the files of the checkpoint it stopped at."""
    run = project / "runs" / name
    proc = start_train(project / "vlmctl.yaml", *args, f"train.run_name={name}", env=env)
    if env is None:
        wait_until(proc, lambda: (run / "metrics.jsonl").is_file() and bool(metrics(run)), RUN_TIMEOUT, "step logged")
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    checkpoint = next((run / "checkpoints").glob("checkpoint-*"))
    stopped = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    assert stopped < 4 and not (run / "final").exists()
    files = sorted(p.name for p in checkpoint.iterdir())
    _run_cli(project, *args, "--resume", f"train.run_name={name}")
    return metrics(run), files


def test_sigterm_then_resume_reproduces_the_uninterrupted_run(project, one_run):
    (resumed, _), reference = _stopped_and_resumed(project, "term", "--launcher", "none"), metrics(one_run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):  # the same rollouts, the same updates
        assert [r[key] for r in resumed] == [r[key] for r in reference], key


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_two_ranks_sigterm_then_resume_reproduces_the_uninterrupted_run(project, fsdp_run):
    # each rank draws its rollouts from (seed, step, rank, micro-batch) and resumes its own sampler position
    (resumed, _), reference = _stopped_and_resumed(project, "fsdp-term", *FSDP_ARGS), metrics(fsdp_run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "reward", "kl", "completions/mean_length", "dummy_images"):  # the same rollouts and updates
        assert [r[key] for r in resumed] == [r[key] for r in reference], key


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_zero3_two_ranks_generate_through_deepspeeds_hooks_and_train(project):
    # The first DeepSpeed run on a machine compiles its CPU communication op (1-2 min, cached afterwards).
    _run_cli(project, "--launcher", "torchrun", "--nproc-per-node", "2", "--strategy", "zero3", "train.run_name=zero3",
             "train.max_steps=2", timeout=2 * RUN_TIMEOUT)
    run = project / "runs" / "zero3"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    check_rows(rows, rollouts=2 * 2 * 4)
    assert sum(r["dummy_images"] for r in rows) > 0  # text-only prompts: a blank image kept the vision tower in step
    assert (run / "final" / "model.safetensors").is_file()


MU2_ARGS = ("--launcher", "none", "train.grpo.num_iterations=2", "train.learning_rate=0.05", "train.grpo.epsilon_low=0.01",
            "train.save_steps=100")


@pytest.fixture(scope="module")
def mu2_run(project) -> Path:
    """One process, num_iterations 2 (generation on steps 1 and 3), a large learning rate and a narrow clip."""
    _run_cli(project, *MU2_ARGS, "train.run_name=mu2")
    return project / "runs" / "mu2"


@pytest.mark.timeout(RUN_TIMEOUT)
def test_num_iterations_two_generates_every_other_step_and_the_clip_acts_on_reuse(mu2_run):
    # mu = 2: generation (and new prompts) on steps 1 and 3; steps 2 and 4 update again on the buffered rollouts,
    # against their generation-time log-probs, so the ratio leaves 1 and the clip acts after a large update
    run = mu2_run
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["generated"] for r in rows] == [1, 0, 1, 0]
    assert [r["rollouts"] for r in rows] == [8, 0, 8, 0]
    assert [r["time/rollout_s"] > 0 for r in rows] == [True, False, True, False]
    assert rows[1]["epoch"] == rows[0]["epoch"] < rows[2]["epoch"] == rows[3]["epoch"]  # no prompts drawn on reuse
    assert rows[1]["reward"] == rows[0]["reward"] and rows[1]["label_tokens"] == rows[0]["label_tokens"]  # the same rollouts
    assert rows[0]["clip_ratio/region_mean"] == 0.0 and rows[2]["clip_ratio/region_mean"] == 0.0  # old = current at generation
    assert max(rows[1]["clip_ratio/region_mean"], rows[3]["clip_ratio/region_mean"]) > 0
    html = (run / "rollouts.html").read_text()
    assert "step 3" in html and "step 1" in html and "step 2" not in html and "step 4" not in html


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_num_iterations_two_resumed_inside_a_generations_iterations_reproduces_the_uninterrupted_run(project, mu2_run):
    # stopped after step 1, a generation step: the checkpoint keeps the buffered rollouts, which step 2 trains on again
    (resumed, files), reference = _stopped_and_resumed(project, "mu2-term", *MU2_ARGS, env={STOP_ENV: "1"}), metrics(mu2_run)
    assert "objective-0.pt" in files and "rng-0.pt" in files
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and [r["generated"] for r in resumed] == [1, 0, 1, 0]
    for key in ("loss", "grad_norm", "reward", "reward_std", "rewards/exact_match/mean", "completions/mean_length",
                "label_tokens", "epoch", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert [r[key] for r in resumed] == [r[key] for r in reference], key
    assert max(r["clip_ratio/region_mean"] for r in resumed) > 0  # the reuse steps' ratios are compared, not only 1s
