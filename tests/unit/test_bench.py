"""`vlmctl bench` on CPU with tiny models: the report is real and consistent, the synthetic workload goes through
the trainer's data path, and usage errors stop before any process starts. The families' benches (LLaVA packed and
padded, Qwen padded, LoRA) are in tests/integration/test_bench_models.py."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from cli_runner import run_cli
from vlmctl.bench import WorkloadSpec, qwen_vl_samples
from vlmctl.cli.app import main


def test_bench_cli_reports_consistent_throughput(tmp_path, capsys):
    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny-qwen2.5-vl\n  init: random\ntrain:\n  tokens_per_batch: 384\n  attn_implementation: sdpa\n")
    try:
        main(["bench", "-c", str(path), "--steps", "2", "--image-sizes", "28,56", "--text-tokens", "8,40", "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # stdout holds the JSON object only; the progress went to stderr
    assert out["steps"] == 2 and 0 < out["tokens_per_step"] <= 384
    assert re.search(r"step \d+: loss", captured.err) and "(warm-up)" in captured.err
    assert out["tokens_per_s"] > 0 and out["mfu"] > 0
    # a Qwen-VL model with packed rows keeps the baseline's workload (the published figures' samples)
    assert out["workload"] == "baseline" and out["packing"] is True and out["adapter"] == "none"
    assert abs(out["text_tokens_per_s"] + out["visual_tokens_per_s"] - out["tokens_per_s"]) < 1e-6 * out["tokens_per_s"] + 1e-6


def test_synthetic_samples_have_matching_image_tokens_and_flops_grow_with_length():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                           vision_config=dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=16),
                           image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    for s in qwen_vl_samples(50, cfg, WorkloadSpec(image_sizes=(28, 56, 112), text_tokens=(5, 30))):
        grid = s["image_grid_thw"][0]
        assert int((s["input_ids"] == 3).sum()) == grid[1] * grid[2] // 4 == s["n_visual"]
        assert s["pixel_values"].shape[0] == s["n_patches"]
        assert not bool(((s["input_ids"][s["n_visual"] + 2:] >= 3) & (s["input_ids"][s["n_visual"] + 2:] <= 6)).any())
    # bench counts FLOPs with the trainer's cost model (vlmctl.train.flops), per packed row
    cost = _cost_model(cfg, {"vision", "projector", "llm"})
    flops = lambda text, labelled: cost.sample_flops(text_tokens=text, labelled_tokens=labelled, image_patches=[64])  # noqa: E731
    assert flops(100, 50) < flops(200, 50) < flops(200, 100)


def test_bench_two_processes_fsdp_sums_ranks(tmp_path, capsys):
    # the trainer's FSDP2 step on two CPU processes (torchrun): each rank packs its own rows; --profile writes each
    # rank's profile of its last warm-up step
    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny-qwen2.5-vl\n  init: random\ntrain:\n  tokens_per_batch: 256\n  strategy: fsdp\n"
                    "  stage: full\n  attn_implementation: sdpa\n")
    try:
        main(["bench", "-c", str(path), "--steps", "2", "--nproc-per-node", "2", "--image-sizes", "28,56",
              "--text-tokens", "8,40", "--json", "--warmup", "1", "--profile", str(tmp_path / "prof")])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["strategy"] == "fsdp"
    for rank in (0, 1):
        ops = (tmp_path / "prof" / f"rank{rank}" / "ops.txt").read_text()
        assert ops.startswith("profiled step: ") and "aten::mm" in ops  # the step's matmuls, from the profiler's table
        assert "GPU idle time: no GPU kernels in the trace" in ops  # the idle report, which a CPU trace cannot fill
        with gzip.open(tmp_path / "prof" / f"rank{rank}" / "trace.json.gz") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events)
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["rank0", "rank1"]
    assert 256 < out["tokens_per_step"] <= 2 * 256  # two packed rows per step, one per rank
    assert abs(out["tokens_per_s_per_gpu"] * 2 - out["tokens_per_s"]) < 1e-6 * out["tokens_per_s"]
    # the ranks' balance, as training reports it: a ratio of mean to max, so in (0, 1]
    assert 0 < out["balance"] <= 1 and 0 < out["balance_flops"] <= 1 and 0 <= out["data_wait"] < 1
    # each measured step's time is its slowest rank's: their mean is at least the slowest rank's mean step time
    times = out["step_times_s"]
    assert len(times) == 2 and min(times) > 0 and sum(times) / 2 >= out["step_time_s"] * (1 - 1e-9)


def _cost_model(cfg, trainable: set[str]):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vlmctl.families import detect_family, get_family
    from vlmctl.train.flops import CostModel

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    return CostModel.from_model(model, get_family(detect_family(cfg)), trainable)


def test_frozen_parts_count_fewer_flops():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                           vision_config=dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=16))
    sample = dict(text_tokens=100, labelled_tokens=50, image_patches=[64])
    full = _cost_model(cfg, {"vision", "projector", "llm"}).sample_terms(**sample)
    frozen_vision = _cost_model(cfg, {"projector", "llm"}).sample_terms(**sample)
    frozen_both = _cost_model(cfg, {"projector"}).sample_terms(**sample)
    # a frozen vision tower runs forward only: a third of its attention remains, and less of its weights' work
    assert abs(frozen_vision["vision_attention"] - full["vision_attention"] / 3) < 1e-6 * sum(full.values())
    assert 0 < frozen_vision["vision"] < full["vision"]
    assert all(frozen_vision[k] == full[k] for k in ("llm", "lm_head", "llm_attention"))
    assert sum(frozen_both.values()) < sum(frozen_vision.values()) < sum(full.values())


def _bench_doing_in_the_second_measured_step(monkeypatch, action):
    """The tiny Qwen2.5-VL bench (one warm-up step, three measured) with `action()` run at the start of the second
    measured step, inside its timing; returns the `BenchResult`."""
    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection

    original_measure = bench._measure

    def spy(trainer, *args, **kwargs):
        original_step, calls = trainer.train_step, []

        def train_step():
            calls.append(None)
            if len(calls) == 3:  # the warm-up step, then the measured steps: this is the second measured one
                action()
            return original_step()

        trainer.train_step = train_step
        return original_measure(trainer, *args, **kwargs)

    monkeypatch.setattr(bench, "_measure", spy)
    return bench.run_bench(ModelSection(preset="tiny-qwen2.5-vl", init="random"),
                           TrainSection(tokens_per_batch=384, attn_implementation="sdpa"),
                           steps=3, warmup=1, spec=bench.WorkloadSpec(image_sizes=(28, 56), text_tokens=(8, 40)),
                           log=None)


def test_the_collectors_pauses_are_counted_per_measured_step(monkeypatch):
    """A full collection inside the second measured step shows there: its seconds in `step_gc_s` (one entry per
    measured step, the largest), and one full collection or more in `gc_full`."""
    import gc

    result = _bench_doing_in_the_second_measured_step(monkeypatch, gc.collect)
    gc_s = result.step_gc_s
    assert len(gc_s) == 3 and min(gc_s) >= 0 and max(range(3), key=gc_s.__getitem__) == 1 and gc_s[1] > 0
    assert result.gc_full >= 1 and gc_s[1] <= result.step_times_s[1]


def test_graphs_compiled_inside_a_measured_step_are_counted_there(monkeypatch):
    """A torch.compile'd function first called inside the second measured step: one graph compiled there in
    `step_compiles` (one entry per measured step), none in the others, and the CLI's slowest-step line names it when
    that step is the slowest."""
    import torch

    from vlmctl.cli.bench import slowest_step

    compiled = torch.compile(lambda x: (x * 2).sin().sum(), backend="eager")
    result = _bench_doing_in_the_second_measured_step(monkeypatch, lambda: compiled(torch.randn(4)))
    assert result.step_compiles == [0, 1, 0]
    result.step_times_s = [0.1, 0.5, 0.1]  # the compiling step as the slowest, for the rendered line
    line = slowest_step(result)
    assert "(measured step 2 of 3" in line and line.endswith(", 1 graph compiled in it)"), line


def test_bench_and_the_training_metrics_give_the_same_mfu_for_the_same_batches(monkeypatch):
    # One FLOP formula: the bench's figures and the trainer's logged row come from the same step results, whose FLOPs
    # are the cost model's on each collated batch. Time is made deterministic (1 s per step) so the MFUs compare.
    import gc

    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection
    from vlmctl.train.flops import CostModel

    seen: dict = {}
    original_measure = bench._measure

    def spy(trainer, *args, **kwargs):
        seen["trainer"] = trainer
        batches, steps = [], []
        original_flops, original_step = trainer.flops_of, trainer.train_step

        def flops_of(batch):
            batches.append(batch)
            return original_flops(batch)

        def train_step():
            steps.append(original_step())
            return steps[-1]

        trainer.flops_of, trainer.train_step = flops_of, train_step
        seen["batches"], seen["steps"], seen["cost"] = batches, steps, original_flops.__self__
        return original_measure(trainer, *args, **kwargs)

    clock = iter(float(t) for t in range(10_000))
    monkeypatch.setattr(bench, "_measure", spy)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    # no heap freeze and no automatic collection: a collection's callbacks (the bench's pause counter) would read
    # this clock too, and what earlier tests left on the heap can start one inside a measured step
    gc.disable()
    try:
        result = bench.run_bench(ModelSection(preset="tiny-qwen2.5-vl", init="random"),
                                 TrainSection(tokens_per_batch=384, attn_implementation="sdpa", gc_freeze_step=0),
                                 steps=2, warmup=1, spec=bench.WorkloadSpec(image_sizes=(28, 56), text_tokens=(8, 40)),
                                 log=None)
    finally:
        gc.enable()
    trainer, steps = seen["trainer"], seen["steps"]
    assert len(steps) == 3 and result.step_time_s == 1.0 and result.step_times_s == [1.0, 1.0]  # the warm-up step left out
    # each step's FLOPs are the cost model's on the very batch it trained on (one packed row per step here)
    cost = seen["cost"]
    assert isinstance(cost, CostModel) and len(seen["batches"]) == 3
    assert [s.flops for s in steps] == [cost.batch_flops(b) for b in seen["batches"]] and steps[-1].flops > 0
    # the trainer's logged row over the measured steps, with the bench's peak, gives the bench's MFU
    trainer.peak_flops = bench.DEFAULT_PEAK
    row = trainer._row(steps[1:], seconds=2.0)
    assert row["mfu"] == result.mfu


def test_bench_ranks_tie_themselves_to_the_launcher(tmp_path, monkeypatch):
    """A bench rank (`python -m vlmctl.bench WORKDIR`) dies with the launcher as a training rank does, and reports
    its error through the ranks' one-panel path."""
    import pytest

    import vlmctl.bench as bench
    import vlmctl.distributed.process as process
    from vlmctl.errors import ConfigError

    calls = []
    monkeypatch.setattr(process, "tie_to_launcher", lambda: calls.append("tie"))
    monkeypatch.setattr(process, "exit_on_stop_signals", lambda: calls.append("signals"))
    monkeypatch.setattr(process, "report_error", lambda exc: calls.append(type(exc).__name__) or exc.exit_code)

    def failing(*args, **kwargs):
        raise ConfigError("nope")

    monkeypatch.setattr(bench, "run_bench", failing)
    (tmp_path / "config.yaml").write_text("model: {preset: tiny-qwen2.5-vl, init: random}\n")
    (tmp_path / "args.json").write_text(json.dumps({"steps": 1, "warmup": 0, "image_sizes": [28], "text_tokens": [8, 16]}))
    with pytest.raises(SystemExit) as exc:
        bench.main([str(tmp_path)])
    assert exc.value.code == 2 and calls == ["tie", "signals", "ConfigError"]


# ---------------------------------------------------------------------------------------------- the chat workload


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2.5-vl"])
def test_chat_samples_go_through_the_processor_and_label_every_answer_token(preset):
    # LLaVA's fixed-size images and Qwen's dynamic resolution, one to three images per sample: counted lengths
    # (planning) equal encoded lengths, the answer has the requested number of tokens, all of them (and the
    # end-of-turn token) labelled, nothing else
    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection
    from vlmctl.data.collate import IGNORE_INDEX, Collator

    spec = WorkloadSpec(image_sizes=(28, 56, 84), text_tokens=(3, 30), kind="chat", images_per_sample=(1, 3))
    plan = bench.prepare(ModelSection(preset=preset, init="random"), TrainSection(packing=False, micro_batch_size=2),
                         spec, steps=3, warmup=1, check_device=False)
    workload, family = plan.workload, plan.model.family
    assert plan.spec.kind == "chat" and isinstance(workload, bench.ChatWorkload) and len(workload.lengths) == 8
    collator = Collator(plan.model.processor, family)
    tokenizer = plan.model.processor.tokenizer
    for i in range(len(workload.lengths)):
        sample = workload.sample(i)
        row = collator.encode(sample)
        answer = sample.messages[1]["content"][0]["text"]
        labelled = row.labels[row.labels != IGNORE_INDEX].tolist()
        assert row.length == workload.lengths[i]
        assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) == len(answer.split(" ")) - 1
        assert 3 <= len(labelled) - 1 <= 30 and labelled[:-1] == tokenizer(answer, add_special_tokens=False)["input_ids"]
        sides = workload.media[i].images
        assert row.num_images == len(sides) and workload.media[i].video is None
        assert row.num_visual_tokens == sum(family.num_visual_tokens(side, side, plan.model.processor) for side in sides)
    assert len({len(m.images) for m in workload.media}) > 1 and all(1 <= len(m.images) <= 3 for m in workload.media)
    # the micro-batches: the trainer's padded collator over the trainer's sampler
    batches = bench.plan_batches(plan, TrainSection(packing=False, micro_batch_size=2, group_by_length=False), dp_rank=0)
    assert len(batches) == 4 and all(len(b) == 2 for b in batches) and len({i for b in batches for i in b}) == 8
    batch = workload.batch(batches[0], collator)
    assert batch["input_ids"].shape[0] == 2 and batch["num_samples"] == 2 and batch["num_dummy_images"] == 0


def test_packed_rows_fit_the_budget_fullest_first_and_differ_per_rank():
    from vlmctl.bench import rank_batches

    lengths = [30, 70, 55, 20, 90, 40, 65, 10, 85, 45, 35, 60, 150]  # 150 does not fit a row of 100
    rows = {r: rank_batches(lengths, packing=True, budget=100, micro_batch_size=1, rows=2, dp_rank=r, dp_size=2)
            for r in (0, 1)}
    fill = [sum(lengths[i] for i in b) for b in rows[0] + rows[1]]
    assert all(f <= 100 for f in fill) and 12 not in {i for r in rows.values() for b in r for i in b}
    assert [sum(lengths[i] for i in b) for b in rows[0]] == sorted((sum(lengths[i] for i in b) for b in rows[0]), reverse=True)
    assert not {i for b in rows[0] for i in b} & {i for b in rows[1] for i in b}
    from vlmctl.errors import UsageError

    with pytest.raises(UsageError, match="packed rows"):
        rank_batches(lengths, packing=True, budget=100, micro_batch_size=1, rows=20, dp_rank=0, dp_size=1)


def test_packed_rows_are_split_by_cost_as_training_splits_them():
    """With per-sample costs every optimizer step's rows hold the same samples as without, re-split so that the
    busiest rank's cost drops (here: one row of expensive samples and one of cheap ones become two mixed rows)."""
    from vlmctl.bench import rank_batches

    lengths = [50, 50, 50, 50, 50, 50, 50, 50]
    costs = [9.0, 9.0, 1.0, 1.0, 9.0, 9.0, 1.0, 1.0]  # equal tokens, unequal work
    args = dict(packing=True, budget=100, micro_batch_size=1, rows=2, dp_size=2)
    plain = {r: rank_batches(lengths, dp_rank=r, **args) for r in (0, 1)}
    split = {r: rank_batches(lengths, dp_rank=r, costs=costs, **args) for r in (0, 1)}

    def step_cost(rows, s):
        return max(sum(costs[i] for i in rows[r][s]) for r in (0, 1))

    for s in range(2):
        assert sorted(i for r in (0, 1) for i in split[r][s]) == sorted(i for r in (0, 1) for i in plain[r][s])
        assert all(sum(lengths[i] for i in split[r][s]) <= 100 for r in (0, 1))
        assert step_cost(split, s) <= step_cost(plain, s)
    assert sum(step_cost(split, s) for s in range(2)) < sum(step_cost(plain, s) for s in range(2))
    # one rank alone, one row per step: nothing to split
    assert rank_batches(lengths, dp_rank=0, costs=costs, **{**args, "dp_size": 1}) == rank_batches(lengths, dp_rank=0, **{**args, "dp_size": 1})


# --------------------------------------------------------------------------------------------------- usage errors


@pytest.fixture
def tiny_project(tmp_path, monkeypatch):
    """`vlmctl init --template tiny` (4 generated samples, not prepared, no model built); spawning processes fails
    the test: every error below must come before any process starts."""
    import vlmctl.train.launch as launch
    from vlmctl.project import init_project

    def spawn(*args, **kwargs):
        raise AssertionError("a usage error must stop vlmctl bench before it spawns processes")

    monkeypatch.setattr(launch, "spawn", spawn)
    init_project(tmp_path / "proj", "tiny", num_samples=4)
    return tmp_path / "proj" / "vlmctl.yaml"


def _one_panel(code: int, err: str) -> str:
    assert code == 2, err
    assert err.count("╭─") == 1 and "Traceback" not in err, err
    return " ".join(err.split())  # the panel's text without its line breaks


@pytest.mark.parametrize("args, words", [
    (["--text-tokens", "40"], ["--text-tokens", "MIN,MAX"]),
    (["--text-tokens", "40,8"], ["--text-tokens", "MIN <= MAX"]),
    (["--image-sizes", "224,big"], ["--image-sizes", "integers"]),
    (["--workload", "fast"], ["--workload", "chat"]),
    (["--steps", "0"], ["--steps", "at least one"]),
    (["--workload", "baseline"], ["baseline", "llava", "--workload chat"]),
    (["model.init=pretrained"], ["no built model", "model build", "model.init=random"]),
    (["model.preset=tiny-nothing"], ["model.preset", "unknown preset", "tiny-nothing"]),
    (["train.attn_implementation=varlen"], ["varlen", "train.packing"]),
    (["--images-per-sample", "2"], ["--images-per-sample 2", "MIN,MAX"]),
    (["--images-per-sample", "0,2"], ["--images-per-sample 0,2", "1 <= MIN <= MAX"]),
    (["--images-per-sample", "3,2"], ["--images-per-sample 3,2", "1 <= MIN <= MAX"]),
    (["--images-per-sample", "two"], ["--images-per-sample", "integers"]),
    (["--video-frames", "8,4"], ["--video-frames 8,4", "1 <= MIN <= MAX"]),
    (["--video-frames", "4"], ["--video-frames 4", "MIN,MAX"]),
    (["--video-frames", "3,3"], ["--video-frames 3,3", "multiple of 2"]),
    (["--video-frames", "4,8", "--video-sizes", "0"], ["--video-sizes 0", "positive sides"]),
    (["--video-frames", "4,8", "--images-per-sample", "2,3"], ["--images-per-sample with --video-frames", "one video"]),
    (["--video-frames", "4,8", "--workload", "baseline"], ["--workload baseline has no video", "--workload chat"]),
    # the tiny template's LLaVA takes images only
    (["--video-frames", "4,8"], ["--video-frames", "llava takes no video", "Qwen2.5-VL"]),
])
def test_usage_errors_print_one_panel_and_exit_2_before_any_process_starts(tiny_project, capsys, args, words):
    # the template asks for 2 processes: none is started
    code, _, err = run_cli(["bench", "-c", str(tiny_project), "--nproc-per-node", "2", *args], capsys)
    text = _one_panel(code, err)
    assert all(w in text for w in words), text


def test_qlora_without_cuda_is_a_usage_error(tiny_project, capsys, monkeypatch):
    import vlmctl.train.launch as launch

    if _cuda():
        pytest.skip("a GPU is visible")
    monkeypatch.setattr(launch, "check_packages", lambda train: None)  # bitsandbytes or not: the GPU is missing
    code, _, err = run_cli(["bench", "-c", str(tiny_project), "train.lora.r=16", "train.lora.quantize=4bit"], capsys)
    text = _one_panel(code, err)
    assert "QLoRA" in text and "CUDA" in text and "train.lora.quantize=none" in text


def test_more_processes_than_gpus_is_a_usage_error(tiny_project, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = run_cli(["bench", "-c", str(tiny_project), "--nproc-per-node", "3"], capsys)
    text = _one_panel(code, err)
    assert "--nproc-per-node 3" in text and "2 visible GPU" in text


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------------ --scaling


@pytest.mark.parametrize("args, words", [
    (["--scaling", "1,two"], ["--scaling", "not a comma-separated list", "--scaling 1,2,4"]),
    (["--scaling", ""], ["--scaling", "not a comma-separated list"]),
    (["--scaling", "0,1"], ["--scaling", "at least 1"]),
    (["--scaling", "1,2,2"], ["--scaling", "lists 2 more than once"]),
    (["--scaling", "1,2", "--nproc-per-node", "2"], ["--scaling and --nproc-per-node", "give one of them"]),
    (["--scaling", "1,2", "--profile", "prof"], ["--profile profiles one bench run", "--nproc-per-node N"]),
    (["--warmup", "0", "--profile", "prof"], ["--profile profiles the last warm-up step", "--warmup 2"]),
    (["--scaling", "1,2", "--workload", "fast"], ["--workload", "chat"]),
    (["--scaling", "1,2", "train.nnodes=2", "train.master_addr=10.0.0.1"], ["one node", "train.nnodes=1"]),
])
def test_scaling_usage_errors_print_one_panel_and_exit_2_before_any_process_starts(tiny_project, capsys, monkeypatch, args, words):
    import vlmctl.bench as bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("no bench may run after a usage error"))
    code, _, err = run_cli(["bench", "-c", str(tiny_project), *args], capsys)
    text = _one_panel(code, err)
    assert all(w in text for w in words), text


def test_scaling_to_more_processes_than_gpus_is_a_usage_error(tiny_project, capsys, monkeypatch):
    import torch

    import vlmctl.bench as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("no bench may run after a usage error"))
    code, _, err = run_cli(["bench", "-c", str(tiny_project), "--scaling", "4,1,2"], capsys)
    text = _one_panel(code, err)
    assert "--scaling 1,2,4" in text and "4 processes" in text and "2 visible GPU" in text


def test_scaling_checks_every_count_before_the_first_runs(tiny_project, capsys, monkeypatch):
    # the check of the last count refuses it after the others passed: no count runs at all
    import vlmctl.bench as bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("no bench may run after a usage error"))
    monkeypatch.setattr(bench, "check_bench", _failing_from(bench.check_bench, 3))
    code, _, err = run_cli(["bench", "-c", str(tiny_project), "--scaling", "1,2,3"], capsys)
    assert "count 3 refused" in _one_panel(code, err)


def _failing_from(check, bad: int):
    from vlmctl.errors import UsageError

    def checked(cfg, nproc, **kwargs):
        if nproc == bad:
            raise UsageError(f"count {bad} refused")
        return check(cfg, nproc, **kwargs)

    return checked


def _result(world: int, tokens_per_s: float, **extra):
    from vlmctl.bench import BenchResult

    return BenchResult(name="tiny", steps=2, world_size=world, strategy="fsdp", tokens_per_s=tokens_per_s,
                       text_tokens_per_s=tokens_per_s / 2, visual_tokens_per_s=tokens_per_s / 2, samples_per_s=1.0,
                       step_time_s=0.5, mfu=0.01, peak_memory_gib=0.0, tokens_per_step=100.0, workload="chat", **extra)


def test_scaling_efficiency_is_per_gpu_throughput_against_the_fewest_processes():
    from vlmctl.bench import ScalingResult, parse_counts

    assert parse_counts("4, 1,2") == (1, 2, 4)
    table = ScalingResult([_result(1, 1000.0, data_wait=0.01), _result(2, 1800.0, balance=0.9, data_wait=0.02),
                           _result(4, 3000.0, balance=0.8, data_wait=0.05)])
    assert [table.efficiency(r) for r in table.results] == [1.0, 0.9, 0.75]
    out = table.as_dict()
    assert out["baseline_processes"] == 1 and [r["world_size"] for r in out["rows"]] == [1, 2, 4]
    assert [r["efficiency"] for r in out["rows"]] == [1.0, 0.9, 0.75]
    assert [r["tokens_per_s_per_gpu"] for r in out["rows"]] == [1000.0, 900.0, 750.0]
    assert out["rows"][1]["balance"] == 0.9 and out["rows"][2]["data_wait"] == 0.05


def test_scaling_table_has_a_row_per_count(capsys):
    from vlmctl.bench import ScalingResult
    from vlmctl.cli.bench import _render_scaling

    _render_scaling(ScalingResult([_result(1, 1000.0, settings="fsdp, same"), _result(2, 1800.0, balance=0.9, data_wait=0.02, settings="fsdp, same")]))
    out = capsys.readouterr().out
    rows = [" ".join(line.split()) for line in out.splitlines() if line.strip()[:1] in ("1", "2")]
    assert rows[0] == "1 1,000 1,000 100.0% 1.0% 500 0.0 - -"  # balance and data wait unknown
    assert rows[1] == "2 1,800 900 90.0% 1.0% 500 0.0 90.0% 2.0%"
    assert out.count("settings: fsdp, same") == 1  # the same settings for every count: printed once


def test_bench_table_names_the_media_of_the_samples(tiny_project, capsys, monkeypatch):
    # the flags reach the bench as one spec, and the table's title says what the samples held
    import vlmctl.bench as bench

    seen = {}

    def measured(cfg, *, spec, **kwargs):
        seen["spec"] = spec
        return _result(1, 1000.0, media=spec.media(), settings="fsdp")

    monkeypatch.setattr(bench, "benchmark", measured)
    code, out, err = run_cli(["bench", "-c", str(tiny_project), "--video-frames", "16,64", "--video-sizes", "224,448"], capsys)
    assert code == 0, err
    assert (seen["spec"].video_frames, seen["spec"].video_sizes, seen["spec"].images_per_sample) == ((16, 64), (224, 448), (1, 1))
    assert "(chat workload: 1 video of 16-64 frames (224-448 px), packed rows)" in " ".join(out.split())


def test_workload_costs_put_image_heavy_samples_first_in_the_probe():
    """The bench's probe rows take the samples of the most estimated FLOPs per token, as training's: with a vision
    tower as wide as the LLM, a visual token (4 patches through the tower) costs more than a text token, so the
    probe's first samples are the image-heavy ones, not the longest."""
    import numpy as np
    from transformers import Qwen2_5_VLConfig

    from vlmctl.bench import BaselineWorkload, WorkloadSpec
    from vlmctl.train.autotune import probe_rows

    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
                           vision_config=dict(depth=2, hidden_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]))
    workload = BaselineWorkload(cfg, WorkloadSpec(image_sizes=(112, 448), text_tokens=(64, 1024)), seed=0, rows=4, budget=4096)
    lengths = np.asarray(workload.lengths)
    costs = workload.costs(_cost_model(cfg, {"vision", "projector", "llm"}))
    share = np.asarray([s["n_visual"] for s in workload.samples]) / lengths
    assert costs.shape == lengths.shape and np.corrcoef(share, costs / lengths)[0, 1] > 0.9
    picked = []
    probe_rows(lengths, lambda idx: picked.extend(idx) or idx, packing=True, costs=costs)(int(lengths.max()) * 2)
    assert share[picked].mean() > share.mean() and share[picked[0]] >= np.quantile(share, 0.9)


@pytest.mark.parametrize("freeze_step", [2, 0])
def test_the_trainer_freezes_its_heap_after_the_steps_asked_and_gives_it_back(freeze_step):
    """`train.gc_freeze_step`: after that many steps the objects alive leave the collector's reach (`gc.freeze`),
    counted in `gc_frozen`; the trainer gives them back when it is done (0: nothing frozen)."""
    import gc

    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection

    seen = []
    original_measure = bench._measure

    def spy(trainer, *args, **kwargs):
        original_step = trainer.train_step

        def train_step():
            result = original_step()
            seen.append(gc.get_freeze_count())  # after each step: frozen from the step asked on
            return result

        trainer.train_step = train_step
        return original_measure(trainer, *args, **kwargs)

    gc.unfreeze()
    bench._measure, restore = spy, bench._measure
    try:
        result = bench.run_bench(ModelSection(preset="tiny-qwen2.5-vl", init="random"),
                                 TrainSection(tokens_per_batch=384, attn_implementation="sdpa", gc_freeze_step=freeze_step),
                                 steps=2, warmup=1, spec=bench.WorkloadSpec(image_sizes=(28, 56), text_tokens=(8, 40)),
                                 log=None)
    finally:
        bench._measure = restore
    if freeze_step:
        assert seen[0] == 0 and seen[1] > 10_000 and seen[2] >= seen[1] * 0.9  # torch's and the model's objects
        assert abs(result.gc_frozen - seen[1]) < 0.01 * seen[1]  # counted at the freeze; frozen objects freed since leave it
    else:
        assert seen == [0, 0, 0] and result.gc_frozen == 0
    assert gc.get_freeze_count() == 0  # given back once the steps are done
