"""`vlmctl demo` at a reduced size: every stage runs for real (torchrun + FSDP2 on 2 processes where 2 cores exist),
and the summary, the outputs and the panel are there. The full-size run's accuracy is recorded in
docs/benchmarks.md, not asserted here (a few steps do not learn)."""

from __future__ import annotations

import json
import random
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
    assert summary["frozen"] == []  # the default connector trains with everything else

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


# ---------------------------------------------------------------------------------------------------------------------
# `vlmctl demo --modality video` and `--modality audio`: the generated sets and reduced runs
# ---------------------------------------------------------------------------------------------------------------------


def _decoded_frames(path: Path):
    """Frames [T, H, W, 3] uint8 of a video file, decoded with PyAV."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_generated_clips_are_deterministic_balanced_and_answerable(tmp_path):
    pytest.importorskip("av")
    import numpy as np

    from vlmctl.data.synthetic_video import DIRECTIONS, MOTIONS, QUESTION_TYPES as VIDEO_TYPES, generate_moving_shapes

    a = generate_moving_shapes(tmp_path / "a", num_samples=48, seed=3)
    b = generate_moving_shapes(tmp_path / "b", num_samples=48, seed=3)
    c = generate_moving_shapes(tmp_path / "c", num_samples=48, seed=4)
    assert a.read_text() == b.read_text() and a.read_text() != c.read_text()
    assert (a.parent / "videos" / "turn-00002.mp4").read_bytes() == (b.parent / "videos" / "turn-00002.mp4").read_bytes()
    records = json.loads(a.read_text())
    answers = {q: Counter(r["messages"][1]["content"] for r in records if r["id"].startswith(q + "-")) for q in VIDEO_TYPES}
    # balanced types, and balanced answers within each type: the blind baseline is 1/4, 1/2 and 1/4
    assert answers == {"direction": {d: 4 for d in DIRECTIONS}, "motion": {m: 8 for m in MOTIONS}, "turn": {c: 4 for c in COLORS}}
    for r in records:
        q, answer = r["id"].split("-")[0], r["messages"][1]["content"]
        assert r["messages"][0]["content"].startswith("<video>") and r["videos"] == [f"videos/{r['id']}.mp4"]
        frames = _decoded_frames(a.parent / r["videos"][0]).astype(int)
        assert frames.shape == (4, 56, 56, 3)
        if q in ("direction", "motion"):  # the shaded square's pixels are the only ones with little green
            centers = [np.argwhere(f[..., 1] < 140).mean(axis=0) for f in frames]  # (row, column) per frame
            (dy, dx) = centers[-1] - centers[0]
            if q == "motion" and answer == "still":
                assert abs(dx) < 1 and abs(dy) < 1
            else:
                assert max(abs(dx), abs(dy)) > 4
                seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
                assert q == "motion" or seen == answer
        else:  # the object's color in the last frame is the answer, in the first frame another one
            def color(f):
                painted = (f.max(-1) - f.min(-1)) > 100
                mean = f[painted].mean(axis=0)
                return min(COLORS, key=lambda name: np.abs(np.array(COLORS[name]) - mean).sum())
            assert color(frames[-1]) == answer and color(frames[0]) != answer


def test_long_generated_clips_keep_the_square_inside_and_moving_one_way(tmp_path):
    """A clip longer than a size/28-px-per-frame path allows (56 px, 48 frames: 2 px x 47 frames > the 38 px free)
    spreads the free span over the clip instead of failing, and the square still moves only the answer's way."""
    pytest.importorskip("av")
    import numpy as np

    from vlmctl.data.synthetic_video import DIRECTIONS, _track, generate_moving_shapes

    for answer, (ux, uy) in DIRECTIONS.items():
        track = _track(random.Random(0), 56, 18, (2 * ux, 2 * uy), 48)
        xs, ys = np.array(track).T
        assert xs.min() >= 0 and ys.min() >= 0 and xs.max() + 18 <= 56 and ys.max() + 18 <= 56
        steps = np.diff(xs) * ux + np.diff(ys) * uy  # along the direction: never back, at most 2 px a frame
        assert steps.min() >= 0 and steps.max() <= 2 and steps.sum() == 38
        assert (np.diff(xs) * uy == 0).all() and (np.diff(ys) * ux == 0).all()  # nothing across it
    path = generate_moving_shapes(tmp_path, num_samples=3, seed=1, frames=48)
    first = json.loads(path.read_text())[0]
    assert first["id"].startswith("direction-")
    assert _decoded_frames(tmp_path / first["videos"][0]).shape == (48, 56, 56, 3)


def test_generated_tones_are_deterministic_balanced_and_answerable(tmp_path):
    sf = pytest.importorskip("soundfile")
    import numpy as np

    from vlmctl.data.synthetic_audio import BEEP_COUNTS, GLIDES, PITCH_BANDS, QUESTION_TYPES as AUDIO_TYPES, generate_tones

    a = generate_tones(tmp_path / "a", num_samples=36, seed=3)
    b = generate_tones(tmp_path / "b", num_samples=36, seed=3)
    c = generate_tones(tmp_path / "c", num_samples=36, seed=4)
    assert a.read_text() == b.read_text() and a.read_text() != c.read_text()
    assert (a.parent / "audio" / "glide-00002.wav").read_bytes() == (b.parent / "audio" / "glide-00002.wav").read_bytes()
    records = json.loads(a.read_text())
    answers = {q: Counter(r["messages"][1]["content"] for r in records if r["id"].startswith(q + "-")) for q in AUDIO_TYPES}
    assert answers == {"beeps": {n: 3 for n in BEEP_COUNTS}, "pitch": {p: 4 for p in PITCH_BANDS}, "glide": {g: 4 for g in GLIDES}}
    questions = {q: {r["messages"][0]["content"] for r in records if r["id"].startswith(q + "-")} for q in AUDIO_TYPES}
    assert all(len(v) == 1 for v in questions.values())  # one wording per type: the text says nothing about the answer
    assert {Path(r["audios"][0]).suffix for r in records} == {".wav", ".flac"}

    def pitch(wave, rate):  # Hz of the strongest FFT bin
        spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
        return float(np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()])

    for r in records:
        q, answer = r["id"].split("-")[0], r["messages"][1]["content"]
        wave, rate = sf.read(a.parent / r["audios"][0], dtype="float32")
        assert rate == 16_000 and wave.ndim == 1 and len(wave) == 16_000
        loud = np.abs(wave).reshape(-1, 80).max(axis=1) > 0.1  # 5 ms blocks above the noise floor
        if q == "beeps":
            onsets = int(loud[0]) + int((loud[1:] & ~loud[:-1]).sum())
            assert onsets == int(answer)
        elif q == "pitch":
            low, high = PITCH_BANDS[answer]
            assert low * 0.95 <= pitch(wave, rate) <= high * 1.05
        else:
            blocks = np.flatnonzero(loud)
            start, end = blocks[0] * 80, (blocks[-1] + 1) * 80
            quarter = (end - start) // 4
            first, last = pitch(wave[start:start + quarter], rate), pitch(wave[end - quarter:end], rate)
            expected = {"up": last > 1.8 * first, "down": first > 1.8 * last, "level": abs(last / first - 1) < 0.1}
            assert expected[answer], (r["id"], first, last)


@pytest.mark.parametrize("modality", ["video", "audio"])
def test_demo_of_another_modality_reduced_runs_every_stage(modality, tmp_path, capsys):
    pytest.importorskip("av" if modality == "video" else "soundfile")
    folder = tmp_path / modality
    args = ["demo", str(folder), "--modality", modality, "--num-samples", "60", "data.val_ratio=0.3", "train.max_steps=3",
            "train.save_steps=3", "train.logging_steps=1"]
    code, out, err = run(args, capsys)
    assert code == 0, err + out
    assert f"✓ init: generate the {modality} clips (" in out and "✓ eval on the val split (" in out
    summary = json.loads((folder / "outputs" / "demo_summary.json").read_text())
    assert summary["modality"] == modality and list(summary["stage_seconds"]) == ["init", "prepare", "build", "train", "eval"]
    assert summary["steps"] == 3 and summary["train_samples"] + summary["val_samples"] == 60
    types = {"video": {"direction", "motion", "turn"}, "audio": {"beeps", "pitch", "glide"}}[modality]
    assert {s["qtype"] for s in summary["scores"]} == types  # every type has val samples at this split
    assert sum(s["n"] for s in summary["scores"]) == summary["val_samples"]

    config = (folder / "vlmctl.yaml").read_text()
    preset = {"video": "tiny-qwen2.5-vl", "audio": "tiny-qwen2-audio"}[modality]
    assert f"name: {modality}\n" in config and f"preset: {preset}" in config
    manifest = json.loads((Path(summary["prepared_dir"]) / "manifest.json").read_text())
    media = manifest["videos" if modality == "video" else "audios"]
    assert media["count"] == 60 and manifest["totals"]["rejected_total"] == 0
    if modality == "video":  # 2 of each clip's 4 frames sampled: one temporal patch of the video encoder
        assert (media["frames"]["min"], media["frames"]["max"], media["width"]["max"]) == (2, 2, 56)
    else:  # 1 s clips; the FLAC half is stored as it is, the WAV half converted
        assert (media["seconds"]["min"], media["seconds"]["max"], media["kept_as_is"]) == (1.0, 1.0, 30)
    run_dir, eval_dir = Path(summary["run_dir"]), Path(summary["eval_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["visual_tokens"] > 0 for r in rows)  # the clips were encoded
    predictions = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == summary["val_samples"]
    for s in summary["scores"]:  # the per-type accuracies are the exact matches in predictions.jsonl
        mine = [r for r in predictions if r["id"].startswith(s["qtype"] + "-")]
        assert s["accuracy"] == pytest.approx(sum(r["prediction"].strip().lower() == r["references"][0] for r in mine) / len(mine))

    # a second run in the same folder needs --force
    code, _, err = run(["demo", str(folder), "--modality", modality, "train.max_steps=1"], capsys)
    assert code == 2 and "--force" in err


def test_demo_refuses_an_unknown_modality_before_writing(tmp_path, capsys):
    code, _, err = run(["demo", str(tmp_path / "d"), "--modality", "smell"], capsys)
    assert code == 2 and "no demo for modality 'smell'" in err and "image, video, audio" in err
    assert not (tmp_path / "d").exists()


def test_perceiver_demo_trains_the_language_model_over_a_fixed_region_seeded_connector(tmp_path):
    """`model.projector=perceiver` (region-seeded by default) trains with the vision tower and the connector frozen,
    unless train.freeze is set or the resampler starts random; the template's feature layer is dropped."""
    from vlmctl.config import load_config
    from vlmctl.demo import _fit_connector
    from vlmctl.project import init_project

    init_project(tmp_path / "d", template="tiny", num_samples=20)
    config = tmp_path / "d" / "vlmctl.yaml"
    cfg = _fit_connector(load_config(config, ["model.projector=perceiver"]))
    assert cfg.train.freeze == ["vision", "projector"] and "vision_feature_layer" not in cfg.model.model_fields_set
    assert _fit_connector(load_config(config, ["model.projector=perceiver", "train.freeze=[vision]"])).train.freeze == ["vision"]
    assert _fit_connector(load_config(config, ["model.projector=perceiver", "model.perceiver_init=random"])).train.freeze is None
    assert _fit_connector(load_config(config, ["model.projector=pixel_shuffle"])).train.freeze is None
    assert _fit_connector(load_config(config, [])).train.freeze is None


def test_demo_verdict_points_a_jointly_trained_perceiver_at_its_frozen_recipe():
    from vlmctl.cli.demo import _verdict
    from vlmctl.demo import DemoResult, TypeScore

    def result(projector, frozen, position):
        scores = [TypeScore("color", 10, 1.0, 0.2, "red"), TypeScore("position", 10, position, 0.5, "left")]
        return DemoResult(folder=Path("d"), launcher="torchrun", nproc=2, strategy="fsdp", scores=scores, overall=0.8,
                          baseline_overall=0.35, projector=projector, frozen=frozen)

    assert "above the blind baseline on every question type" in _verdict(result("perceiver", ["vision", "projector"], 1.0), 2.3)
    joint = _verdict(result("perceiver", [], 0.4), 2.3)
    assert "perceiver trained with the encoder" in joint and "train.freeze unset" in joint and "max_steps" not in joint
    assert "train longer" in _verdict(result("perceiver", ["vision", "projector"], 0.4), 2.3)
    assert "train longer" in _verdict(result("mlp2x_gelu", [], 0.4), 2.3)


# ---------------------------------------------------------------------------------------------------------------------
# `vlmctl demo --objective dpo|grpo`: a briefly fine-tuned start, post-trained, measured before and after
# ---------------------------------------------------------------------------------------------------------------------


def _shapes_records():
    return [{"id": f"{q}-{i:05d}", "image": f"images/{q}-{i:05d}.png",
             "conversations": [{"from": "human", "value": f"<image>\nq {i}"}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate([("position", "left"), ("position", "right"), ("color", "red"), ("color", "blue"),
                                        ("color", "green"), ("count", "2"), ("shape", "circle")])]


def test_preference_pairs_reject_a_wrong_answer_of_the_same_type():
    from vlmctl.demo_post import build_pairs

    records = _shapes_records()
    pairs, predicted = build_pairs(records, exclude={"color-00004"}, seed=1)
    by_id = {p["id"]: p for p in pairs}
    # count and shape have one answer left in the records: no wrong answer of their type, no pair; the val id is out
    assert set(by_id) == {"position-00000", "position-00001", "color-00002", "color-00003"} and predicted == 0
    assert by_id["position-00000"]["rejected"] == {"from": "gpt", "value": "right"}
    assert by_id["color-00002"]["rejected"]["value"] == "blue"  # green is in the val split only
    for p in pairs:
        r = next(r for r in records if r["id"] == p["id"])
        assert p["chosen"] == r["conversations"][1] and p["conversations"] == [r["conversations"][0]] and p["images"] == [r["image"]]
    # the model's own wrong predictions are the rejected answers where given; right or empty ones are not
    pairs, predicted = build_pairs(records, predictions={"position-00000": "right", "color-00002": "Red ", "color-00003": "",
                                                         "count-00005": "3"})
    by_id = {p["id"]: p for p in pairs}
    assert predicted == 2 and by_id["count-00005"]["rejected"]["value"] == "3"
    assert by_id["color-00002"]["rejected"]["value"] in {"blue", "green"} and by_id["color-00003"]["rejected"]["value"] != "blue"
    # the pairs are read back as preference samples (LLaMA-Factory's ranking layout)
    from vlmctl.data.formats.preference import layout_of

    assert {layout_of(p) for p in pairs} == {"llamafactory"}


def test_post_demo_overrides_train_from_the_sft_runs_final_model(tmp_path):
    from vlmctl.config import load_config
    from vlmctl.demo_post import POST_OVERRIDES, post_overrides
    from vlmctl.project import init_project
    from vlmctl.train.setup import model_source

    init_project(tmp_path / "d", template="tiny", num_samples=20)
    run = tmp_path / "d" / "outputs" / "runs" / "d-full-1"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    cfg = load_config(tmp_path / "d" / "vlmctl.yaml", post_overrides("dpo", run, "d"))
    assert model_source(cfg) == str(run / "final") and cfg.train.objective == "dpo" and cfg.train.packing
    assert cfg.data.kind == "preference" and cfg.data.sources[0].format == "preference" and cfg.data.val_ratio == 0
    assert cfg.train.run_name == "d-dpo"
    cfg = load_config(tmp_path / "d" / "vlmctl.yaml", post_overrides("grpo", run, "d"))
    assert cfg.train.objective == "grpo" and [r.name for r in cfg.train.grpo.rewards] == ["exact_match"]
    assert cfg.data.prepared_dir == load_config(tmp_path / "d" / "vlmctl.yaml").data.prepared_dir  # the SFT prompts
    assert set(POST_OVERRIDES) == {"dpo", "grpo"}


def test_dpo_demo_reduced_runs_both_stages_and_shows_before_and_after(tmp_path, capsys):
    folder = tmp_path / "dpo"
    args = ["demo", str(folder), "--objective", "dpo", "--num-samples", "120", "--sft-steps", "4", "train.max_steps=3",
            "train.save_steps=3", "train.logging_steps=1"]
    code, out, err = run(args, capsys)
    assert code == 0, err + out
    summary = json.loads((folder / "outputs" / "demo_post_summary.json").read_text())
    before = summary["before"]
    assert list(before["stage_seconds"]) == ["init", "prepare", "build", "train", "eval"] and before["steps"] == 4
    assert list(summary["stage_seconds"]) == ["pairs", "prepare", "train", "eval"] and summary["steps"] == 3
    assert summary["total_seconds"] == pytest.approx(sum(before["stage_seconds"].values()) + sum(summary["stage_seconds"].values()))
    # one pair per train sample of a type with two answers or more; the dpo run trained from the SFT run's final model
    pairs = json.loads((folder / "data" / "pairs" / "shapes_pairs.json").read_text())
    val_ids = {json.loads(line)["id"] for line in (Path(before["eval_dir"]) / "predictions.jsonl").read_text().splitlines()}
    assert summary["pairs"] == len(pairs) > 0 and not val_ids & {p["id"] for p in pairs}
    assert all(p["chosen"]["value"] != p["rejected"]["value"] for p in pairs)
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "final" / "model.safetensors").is_file() and run_dir != Path(before["run_dir"])
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["objective"] == "dpo" and config["model"]["output_dir"].endswith(str(Path(before["run_dir"]).name) + "/final")
    assert "rewards/margins" in summary["metrics"]
    # before and after are scored on the same val samples, the after column from the dpo model's predictions
    rows = [json.loads(line) for line in (Path(summary["eval_dir"]) / "predictions.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rows} == val_ids
    assert [(s["qtype"], s["n"]) for s in summary["scores"]] == [(s["qtype"], s["n"]) for s in before["scores"]]
    hits = sum(r["prediction"].strip().lower() == r["references"][0] for r in rows)
    assert summary["overall"] == pytest.approx(hits / len(rows))
    assert summary["gain"] == pytest.approx(summary["overall"] - before["overall"])
    for text in ("SFT start", "after DPO", "blind baseline", "preference pairs", "points"):
        assert text in out, text


def test_post_demo_refuses_what_it_cannot_run_before_writing(tmp_path, capsys):
    code, _, err = run(["demo", str(tmp_path / "d"), "--objective", "ppo"], capsys)
    assert code == 2 and "no demo for objective 'ppo'" in err
    code, _, err = run(["demo", str(tmp_path / "d"), "--objective", "dpo", "--modality", "audio"], capsys)
    assert code == 2 and "post-trains the image demo" in err
    code, _, err = run(["demo", str(tmp_path / "d"), "--sft-steps", "5"], capsys)
    assert code == 2 and "--sft-steps" in err
    assert not (tmp_path / "d").exists()


def test_grpo_demo_reduced_trains_with_the_exact_match_reward(tmp_path, capsys):
    import vlmctl.train.grpo as grpo

    if not hasattr(grpo, "build_grpo_objective"):
        pytest.skip("the grpo objective has no training loop in this build")
    folder = tmp_path / "grpo"
    args = ["demo", str(folder), "--objective", "grpo", "--num-samples", "80", "--sft-steps", "2", "train.max_steps=2",
            "train.save_steps=2", "train.logging_steps=1", "train.micro_batch_size=2", "train.grpo.group_size=2"]
    code, out, err = run(args, capsys)
    assert code == 0, err + out
    summary = json.loads((folder / "outputs" / "demo_post_summary.json").read_text())
    assert list(summary["stage_seconds"]) == ["train", "eval"] and summary["steps"] == 2 and summary["pairs"] == 0
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/exact_match/mean" in r for r in rows)
    assert summary["gain"] == pytest.approx(summary["overall"] - summary["before"]["overall"])
    assert "after GRPO" in out and "SFT start" in out
