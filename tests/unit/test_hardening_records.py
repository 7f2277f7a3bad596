"""One bad record costs its sample only, with a reason code that counts toward data.min_kept_fraction: link or
repeated WebDataset members, null images, NUL bytes and lone surrogates, NaN audio, FLAC without a length, broken
save_to_disk folders, FIFOs."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmctl.config.data import DataAudio, DataSection, DataSource
from vlmctl.data.modalities.audio import AudioError, _flac_audio_offset, normalize_audio
from vlmctl.data.prepare import prepare_data
from vlmctl.errors import DataError


def png(size=(40, 32), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def prepare(tmp_path: Path, *sources: DataSource, **settings):
    data = DataSection(sources=list(sources), prepared_dir=tmp_path / "prepared", val_ratio=0.0, **settings)
    return prepare_data(data, num_proc=1, progress=False)


def rejected(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]


@pytest.fixture
def no_hang():
    """Fail instead of blocking forever (a FIFO opened for reading waits for a writer)."""
    def alarm(*_):
        raise TimeoutError("blocked reading a FIFO")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------ WebDataset


def add(tar: tarfile.TarFile, name: str, data: bytes | None = None, *, link: str | None = None, hard: bool = False) -> None:
    info = tarfile.TarInfo(name)
    if link is not None:
        info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
        info.linkname = link
        tar.addfile(info)
        return
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def qa(i: int) -> bytes:
    return json.dumps({"question": f"<image>\nWhat is {i}?", "answer": f"{i}"}).encode()


def test_link_members_and_repeated_keys_are_rejected_not_made_text_only(tmp_path):
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(6):
            add(tar, f"ok{i}.png", png(color=(i * 30, 0, 0)))
            add(tar, f"ok{i}.json", qa(i))
        add(tar, "sym.png", link="ok0.png")
        add(tar, "sym.json", qa(100))
        add(tar, "hard.png", link="ok1.png", hard=True)  # GNU tar's second path of a hard-linked file
        add(tar, "hard.json", qa(101))
        add(tar, "dup.png", png(color=(0, 90, 0)))
        add(tar, "dup.json", qa(102))
        add(tar, "dup.png", png(color=(0, 0, 90)))  # the same key and extension again
    result = prepare(tmp_path, DataSource(path=str(path), format="webdataset"))
    assert result.kept == 6
    reasons = {r["id"]: r["reason"] for r in rejected(tmp_path)}
    assert reasons == {"sym": "link_member", "hard": "link_member", "dup": "duplicate_key"}
    details = {r["id"]: r["detail"] for r in rejected(tmp_path)}
    assert "symbolic link to ok0.png" in details["sym"] and "hard link to ok1.png" in details["hard"]


def test_link_members_count_toward_min_kept_fraction(tmp_path):
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w") as tar:
        add(tar, "a.png", png())
        add(tar, "a.json", qa(0))
        for i in range(3):
            add(tar, f"l{i}.png", link="a.png", hard=True)
            add(tar, f"l{i}.json", qa(i + 1))
    with pytest.raises(DataError) as err:
        prepare(tmp_path, DataSource(path=str(path), format="webdataset"))
    assert "link_member 3" in err.value.message


# ------------------------------------------------------------------------------------------------ Parquet, save_to_disk


def test_parquet_null_image_is_missing_image(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "question": f"Q{i}?", "answer": "a", "image": {"bytes": png(color=(i * 40, 9, 9)), "path": None}} for i in range(4)]
    rows.append({"id": "null", "question": "What is shown?", "answer": "a", "image": None})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    result = prepare(tmp_path, DataSource(path=str(tmp_path / "d.parquet"), format="parquet",
                                          columns={"images": "image", "question": "question", "answer": "answer", "id": "id"}))
    assert result.kept == 4 and result.rejected == {"missing_image": 1}
    (row,) = rejected(tmp_path)
    assert row["id"] == "null" and "null" in row["detail"]


def test_parquet_null_image_list_is_a_text_only_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "question": f"Q{i}?", "answer": "a", "images": [{"bytes": png(color=(i * 40, 9, 9)), "path": None}]} for i in range(3)]
    rows.append({"id": "text", "question": "Say hi.", "answer": "hi", "images": None})  # a list column: null is no images
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    result = prepare(tmp_path, DataSource(path=str(tmp_path / "d.parquet"), format="parquet",
                                          columns={"images": "images", "question": "question", "answer": "answer", "id": "id"}))
    assert result.kept == 4 and not result.rejected


def save_to_disk_folder(root: Path, *, dataset_dict: str | None, split: str = "train") -> Path:
    import pyarrow as pa

    (root / split).mkdir(parents=True)
    table = pa.Table.from_pylist([{"messages": json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])}])
    with pa.OSFile(str(root / split / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (root / split / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    if dataset_dict is not None:
        (root / "dataset_dict.json").write_text(dataset_dict)
    return root


@pytest.mark.parametrize("dataset_dict, split, fragment", [
    ('{"splits": ["train"]}', "test", "without split 'test'"),
    ('{"splits": ', "train", "dataset_dict.json is not valid JSON"),
    ('["train"]', "train", "must hold a JSON object"),
    ('{"splits": "train"}', "train", "`splits` must be a list"),
])
def test_broken_save_to_disk_folders_are_one_clear_error(tmp_path, dataset_dict, split, fragment):
    root = save_to_disk_folder(tmp_path / "ds", dataset_dict=dataset_dict)
    with pytest.raises(DataError) as err:
        prepare(tmp_path, DataSource(path=str(root), format="parquet", split=split))
    assert fragment in err.value.message


def test_save_to_disk_with_a_missing_split_folder_or_state(tmp_path):
    root = save_to_disk_folder(tmp_path / "ds", dataset_dict='{"splits": ["train", "test"]}')
    with pytest.raises(DataError, match=r"test/state.json is missing"):
        prepare(tmp_path, DataSource(path=str(root), format="parquet", split="test"))
    (root / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../etc/passwd"}]}))
    with pytest.raises(DataError, match="not a file name inside"):
        prepare(tmp_path, DataSource(path=str(root), format="parquet", split="train"))


def test_a_fifo_among_the_data_files_is_refused_not_read(tmp_path, no_hang):
    root = save_to_disk_folder(tmp_path / "ds", dataset_dict=None)
    (root / "train" / "data-00000-of-00001.arrow").unlink()
    os.mkfifo(root / "train" / "data-00000-of-00001.arrow")
    with pytest.raises(DataError, match="not a regular file"):
        prepare(tmp_path, DataSource(path=str(root / "train"), format="parquet"))
    folder = tmp_path / "jsons"
    folder.mkdir()
    os.mkfifo(folder / "a.json")
    (folder / "b.json").write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    result = prepare(tmp_path, DataSource(path=str(folder)))  # format auto: the FIFO is neither sniffed nor read
    assert result.kept == 1


# ------------------------------------------------------------------------------------------------ text and paths


def test_nul_bytes_and_lone_surrogates_cost_one_record_each(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.png").write_bytes(png())
    good = [{"id": f"g{i}", "image": "a.png", "conversations": [{"from": "human", "value": f"<image>\nq{i}"}, {"from": "gpt", "value": "a"}]} for i in range(5)]
    bad = [
        {"id": "nul", "image": "a.png\u0000.jpg", "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]},
        {"id": "surrogate-path", "image": "\ud800.png", "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]},
        {"id": "surrogate-text", "conversations": [{"from": "human", "value": "bad \ud83d text"}, {"from": "gpt", "value": "a"}]},
        {"id": "surrogate-\udfff", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    # json.dumps writes the lone surrogates as \uXXXX escapes, which json.loads turns back into them
    (raw / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    result = prepare(tmp_path, DataSource(path=str(raw / "data.jsonl"), format="llava"), dedup=False)
    assert result.kept == 5
    reasons = sorted(r["reason"] for r in rejected(tmp_path))
    assert reasons == ["invalid_text", "invalid_text", "missing_image", "missing_image"]
    details = " ".join(r["detail"] for r in rejected(tmp_path))
    assert "NUL byte" in details and "lone surrogate" in details


# ------------------------------------------------------------------------------------------------ audio


def wav_float(samples: np.ndarray, rate: int = 16000) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def flac_without_length(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A FLAC whose STREAMINFO total-samples field is 0 ("unknown"), as streaming encoders write it."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
    data = bytearray(buf.getvalue())
    data[21] &= 0xF0
    data[22:26] = b"\0\0\0\0"
    return bytes(data)


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    return (0.3 * np.sin(np.arange(int(seconds * rate)) / 7)).astype(np.float32)


def test_a_nan_sample_is_corrupt_audio(tmp_path):
    wave = tone(1.0)
    wave[123] = np.nan
    with pytest.raises(AudioError) as err:
        normalize_audio(wav_float(wave))
    assert err.value.reason == "corrupt_audio" and "NaN" in err.value.detail


def test_flac_of_unknown_length_is_measured_by_decoding():
    out = normalize_audio(flac_without_length(tone(1.0)))
    assert out.seconds == pytest.approx(1.0)
    import soundfile as sf

    assert sf.info(io.BytesIO(out.data)).frames == 16000  # stored with its real length
    with pytest.raises(AudioError) as err:
        normalize_audio(flac_without_length(tone(3.0)), DataAudio(max_seconds=2))
    assert err.value.reason == "audio_too_long"


def test_flac_with_no_samples_is_audio_too_short():
    data = flac_without_length(tone(1.0))
    empty = data[:_flac_audio_offset(data)]  # the metadata alone
    with pytest.raises(AudioError) as err:
        normalize_audio(empty)
    assert err.value.reason == "audio_too_short"


# ------------------------------------------------------------------------------------------------ chat templates


def counter_with_template(template: str):
    from vlmctl.data.tokens import TokenCounter, _template_renderer

    counter = TokenCounter.__new__(TokenCounter)  # the parts `render` uses: a folder-less counter with a template
    counter.folder, counter.image_token = None, "<image>"
    counter._apply_template = _template_renderer(template, {})
    return counter


def chat() -> "Sample":
    from vlmctl.data.sample import Sample

    return Sample(id="s", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}], images=[])


def test_a_chat_template_that_loops_for_ever_is_stopped(monkeypatch):
    from vlmctl.data import tokens

    monkeypatch.setattr(tokens, "RENDER_SECONDS", 0.5)
    hang = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # e.g. pytest-timeout's
    with pytest.raises(DataError, match="did not finish rendering one conversation"):
        counter_with_template(hang).render(chat())
    after = signal.getitimer(signal.ITIMER_REAL)[0]
    assert (after == 0) if outer == 0 else (outer - 5 < after <= outer)  # an outer timer is running again


def test_a_chat_template_that_writes_without_end_is_stopped(monkeypatch):
    from vlmctl.data import tokens

    monkeypatch.setattr(tokens, "RENDER_CHARS", 100_000)
    flood = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}"
    with pytest.raises(DataError, match="rendered"):
        counter_with_template(flood).render(chat())


def test_a_normal_chat_template_renders():
    text = counter_with_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'][0]['text'] }}\n{% endfor %}").render(chat())
    assert text == "user: hi\nassistant: yo\n"


# ------------------------------------------------------------------------------------------------ pool workers


def test_prepare_workers_die_with_a_killed_prepare(tmp_path):
    import subprocess
    import sys
    import time

    script = tmp_path / "pool.py"
    script.write_text(
        "import multiprocessing as mp, os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from vlmctl.data.pipeline import _init_worker\n"
        "with ProcessPoolExecutor(1, mp_context=mp.get_context('fork'), initializer=_init_worker, initargs=(None, {}, None, True)) as pool:\n"
        "    print(pool.submit(os.getpid).result(), flush=True)\n"
        "    pool.submit(time.sleep, 60)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(parent.stdout.readline())
        parent.kill()  # kill -9: no cleanup runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{worker}/stat") as f:  # a zombie waiting for its reaper is gone too
                if f.read().split()[2] == "Z":
                    break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the pool worker outlived its killed parent")
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize("turns", [
    [("system", "<image>You see"), ("user", "q"), ("assistant", "a")],
    [("user", "q"), ("assistant", "Here: <image>")],
    [("user", "q"), ("assistant", [{"type": "image"}, {"type": "text", "text": "a"}])],
])
def test_media_outside_user_turns_is_placeholder_mismatch(turns):
    from vlmctl.data.checks import Rejection, build_sample

    out = build_sample(turns, images=[b"img"], id="s", source="src", location="f:1")
    assert isinstance(out, Rejection) and out.reason == "placeholder_mismatch" and "user turns" in out.detail


# ------------------------------------------------------------------------------------------------ duplicate JSON keys


def dup_record(i: int) -> str:
    # the same key twice in one object: json would keep the second image silently
    return ('{"id": "d%d", "image": "a.png", "image": "b.png", "conversations": [{"from": "human", "value": "<image>\\nq"},'
            ' {"from": "gpt", "value": "a"}]}' % i)


@pytest.mark.parametrize("layout", ["jsonl", "array", "array-one-line"])
def test_a_duplicate_json_key_rejects_its_record_only(tmp_path, layout):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.png").write_bytes(png())
    (raw / "b.png").write_bytes(png(color=(0, 0, 200)))
    good = [json.dumps({"id": f"g{i}", "image": "a.png", "conversations": [{"from": "human", "value": f"<image>\nq{i}"}, {"from": "gpt", "value": "a"}]}) for i in range(4)]
    records = good[:2] + [dup_record(0)] + good[2:]
    if layout == "jsonl":
        path = raw / "d.jsonl"
        path.write_text("\n".join(records) + "\n")
    else:
        path = raw / "d.json"
        path.write_text("[" + (",\n" if layout == "array" else ", ").join(records) + "]")
    result = prepare(tmp_path, DataSource(path=str(path), format="llava"), dedup=False)
    assert result.kept == 4 and result.rejected == {"parse_error": 1}
    (row,) = rejected(tmp_path)
    assert "'image' appears twice" in row["detail"]


def test_hf_dataset_null_image_is_missing_image(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "hub-copy"  # a local dataset folder, loaded by `datasets.load_dataset` as a Hub id would be
    folder.mkdir()
    rows = [{"question": f"Q{i}?", "answer": "a", "image": {"bytes": png(color=(i * 40, 9, 9)), "path": None}} for i in range(3)]
    rows.append({"question": "What is shown?", "answer": "a", "image": None})
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    result = prepare(tmp_path, DataSource(path=str(folder), format="hf", columns={"images": "image", "question": "question", "answer": "answer"}))
    assert result.kept == 3 and result.rejected == {"missing_image": 1}


def test_a_data_file_whose_name_is_not_utf8_is_prepared(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    path = raw / os.fsdecode(b"caf\xe9-latin1.jsonl")  # a Latin-1 file name: Python holds the byte as a surrogate escape
    path.write_text("".join(json.dumps({"id": f"x{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}) + "\n"
                            for i in range(3)) + "{broken\n")
    result = prepare(tmp_path, DataSource(path=str(path), format="llava"))
    assert result.kept == 3 and result.rejected == {"parse_error": 1}
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 3
    assert "latin1.jsonl" in rejected(tmp_path)[0]["location"]
