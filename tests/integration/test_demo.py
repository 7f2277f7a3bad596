"""`vlmctl demo` at a reduced size: every stage runs for real (torchrun + FSDP2 on 2 processes where 2 cores exist),
and the summary, the outputs and the panel are there. The full-size run's accuracy is recorded in
docs/benchmarks.md, not asserted here (a few steps do not learn)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from vlmctl.data.synthetic import COLORS, QUESTION_TYPES, SHAPES, generate_shapes_vqa
from vlmctl.demo import blind_baseline, default_launch, score_by_type

from cli_runner import run_cli as run


def test_generated_set_is_deterministic_balanced_and_answerable(tmp_path):
    a = generate_shapes_vqa(tmp_path / "a", num_samples=80, seed=3)
    b = generate_shapes_vqa(tmp_path / "b", num_samples=80, seed=3)
    c = generate_shapes_vqa(tmp_path / "c", num_samples=80, seed=4)
    assert a.read_text() == b.read_text() and a.read_text() != c.read_text()
    assert (a.parent / "images" / "count-00002.png").read_bytes() == (b.parent / "images" / "count-00002.png").read_bytes()
    records = json.loads(a.read_text())
    types = Counter(r["id"].split("-")[0] for r in records)
    assert types == {q: 20 for q in QUESTION_TYPES}
    valid = {"color": set(COLORS), "shape": set(SHAPES), "count": {"1", "2", "3"}, "position": {"left", "right"}}
    for r in records:
        q = r["id"].split("-")[0]
        human, gpt = r["conversations"]
        assert human["from"] == "human" and human["value"].startswith("<image>\n") and gpt["value"] in valid[q]
        if q == "color":  # the answer's exact RGB is painted in the picture (shapes are drawn without antialiasing)
            pixels = set(Image.open(a.parent / r["image"]).convert("RGB").getdata())
            assert COLORS[gpt["value"]] in pixels
        if q == "shape":  # the named color is in the picture
            color = human["value"].split("the ")[1].split(" object")[0]
            assert COLORS[color] in set(Image.open(a.parent / r["image"]).convert("RGB").getdata())


def test_generated_scenes_hold_only_the_objects_asked_about(tmp_path):
    """Default scenes: one object per 2 x 2 grid cell, no distractors, so every answer is read off large features."""
    import numpy as np

    path = generate_shapes_vqa(tmp_path / "s", num_samples=40, seed=5, image_size=64)
    palette = {rgb: name for name, rgb in COLORS.items()}
    for r in json.loads(path.read_text()):
        q, answer = r["id"].split("-")[0], r["conversations"][1]["value"]
        pixels = np.asarray(Image.open(path.parent / r["image"]).convert("RGB"))
        painted = np.zeros(pixels.shape[:2], dtype=bool)
        for rgb in COLORS.values():
            painted |= (pixels == rgb).all(-1)
        cells = {(x, y) for y in (0, 1) for x in (0, 1) if painted[32 * y:32 * y + 32, 32 * x:32 * x + 32].any()}
        colors = {palette[tuple(int(c) for c in px)] for px in pixels[painted]}
        if q == "count":
            assert len(cells) == int(answer)
        else:
            assert len(cells) == 1 and len(colors) == 1
        if q == "color":
            assert colors == {answer}
        if q == "position":
            assert next(iter(cells))[0] == (0 if answer == "left" else 1)
    with pytest.raises(ValueError, match="max_distractors"):
        generate_shapes_vqa(tmp_path / "t", num_samples=4, max_distractors=4)


def test_blind_baseline_and_scores_per_type():
    base = blind_baseline([("color", "red"), ("color", "Blue"), ("color", "blue"), ("count", "2"), ("count", "1")])
    assert base == {"color": "blue", "count": "1"}  # ties go to the alphabetically first answer
    records = [("color-1", "blue", ["blue"]), ("color-2", "red", ["red"]), ("color-3", "Red ", ["green"]),
               ("count-4", "2", ["2"]), ("count-5", "3", ["1"])]
    scores = {s.qtype: s for s in score_by_type(records, base)}
    assert (scores["color"].n, scores["color"].accuracy, scores["color"].baseline) == (3, pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert (scores["count"].accuracy, scores["count"].baseline, scores["count"].baseline_answer) == (0.5, 0.5, "1")


def test_default_launch_uses_fsdp_processes_only_with_two_cores():
    assert default_launch(2) == ("torchrun", 2) and default_launch(16) == ("torchrun", 2) and default_launch(1) == ("none", 1)


def test_demo_reduced_runs_every_stage(tmp_path, capsys):
    folder = tmp_path / "demo"
    args = ["demo", str(folder), "--num-samples", "240", "train.max_steps=6", "train.save_steps=3", "train.logging_steps=1"]
    code, out, err = run(args, capsys)
    assert code == 0, err + out
    assert "✓ train (" in out and "✓ eval on the val split (" in out  # off a terminal, one line per stage as it ends
    summary = json.loads((folder / "outputs" / "demo_summary.json").read_text())
    assert list(summary["stage_seconds"]) == ["init", "prepare", "build", "train", "eval"]
    assert all(s > 0 for s in summary["stage_seconds"].values())
    assert (summary["launcher"], summary["nproc"]) == default_launch()
    assert summary["steps"] == 6 and summary["train_samples"] + summary["val_samples"] == 240

    run_dir = Path(summary["run_dir"])
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "checkpoint-6").is_dir()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    assert "final model exported" in (run_dir / "train.log").read_text()

    eval_dir = Path(summary["eval_dir"])
    rows = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == summary["val_samples"] == sum(s["n"] for s in summary["scores"])
    assert (eval_dir / "report.html").is_file() and json.loads((eval_dir / "metrics.json").read_text())["task"] == "vqa"
    # the per-type accuracies are the exact matches in predictions.jsonl
    for s in summary["scores"]:
        mine = [r for r in rows if r["id"].startswith(s["qtype"] + "-")]
        hits = sum(r["prediction"].strip().lower() == r["references"][0] for r in mine)
        assert s["accuracy"] == pytest.approx(hits / len(mine))
    # the blind baseline is the most common train answer per type, from the raw data minus the val ids
    raw = json.loads((folder / "data" / "raw" / "shapes_vqa.json").read_text())
    val_ids = {r["id"] for r in rows}
    base = blind_baseline([(r["id"].split("-")[0], r["conversations"][1]["value"]) for r in raw if r["id"] not in val_ids])
    assert {s["qtype"]: s["baseline_answer"] for s in summary["scores"]} == {q: base[q] for q in (s["qtype"] for s in summary["scores"])}

    for text in ("time per stage", "blind baseline", "overall", "vlmctl convert", "--dry-run", "--template llava"):
        assert text in out, text

    # a second run in the same folder needs --force
    code, _, err = run(["demo", str(folder), "train.max_steps=2"], capsys)
    assert code == 2 and "--force" in err
