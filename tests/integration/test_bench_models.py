"""`vlmctl bench` on the models a project configures, on CPU: the tiny template's LLaVA (padded as the template
trains it, and packed), a Qwen2.5-VL preset on padded batches, LoRA against full fine-tuning. Every figure is
checked against the trainer's own cost model on the very batches the steps trained on."""

from __future__ import annotations

import json
import re

import pytest

from cli_runner import run_cli

STEPS, WARMUP = 2, 1
FLAGS = ["--steps", str(STEPS), "--warmup", str(WARMUP), "--text-tokens", "8,40", "--json"]


@pytest.fixture
def tiny_project(tmp_path):
    """`vlmctl init --template tiny`: a random-init LLaVA (tiny SigLIP + Qwen2), 2 processes, FSDP, padded
    micro-batches of 16; nothing prepared or built."""
    from vlmctl.project import init_project

    init_project(tmp_path / "proj", "tiny", num_samples=4)
    return tmp_path / "proj" / "vlmctl.yaml"


@pytest.fixture
def trained(monkeypatch):
    """Records what the bench's trainer did: its cost model, every micro-batch it counted FLOPs of (in step order)
    and its step results, and the trainer."""
    from vlmctl import bench

    seen: dict = {"batches": [], "steps": []}
    measure = bench._measure

    def spy(trainer, *args, **kwargs):
        flops_of, train_step = trainer.flops_of, trainer.train_step
        seen.update(trainer=trainer, cost=flops_of.__self__)

        def counted(batch):
            seen["batches"].append(batch)
            return flops_of(batch)

        def step():
            seen["steps"].append(train_step())
            return seen["steps"][-1]

        trainer.flops_of, trainer.train_step = counted, step
        return measure(trainer, *args, **kwargs)

    monkeypatch.setattr(bench, "_measure", spy)
    return seen


def _bench(capsys, config, *args) -> dict:
    code, out, err = run_cli(["bench", "-c", str(config), "--nproc-per-node", "1", *FLAGS, *args], capsys)
    assert code == 0, err
    return json.loads(out[out.index("{"):])


def _consistent(out: dict, seen: dict) -> None:
    """Positive throughput; FLOPs per token and MFU are the trainer's cost model's on the measured batches."""
    from vlmctl.bench import DEFAULT_PEAK
    from vlmctl.train.flops import CostModel

    assert out["tokens_per_s"] > 0 and out["mfu"] > 0 and out["steps"] == STEPS
    assert isinstance(seen["cost"], CostModel) and len(seen["batches"]) == STEPS + WARMUP
    measured = seen["batches"][WARMUP:]
    flops = sum(seen["cost"].batch_flops(b) for b in measured)
    tokens = sum(b["num_text_tokens"] + b["num_visual_tokens"] for b in measured)
    assert tokens == pytest.approx(out["tokens_per_step"] * STEPS)
    assert out["flops_per_token"] == pytest.approx(flops / tokens, rel=1e-9)
    # CPU: no data-sheet peak, the H100/H200 reference instead
    assert out["mfu"] == pytest.approx(flops / (out["step_time_s"] * STEPS) / (DEFAULT_PEAK * out["world_size"]), rel=1e-9)


def test_tiny_template_llava_padded_as_configured(tiny_project, capsys, trained):
    out = _bench(capsys, tiny_project)
    assert (out["workload"], out["packing"], out["strategy"]) == ("chat", False, "fsdp")
    _consistent(out, trained)
    batch = trained["batches"][-1]
    assert batch["input_ids"].shape[0] == 16 and "attention_mask" in batch and batch["num_dummy_images"] == 0
    # one 32 px image per sample (the template's model.image_size), 8 px patches: 16 visual tokens each
    assert batch["num_visual_tokens"] == 16 * 16


def test_tiny_template_llava_packed(tiny_project, capsys, trained):
    out = _bench(capsys, tiny_project, "train.packing=true", "train.tokens_per_batch=400")
    assert (out["workload"], out["packing"]) == ("chat", True)
    assert 0 < out["tokens_per_step"] <= 400
    _consistent(out, trained)
    batch = trained["batches"][-1]
    assert batch["input_ids"].shape[0] == 1 and len(batch["seq_lens"]) == batch["num_samples"] > 1


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_dpo_benches_packed_pairs_with_its_reference(tiny_project, capsys, trained, reference):
    out = _bench(capsys, tiny_project, "model.preset=tiny-qwen2.5-vl", "train.packing=true", "train.tokens_per_batch=600",
                 "train.objective=dpo", f"train.dpo.reference={reference}")
    _consistent(out, trained)
    trainer = trained["trainer"]
    assert (trainer.objective.name, "reference" in trainer.objective.models) == ("dpo", reference == "frozen")
    for batch in trained["batches"]:  # each pair: chosen then rejected, the same prompt and image twice
        pairs = batch["num_pairs"]
        assert pairs >= 1 and len(batch["pair_ids"]) == pairs and len(batch["seq_lens"]) >= 2 * pairs
    if reference == "frozen":  # the policy is its copy before the first update: margins 0, loss log 2
        first = trained["steps"][0]
        assert first.metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
        assert first.loss == pytest.approx(0.6931472, abs=1e-5)


@pytest.mark.parametrize("drop, beta", [(False, 0.0), (True, 0.1)])
def test_grpo_benches_rollouts_and_splits_the_step_into_generation_and_training(tiny_project, capsys, trained, drop, beta):
    prompts, group, new_tokens = 2, 3, 4
    out = _bench(capsys, tiny_project, "model.preset=tiny-qwen2.5-vl", "train.packing=true", "train.objective=grpo",
                 f"train.micro_batch_size={prompts}", f"train.grpo.group_size={group}", f"train.grpo.beta={beta}",
                 f"train.grpo.max_new_tokens={new_tokens}", f"train.grpo.drop_zero_variance_groups={str(drop).lower()}")
    _consistent(out, trained)
    assert (out["objective"], out["workload"], out["world_size"]) == ("grpo", "chat", 1)
    trainer = trained["trainer"]
    assert trainer.objective.name == "grpo" and trainer.objective.hook is not None  # Qwen-VL's mRoPE positions
    # beta > 0: the KL term against a frozen copy of the bench's model, which starts equal to the policy
    assert ("reference" in trainer.objective.models) == bool(beta)
    if beta:
        assert trained["steps"][0].metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    # every prompt's group is trained on, also with the filter on (random answers: every group's rewards are equal)
    assert not trainer.objective.settings.drop_zero_variance_groups
    rollouts = prompts * group
    for step, batch in zip(trained["steps"], trained["batches"]):
        assert batch["num_rollouts"] == batch["num_samples"] == rollouts and len(batch["advantages"]) == rollouts
        assert step.metrics["rollouts"] == rollouts and 0 < step.metrics["completions/mean_length"] <= new_tokens
    assert out["rollouts_per_step"] == rollouts
    for key in ("rollouts_per_s", "rollouts_per_s_per_gpu", "generated_tokens_per_s", "rollout_s", "train_s",
                "train_tokens_per_s"):
        assert out[key] > 0, key
    assert 0 < out["generation_share"] < 1
    assert out["rollout_s"] + out["train_s"] == pytest.approx(out["step_time_s"])
    assert out["generation_share"] == pytest.approx(out["rollout_s"] / out["step_time_s"])
    assert out["rollouts_per_s"] == pytest.approx(STEPS * rollouts / (STEPS * out["rollout_s"]))
    assert out["rollouts_per_s_per_gpu"] == out["rollouts_per_s"]
    assert out["samples_per_s"] == pytest.approx(rollouts / out["step_time_s"])  # rollouts per second of the whole step
    lengths = [s.metrics["completions/mean_length"] for s in trained["steps"][WARMUP:]]
    assert out["generated_tokens_per_s"] == pytest.approx(rollouts * sum(lengths) / (STEPS * out["rollout_s"]))
    assert out["train_tokens_per_s"] == pytest.approx(out["tokens_per_step"] / out["train_s"])


def test_qwen_preset_on_padded_batches(tiny_project, capsys, trained):
    # the template trains padded micro-batches: a Qwen-VL preset in it gets the chat workload, not the baseline's
    out = _bench(capsys, tiny_project, "model.preset=tiny-qwen2.5-vl", "train.micro_batch_size=4")
    assert (out["name"], out["workload"], out["packing"]) == ("tiny-qwen2.5-vl", "chat", False)
    _consistent(out, trained)
    batch = trained["batches"][-1]
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape == (4, 3) and "mm_token_type_ids" in batch


def test_lora_counts_fewer_flops_per_token_than_full_fine_tuning(tiny_project, capsys, trained):
    full = _bench(capsys, tiny_project, "train.stage=finetune")
    full_cost = trained["cost"]
    trained["batches"].clear()
    lora = _bench(capsys, tiny_project, "train.stage=finetune", "train.lora.r=8")
    assert (full["adapter"], lora["adapter"]) == ("none", "lora")
    _consistent(lora, trained)
    # the adapters train; the language model's own weights are frozen but pass the gradient on (forward +
    # activation gradient: 4 FLOPs per weight per token instead of 6)
    model = trained["trainer"].engine.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and any("lora_A" in n for n in trainable) and not any("q_proj.base_layer" in n for n in trainable)
    cost = trained["cost"]
    assert "llm" in full_cost.trained and "llm" not in cost.trained and "llm" in cost.grad_through
    assert cost.weight_factor("llm") == 4 and full_cost.weight_factor("llm") == 6
    # the same samples in the same micro-batches: fewer FLOPs per token
    assert full["tokens_per_step"] == lora["tokens_per_step"]
    assert 0 < lora["flops_per_token"] < full["flops_per_token"]


def test_tiny_template_as_it_is_two_processes(tiny_project, capsys):
    # the template's own settings: 2 processes through torchrun, FSDP2, padded micro-batches of 16 per rank
    code, out, err = run_cli(["bench", "-c", str(tiny_project), *FLAGS], capsys)
    assert code == 0, err
    out = json.loads(out[out.index("{"):])
    assert (out["world_size"], out["strategy"], out["packing"], out["workload"]) == (2, "fsdp", False, "chat")
    assert out["samples_per_s"] * out["step_time_s"] == pytest.approx(32)  # 16 samples per rank and step
    assert out["tokens_per_s"] > 0 and out["mfu"] > 0
    assert out["tokens_per_s_per_gpu"] * 2 == pytest.approx(out["tokens_per_s"])


def _visual_tokens_of(batch, key: str) -> int:
    """Visual tokens of a batch's images or clips by their patch grids (`image_grid_thw` / `video_grid_thw`: t x h x
    w patches, 2 x 2 of them merged into one token)."""
    return sum(t * h * w // 4 for t, h, w in batch[key].tolist())


@pytest.mark.parametrize("workload", ["chat", "baseline"])
def test_qwen_preset_with_several_images_per_sample(tiny_project, capsys, trained, workload):
    out = _bench(capsys, tiny_project, "model.preset=tiny-qwen2.5-vl", "train.packing=true", "train.tokens_per_batch=1024",
                 "--workload", workload, "--images-per-sample", "2,3", "--image-sizes", "28,56")
    assert (out["workload"], out["packing"], out["media"]) == (workload, True, "2-3 images (28-56 px)")
    _consistent(out, trained)
    measured = trained["batches"][WARMUP:]
    for batch in measured:
        images = batch["image_grid_thw"].shape[0]
        assert batch["num_dummy_images"] == 0 and 2 * batch["num_samples"] <= images <= 3 * batch["num_samples"]
        assert batch["num_visual_tokens"] == _visual_tokens_of(batch, "image_grid_thw") > 0
    # the reported tokens are the collator's, visual tokens included
    assert out["visual_tokens_per_s"] * out["step_time_s"] * STEPS == pytest.approx(sum(b["num_visual_tokens"] for b in measured))
    assert out["text_tokens_per_s"] * out["step_time_s"] * STEPS == pytest.approx(sum(b["num_text_tokens"] for b in measured))


def test_qwen_preset_on_video_samples(tiny_project, capsys, trained):
    # one clip of 4-8 frames per sample through the Qwen2.5-VL video processor, packed; the processor's pixel bounds
    # scale 56 px frames up, so the visual tokens are whatever it made of them
    out = _bench(capsys, tiny_project, "model.preset=tiny-qwen2.5-vl", "train.packing=true", "train.tokens_per_batch=1024",
                 "--video-frames", "4,8", "--video-sizes", "56")
    assert (out["workload"], out["packing"], out["media"]) == ("chat", True, "1 video of 4-8 frames (56 px)")
    _consistent(out, trained)
    measured = trained["batches"][WARMUP:]
    for batch in measured:
        clips = batch["video_grid_thw"]
        assert clips.shape[0] == batch["num_samples"] and set(clips[:, 0].tolist()) <= {2, 3, 4}  # frames / 2
        assert "pixel_values" not in batch and batch["num_dummy_images"] == 0
        assert batch["pixel_values_videos"].shape[0] == sum(t * h * w for t, h, w in clips.tolist())
        assert batch["num_visual_tokens"] == _visual_tokens_of(batch, "video_grid_thw") > 0
        assert int((batch["mm_token_type_ids"] == 2).sum()) == batch["num_visual_tokens"]  # video tokens, as mRoPE reads them
    visual = sum(b["num_visual_tokens"] for b in measured)
    assert out["visual_tokens_per_s"] * out["step_time_s"] * STEPS == pytest.approx(visual)
    assert out["tokens_per_step"] * STEPS == pytest.approx(visual + sum(b["num_text_tokens"] for b in measured))


def test_sequence_parallel_bench_runs_the_rows_of_one_process_over_two(tiny_project, capsys):
    # SP=2 on 2 processes splits each packed row of 2 x 1024 tokens; one process with a 2048-token row plans the same rows
    common = ["model.preset=tiny-qwen2.5-vl", "train.packing=true", "train.strategy=fsdp", "--images-per-sample", "2,3",
              "--image-sizes", "28,56", "--workload", "chat"]
    code, out, err = run_cli(["bench", "-c", str(tiny_project), "--nproc-per-node", "2", *FLAGS, *common,
                              "train.sequence_parallel=2", "train.tokens_per_batch=1024"], capsys)
    assert code == 0, err
    split = json.loads(out[out.index("{"):])
    whole = _bench(capsys, tiny_project, *common, "train.tokens_per_batch=2048")
    assert split["world_size"] == 2 and "2048 tokens per row over 2 sequence-parallel ranks" in split["settings"]
    assert split["tokens_per_step"] == whole["tokens_per_step"]
    assert split["tokens_per_s_per_gpu"] * 2 == pytest.approx(split["tokens_per_s"])


def test_sequence_parallel_that_does_not_divide_the_processes_is_a_usage_error(tiny_project, capsys):
    code, out, err = run_cli(["bench", "-c", str(tiny_project), "--nproc-per-node", "3", *FLAGS,
                              "model.preset=tiny-qwen2.5-vl", "train.sequence_parallel=2"], capsys)
    assert code == 2 and "train.sequence_parallel=2 does not divide the 3 processes" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--workload", "baseline", "train.packing=true"], r"train.objective grpo benches prompts \(the answers are their references\) of the chat workload"),
    (["train.eval_steps=5"], r"a grpo run has no validation loss"),
])
def test_grpo_settings_a_run_refuses_stop_the_bench_before_it_starts(tiny_project, capsys, trained, args, message):
    code, out, err = run_cli(["bench", "-c", str(tiny_project), "--nproc-per-node", "1", *FLAGS,
                              "model.preset=tiny-qwen2.5-vl", "train.objective=grpo", *args], capsys)
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", err).split())  # the panel's lines joined
    assert code == 2 and re.search(message, text) and "Traceback" not in err
    assert "trainer" not in trained  # no step ran
