"""A LLaMA-Factory dataset_info.json comes with a downloaded data set: the files and globs it names, its symlinks and
its malformed entries must not make `vlmctl data` read anything outside the data set's folder (and the configured
roots), nor widen the folders media paths may point into."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from cli_runner import run_cli
from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats import iter_unchecked, read_source
from vlmctl.data.formats.llamafactory import EntryError
from vlmctl.data.sample import Sample

SECRET = "the secret answer kept outside the data set"
COLUMNS = {"messages": "messages", "images": "images"}


def png(rgb=(200, 30, 30), size=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def record(answer: str = "Red.", image: str = "pic.png") -> dict:
    return {"messages": [{"from": "human", "value": "<image>What color?"}, {"from": "gpt", "value": answer}], "images": [image]}


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(the downloaded data set's folder, a folder beside it holding the user's own files)."""
    data, private = tmp_path / "download", tmp_path / "private"
    data.mkdir()
    private.mkdir()
    (data / "pic.png").write_bytes(png())
    (data / "train.json").write_text(json.dumps([record()]))
    (private / "secret.json").write_text(json.dumps([record(SECRET)]))
    (private / "secret.png").write_bytes(png((1, 2, 3)))
    return data, private


def info(data: Path, **entries) -> str:
    (data / "dataset_info.json").write_text(json.dumps(entries))
    return str(data / "dataset_info.json")


def read(path: str, dataset: str, media_roots=(), **source) -> list:
    return list(iter_unchecked(DataSource(path=path, dataset=dataset, format="llamafactory", **source), media_roots=media_roots))


def refused(path: str, dataset: str, reason: str, **kwargs) -> EntryError:
    with pytest.raises(EntryError) as caught:
        read(path, dataset, **kwargs)
    assert caught.value.reason == reason and reason in caught.value.message and dataset in caught.value.message
    assert SECRET not in caught.value.message
    return caught.value


def test_a_plain_entry_still_reads(layout):
    data, _ = layout
    (sample,) = read(info(data, demo={"file_name": "train.json", "columns": COLUMNS}), "demo")
    assert isinstance(sample, Sample) and isinstance(sample.images[0], Path)


@pytest.mark.parametrize("file_name", ["ABS", "../private/secret.json", "sub/../../private/secret.json",
                                       "./../private"])
def test_a_file_name_outside_the_folder_is_refused(layout, file_name):
    data, private = layout
    name = str(private / "secret.json") if file_name == "ABS" else file_name
    path = info(data, evil={"file_name": name, "columns": COLUMNS})
    refused(path, "evil", "outside_root")


def test_a_file_name_outside_is_read_once_its_folder_is_a_configured_root(layout):
    data, private = layout
    path = info(data, theirs={"file_name": "../private/secret.json", "columns": COLUMNS})
    (sample,) = read(path, "theirs", media_roots=[private])
    assert sample.messages[-1]["content"][0]["text"] == SECRET


def test_a_relative_dataset_info_with_a_home_file_name_reads_nothing_from_home(layout, monkeypatch, tmp_path):
    data, private = layout
    monkeypatch.setenv("HOME", str(private))
    monkeypatch.chdir(data)
    info(data, home={"file_name": "~/secret.json", "columns": COLUMNS})
    refused("dataset_info.json", "home", "missing_file")  # the folder's own "~" entry, not $HOME


@pytest.mark.parametrize("pattern", ["*.json", "../private/*.json", "ABS/**/*.json", "[st]rain.json"])
def test_a_glob_in_file_name_is_refused(layout, pattern):
    data, private = layout
    name = pattern.replace("ABS", str(private.parent))
    refused(info(data, globbed={"file_name": name}), "globbed", "glob")


def test_a_symlink_in_the_folder_to_a_file_outside_is_refused(layout):
    data, private = layout
    (data / "link.json").symlink_to(private / "secret.json")
    refused(info(data, linked={"file_name": "link.json"}), "linked", "outside_root")
    (data / "folder").mkdir()
    (data / "folder" / "part-0.json").write_text(json.dumps([record()]))
    (data / "folder" / "part-1.json").symlink_to(private / "secret.json")
    error = refused(info(data, split={"file_name": "folder"}), "split", "outside_root")
    assert "part-1.json" in error.message
    (data / "escape").symlink_to(private, target_is_directory=True)
    refused(info(data, hop={"file_name": "escape/secret.json"}), "hop", "outside_root")


def test_media_paths_stay_inside_the_folder(layout):
    data, private = layout
    rows = [record(image="../private/secret.png"), record(image=str(private / "secret.png"))]
    (data / "media.json").write_text(json.dumps(rows))
    items = read(info(data, media={"file_name": "media.json", "columns": COLUMNS}), "media")
    assert [getattr(getattr(s, "images", [None])[0], "reason", None) for s in items] == ["outside_root", "outside_root"]
    checked = list(read_source(DataSource(path=str(data / "dataset_info.json"), dataset="media", format="llamafactory")))
    assert all(isinstance(r, Rejection) and r.reason == "outside_root" for r in checked)


def test_a_folder_whose_name_holds_glob_characters_is_read_and_widens_nothing(tmp_path):
    """The data set's own folder named like a pattern: read as a name, and the media roots stay that folder
    (a pattern's fixed part would be its parent)."""
    data = tmp_path / "set[1]*"
    data.mkdir()
    (data / "pic.png").write_bytes(png())
    (tmp_path / "beside.png").write_bytes(png((9, 9, 9)))
    (data / "train[a].json").write_text(json.dumps([record(), record(image="../beside.png")]))
    first, second = read(info(data, demo={"file_name": "train[a].json", "columns": COLUMNS}), "demo")
    assert isinstance(first.images[0], Path) and first.images[0].parent == Path(os.path.realpath(data))
    assert second.images[0].reason == "outside_root"


@pytest.mark.parametrize("entry, words", [
    (["train.json"], "list, not an object"),
    ({"file_name": 42}, "file_name is int"),
    ({"file_name": ["train.json"]}, "file_name is list"),
    ({"file_name": "train.json", "formatting": ["sharegpt"]}, "formatting is ['sharegpt']"),
    ({"file_name": "train.json", "columns": ["messages"]}, "columns is list"),
    ({"file_name": "train.json", "columns": {"messages": ["messages"]}}, "columns.messages is list"),
    ({"file_name": "train.json", "tags": "from"}, "tags is str"),
    ({"file_name": "train.json", "tags": {"role_tag": None}}, "tags.role_tag is NoneType"),
    ({"file_name": "train.json", "ranking": "yes"}, "ranking is 'yes'"),
])
def test_a_malformed_entry_gets_a_reason_coded_error(layout, entry, words):
    data, _ = layout
    error = refused(info(data, broken=entry), "broken", "bad_entry")
    assert words in error.message


def test_an_unreadable_dataset_info_is_a_data_error(layout):
    from vlmctl.errors import DataError

    data, _ = layout
    (data / "dataset_info.json").write_bytes(b'{"x": "\xff\xfe"}')
    with pytest.raises(DataError, match="cannot read"):
        read(str(data / "dataset_info.json"), "x")
    (data / "dataset_info.json").write_text("[" * 100_000)
    with pytest.raises(DataError, match="cannot read"):
        read(str(data / "dataset_info.json"), "x")


def test_data_validate_and_prepare_refuse_the_entry_and_write_nothing(layout, capsys, monkeypatch):
    data, private = layout
    project = data.parent
    info(data, evil={"file_name": str(private / "secret.json"), "columns": COLUMNS})
    (project / "vlmctl.yaml").write_text("project: {name: p}\ndata:\n  sources:\n"
                                         "    - {path: download/dataset_info.json, dataset: evil}\n  num_proc: 1\n")
    monkeypatch.chdir(project)
    for command in (["data", "validate"], ["data", "prepare"]):
        code, out, err = run_cli(command, capsys)
        assert code != 0 and "outside_root" in " ".join((out + err).split()), out + err
        assert SECRET not in out + err
    prepared = project / "data" / "prepared"
    assert not any(SECRET.encode() in f.read_bytes() for f in prepared.rglob("*") if f.is_file()) if prepared.exists() else True
