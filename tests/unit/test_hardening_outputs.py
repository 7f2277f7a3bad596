"""No command deletes an input: a folder is replaced only when vlmctl wrote it (its marker) and no input of the run
lies inside it; `-o` onto an existing result refuses without --force, and --force never deletes an input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from cli_runner import run_cli as run
from vlmctl.config.data import DataSection, DataSource
from vlmctl.config.model import ModelSection
from vlmctl.data.prepare import prepare_data
from vlmctl.errors import UsageError
from vlmctl.outputs import MARKER, check_replaceable, fresh_folder, install, marker_kind


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def raw_data(folder: Path, n: int = 6) -> Path:
    """A LLaVA JSON source with `n` PNG images next to it."""
    (folder / "images").mkdir(parents=True)
    records = []
    for i in range(n):
        Image.new("RGB", (40, 32), (20 * i, 100, 30)).save(folder / "images" / f"{i}.png")
        records.append({"id": f"s{i}", "image": f"images/{i}.png",
                        "conversations": [{"from": "human", "value": f"<image>\nWhat is {i}?"}, {"from": "gpt", "value": f"It is {i}."}]})
    path = folder / "data.json"
    path.write_text(json.dumps(records))
    return path


def data_section(src: Path, prepared: Path, **extra) -> DataSection:
    return DataSection(sources=[DataSource(path=str(src), format="llava")], prepared_dir=prepared, val_ratio=0.0, **extra)


def a_project_outputs(root: Path) -> Path:
    """outputs/ holding a built model and a run with a checkpoint, as `model build` and `train` leave it."""
    (root / "outputs" / "model").mkdir(parents=True)
    (root / "outputs" / "model" / "vlmctl_model.json").write_text('{"family": "llava"}')
    ckpt = root / "outputs" / "runs" / "run-1" / "checkpoints" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 10}')
    return root / "outputs"


# ------------------------------------------------------------------------------------------------ data prepare


def test_export_dir_onto_the_source_folder_is_refused_and_deletes_nothing(tmp_path):
    src = raw_data(tmp_path / "data" / "raw")
    before = files_of(tmp_path / "data" / "raw")
    with pytest.raises(UsageError) as err:
        prepare_data(data_section(src, tmp_path / "prepared"), num_proc=1, progress=False, export="energon",
                     export_dir=tmp_path / "data" / "raw")
    assert "an input of this run" in err.value.message and str(tmp_path / "data" / "raw") in err.value.message
    assert files_of(tmp_path / "data" / "raw") == before
    assert not (tmp_path / "prepared").exists()


def test_export_dir_onto_an_unrelated_folder_of_files_is_refused(tmp_path):
    src = raw_data(tmp_path / "raw")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(UsageError, match="files vlmctl did not write"):
        prepare_data(data_section(src, tmp_path / "prepared"), num_proc=1, progress=False, export="energon",
                     export_dir=tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_prepared_dir_onto_outputs_with_the_model_and_runs_is_refused(tmp_path):
    src = raw_data(tmp_path / "raw")
    outputs = a_project_outputs(tmp_path)
    before = files_of(outputs)
    with pytest.raises(UsageError) as err:
        prepare_data(data_section(src, outputs), num_proc=1, progress=False)
    assert str(outputs) in err.value.message and "move the folder away" in err.value.hint
    assert files_of(outputs) == before


def test_prepared_dir_holding_the_image_root_is_refused(tmp_path):
    src = raw_data(tmp_path / "raw")
    images = tmp_path / "prepared" / "images"
    images.mkdir(parents=True)
    data = DataSection(sources=[DataSource(path=str(src), format="llava", image_root=images)], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    with pytest.raises(UsageError, match="holds an input of this run"):
        prepare_data(data, num_proc=1, progress=False)
    assert images.is_dir()


def test_prepared_dir_holding_a_source_is_refused(tmp_path):
    src = raw_data(tmp_path / "prepared" / "raw")
    with pytest.raises(UsageError, match="holds an input of this run"):
        prepare_data(data_section(src, tmp_path / "prepared"), num_proc=1, progress=False)
    assert src.is_file()


def test_prepare_replaces_its_own_earlier_folder_and_one_from_before_markers(tmp_path):
    src = raw_data(tmp_path / "raw")
    data = data_section(src, tmp_path / "prepared")
    prepare_data(data, num_proc=1, progress=False)
    assert marker_kind(tmp_path / "prepared") == "prepared"
    prepare_data(data, num_proc=1, progress=False)  # its own folder: replaced
    (tmp_path / "prepared" / MARKER).unlink()  # a folder written before markers: its manifest.json names it
    prepare_data(data, num_proc=1, progress=False, export="energon", export_dir=tmp_path / "energon")
    assert marker_kind(tmp_path / "prepared") == "prepared" and marker_kind(tmp_path / "energon") == "energon"
    prepare_data(data, num_proc=1, progress=False, export="energon", export_dir=tmp_path / "energon")


def test_prepared_dir_onto_a_built_model_is_refused(tmp_path):
    src = raw_data(tmp_path / "raw")
    model = tmp_path / "model"
    model.mkdir()
    (model / "vlmctl_model.json").write_text("{}")
    install_marker = model / MARKER
    install_marker.write_text(json.dumps({"kind": "model"}))
    with pytest.raises(UsageError, match="a built model"):
        prepare_data(data_section(src, model), num_proc=1, progress=False)
    assert (model / "vlmctl_model.json").is_file()


# ------------------------------------------------------------------------------------------------ convert, build


def test_convert_run_onto_itself_with_force_is_refused(tmp_path):
    from vlmctl.convert import convert

    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train: {}\n")
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights")
    (run_dir / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    before = files_of(run_dir)
    for out in (run_dir, tmp_path):  # the run itself, and a folder that holds it
        with pytest.raises(UsageError, match="an input of this run"):
            convert(run_dir, out, force=True, verify=False)
    assert files_of(run_dir) == before


def test_convert_force_onto_a_foreign_model_folder_is_refused(tmp_path):
    from vlmctl.convert import convert

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    other = tmp_path / "someone-elses-model"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"theirs")
    with pytest.raises(UsageError, match="already exists"):
        convert(src, other, verify=False)
    with pytest.raises(UsageError, match="files vlmctl did not write"):
        convert(src, other, force=True, verify=False)
    assert (other / "model.safetensors").read_bytes() == b"theirs"


def test_model_build_force_refuses_a_folder_holding_the_prepared_data(tmp_path):
    from vlmctl.models.build import build_model

    out = tmp_path / "model"
    prepared = out / "prepared"
    prepared.mkdir(parents=True)
    (prepared / "manifest.json").write_text("{}")
    with pytest.raises(UsageError, match="holds an input of this run"):
        build_model(ModelSection(preset="tiny", init="random", output_dir=out), prepared_dir=prepared, force=True)
    assert (prepared / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ eval -o


def test_eval_output_onto_an_earlier_evaluation_needs_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({"id": str(i), "prediction": "a", "answer": "a" if i % 2 else "b"}) + "\n" for i in range(4)))
    code, _, _ = run(["eval", "--predictions", str(preds), "-o", "ev", "--json"], capsys)
    assert code == 0 and marker_kind(tmp_path / "ev") == "eval"
    first = files_of(tmp_path / "ev")
    code, out, err = run(["eval", "--predictions", str(preds), "-o", "ev", "--task", "vqa"], capsys)
    assert code != 0 and "already exists" in out + err and "--force" in out + err
    assert files_of(tmp_path / "ev") == first
    code, _, _ = run(["eval", "--predictions", str(preds), "-o", "ev", "--force", "--json"], capsys)
    assert code == 0 and (tmp_path / "ev" / "metrics.json").is_file()


def test_eval_output_holding_its_input_is_refused_even_with_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    preds = tmp_path / "work" / "preds.jsonl"
    preds.write_text(json.dumps({"id": "1", "prediction": "a", "answer": "a"}) + "\n")
    code, out, err = run(["eval", "--predictions", str(preds), "-o", "work", "--force"], capsys)
    assert code != 0 and "an input of this run" in out + err
    assert preds.is_file() and sorted(p.name for p in (tmp_path / "work").iterdir()) == ["preds.jsonl"]


# ------------------------------------------------------------------------------------------------ init --force


def test_init_force_keeps_data_of_your_own_in_data_raw(tmp_path, capsys):
    folder = tmp_path / "proj"
    raw = folder / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "mine.json").write_text("[]")
    code, out, err = run(["init", str(folder), "--template", "tiny", "--force"], capsys)
    assert code != 0 and "files vlmctl did not write" in out + err
    assert (raw / "mine.json").read_text() == "[]"


# ------------------------------------------------------------------------------------------------ the shared rules


def test_check_replaceable_rules(tmp_path):
    check_replaceable(tmp_path / "new", "eval")  # absent
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", "eval")  # empty
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        check_replaceable(tmp_path / "file", "eval")
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(UsageError, match="a link"):
        check_replaceable(tmp_path / "link", "eval")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MARKER).write_text(json.dumps({"kind": "eval"}))
    check_replaceable(ours, "eval")
    with pytest.raises(UsageError, match="an evaluation"):
        check_replaceable(ours, "prepared")
    (ours / "sub").mkdir()
    (ours / "sub" / "vlmctl.yaml").write_text("")  # a project someone moved into it
    with pytest.raises(UsageError, match="a vlmctl project"):
        check_replaceable(ours, "eval")


def test_install_and_fresh_folder_keep_the_old_folder_until_success(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    (final / MARKER).write_text(json.dumps({"kind": "eval"}))
    with pytest.raises(RuntimeError):
        with fresh_folder(final, "eval", force=True):
            (final / "partial.txt").write_text("x")
            raise RuntimeError("evaluation failed")
    assert (final / "old.txt").read_text() == "old" and not (final / "partial.txt").exists()
    tmp = tmp_path / ".out.tmp"
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    install(tmp, final, "eval")
    assert sorted(p.name for p in final.iterdir()) == [MARKER, "new.txt"]
    assert not list(tmp_path.glob(".out.*"))


def test_convert_output_inside_the_source_is_refused(tmp_path):
    from vlmctl.convert import convert

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(UsageError, match="inside the source"):
        convert(src, src / "hf", verify=False)
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.safetensors"]
