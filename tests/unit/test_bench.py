"""`vlmctl bench` on CPU with a tiny Qwen2.5-VL: the report is real and consistent."""

from __future__ import annotations

import json

from vlmctl.bench import WorkloadSpec, qwen_vl_samples
from vlmctl.cli.app import main


def test_bench_cli_reports_consistent_throughput(tmp_path, capsys):
    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny-qwen2.5-vl\n  init: random\ntrain:\n  tokens_per_batch: 384\n  attn_implementation: sdpa\n")
    try:
        main(["bench", "-c", str(path), "--steps", "2", "--image-sizes", "28,56", "--text-tokens", "8,40", "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 2 and 0 < out["tokens_per_step"] <= 384
    assert out["tokens_per_s"] > 0 and out["mfu"] > 0
    assert abs(out["text_tokens_per_s"] + out["visual_tokens_per_s"] - out["tokens_per_s"]) < 1e-6 * out["tokens_per_s"] + 1e-6


def test_bench_refuses_non_qwen_models(tmp_path, capsys):
    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny\n  init: random\n")
    try:
        main(["bench", "-c", str(path), "--steps", "1"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "Qwen-VL" in capsys.readouterr().err


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
    # the trainer's FSDP2 step on two CPU processes (torchrun): each rank packs its own rows
    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny-qwen2.5-vl\n  init: random\ntrain:\n  tokens_per_batch: 256\n  strategy: fsdp\n"
                    "  stage: full\n  attn_implementation: sdpa\n")
    try:
        main(["bench", "-c", str(path), "--steps", "2", "--nproc-per-node", "2", "--image-sizes", "28,56",
              "--text-tokens", "8,40", "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["strategy"] == "fsdp"
    assert 256 < out["tokens_per_step"] <= 2 * 256  # two packed rows per step, one per rank
    assert abs(out["tokens_per_s_per_gpu"] * 2 - out["tokens_per_s"]) < 1e-6 * out["tokens_per_s"]


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


def test_bench_and_the_training_metrics_give_the_same_mfu_for_the_same_batches(monkeypatch):
    # One FLOP formula: the bench's figures and the trainer's logged row come from the same step results, whose FLOPs
    # are the cost model's on each collated batch. Time is made deterministic (1 s per step) so the MFUs compare.
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
    result = bench.run_bench(ModelSection(preset="tiny-qwen2.5-vl", init="random"),
                             TrainSection(tokens_per_batch=384, attn_implementation="sdpa"),
                             steps=2, warmup=1, spec=bench.WorkloadSpec(image_sizes=(28, 56), text_tokens=(8, 40)),
                             log=None)
    trainer, steps = seen["trainer"], seen["steps"]
    assert len(steps) == 3 and result.step_time_s == 1.0
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
