"""The audio unit and the formats users bring, on real audio files written with soundfile in the test: the stored
16 kHz mono FLAC, one defective file per reason code, the readers (LLaMA-Factory ShareGPT with `audios`, OpenAI
`input_audio` and audio content parts, WebDataset members, Parquet columns, `datasets`' Audio feature) and the
prepared shards and manifest."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import dominant_hz, encode, flac, m4a, tone, wav  # noqa: E402

from vlmctl.config.data import DataAudio, DataSection, DataSource  # noqa: E402
from vlmctl.data.checks import Rejection, build_sample, check_images  # noqa: E402
from vlmctl.data.formats import read_source  # noqa: E402
from vlmctl.data.modalities import get_unit  # noqa: E402
from vlmctl.data.modalities.audio import AudioError, audio_shape, decode_audio, normalize_audio, probe  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402


def _info(data: bytes):
    import soundfile as sf

    return sf.info(io.BytesIO(data))


# ------------------------------------------------------------------------------------------------ stored audio


def test_a_clip_is_stored_as_16_khz_mono_16_bit_flac():
    original = encode(tone(1.5, 44_100, freq=440, channels=2), 44_100, "WAV", "FLOAT")  # 32-bit float stereo
    stored = normalize_audio(original)
    info = _info(stored.data)
    assert (info.format, info.subtype, info.samplerate, info.channels, info.frames) == ("FLAC", "PCM_16", 16_000, 1, 24_000)
    assert (stored.seconds, stored.sampling_rate, stored.channels) == (1.5, 44_100, 2)
    assert stored.conversion == "WAV FLOAT 44100 Hz 2 channels -> FLAC PCM_16 16000 Hz mono"
    wave = decode_audio(stored.data)
    assert wave.dtype == np.float32 and wave.shape == (24_000,)
    # the down-mix is the mean of the channels (amplitudes 0.3 and 0.15), the tone survives the resampling
    assert float(np.abs(wave[1000:-1000]).max()) == pytest.approx(0.225, abs=0.005)
    assert dominant_hz(wave, 16_000) == pytest.approx(440, abs=1)
    # decoded at another rate: resampled again (what training does for a feature extractor of that rate)
    assert decode_audio(stored.data, 8_000).shape == (12_000,) and audio_shape(stored.data) == (24_000, 16_000)


def test_a_stored_flac_is_kept_byte_for_byte_and_encoding_is_deterministic():
    original = wav(1.0, 22_050)
    first, second = normalize_audio(original), normalize_audio(original)
    assert first.data == second.data and first.conversion is not None  # the same samples give the same bytes
    again = normalize_audio(first.data)
    assert again.data == first.data and again.conversion is None
    native = flac(1.0, 16_000)  # already what is stored: kept as it came
    assert normalize_audio(native).data == native
    # another stored rate: converted again
    assert _info(normalize_audio(first.data, DataAudio(sampling_rate=8_000)).data).samplerate == 8_000


def test_other_formats_libsndfile_reads_are_converted():
    for fmt, subtype in [("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III"), ("AIFF", "PCM_24"), ("FLAC", "PCM_24")]:
        stored = normalize_audio(encode(tone(0.5, 48_000, channels=2), 48_000, fmt, subtype))
        assert _info(stored.data).samplerate == 16_000 and stored.conversion.startswith(fmt), fmt
        assert dominant_hz(decode_audio(stored.data), 16_000) == pytest.approx(440, abs=3), fmt


# ------------------------------------------------------------------------------------------------ defects


@pytest.mark.parametrize("name, data, settings, reason, detail", [
    ("truncated wav", lambda: wav(1.0)[:12_000], None, "corrupt_audio", "truncated: the data chunk declares 32,000 bytes, 11,956 are present"),
    ("truncated flac", lambda: flac(2.0, freq=997)[:4_000], None, "corrupt_audio", "does not decode|truncated"),
    ("text named .wav", lambda: b"not audio at all\n" * 4, None, "corrupt_audio", "not a readable audio file"),
    ("empty file", lambda: b"", None, "corrupt_audio", "empty file"),
    ("invalid base64", lambda: base64.b64decode("####", validate=False), None, "corrupt_audio", "empty file"),
    ("m4a", lambda: m4a(), None, "unsupported_audio", "MP4/M4A container"),
    ("no samples", lambda: wav(0.0), None, "audio_too_short", "no samples"),
    ("under min_seconds", lambda: wav(0.05), None, "audio_too_short", r"0\.050 s, under data.audio.min_seconds=0.1"),
    ("over max_seconds", lambda: wav(3.0), DataAudio(max_seconds=2), "audio_too_long", r"3\.00 s, over data.audio.max_seconds=2"),
])
def test_each_defect_gets_its_reason_code(name, data, settings, reason, detail):
    import re

    if name == "m4a":
        pytest.importorskip("av")
    with pytest.raises(AudioError) as err:
        normalize_audio(data(), settings)
    assert err.value.reason == reason and re.search(detail, err.value.detail), (name, err.value.detail)


def test_probe_reads_the_header_only():
    info = probe(wav(2.0, 8_000))
    assert (info.format, info.subtype, info.sampling_rate, info.channels, info.frames, info.seconds) == ("WAV", "PCM_16", 8_000, 1, 16_000, 2.0)


def _write(folder, name, data):
    (folder / name).write_bytes(data)
    return name


def test_check_images_rejects_audio_with_the_reason_and_names_the_file(tmp_path):
    good = _write(tmp_path, "good.wav", wav(0.5))
    _write(tmp_path, "cut.wav", wav(1.0)[:9_000])
    _write(tmp_path, "song.m4a", m4a() if _has_av() else b"\x00\x00\x00\x18ftypM4A \x00\x00\x00\x00")
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "<audio>What is it?"}, {"role": "assistant", "content": "A tone."}], "audios": [good]},
        {"id": "cut", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["cut.wav"]},
        {"id": "m4a", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["song.m4a"]},
        {"id": "gone", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["nowhere.wav"]},
        {"id": "away", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["../outside.wav"]},
        {"id": "two", "messages": [{"role": "user", "content": "<audio><audio>Both?"}, {"role": "assistant", "content": "?"}], "audios": [good]},
        {"id": "short", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": [good]},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = DataSource(path=str(tmp_path / "data.jsonl"), format="sharegpt")
    out = {item.id: item for item in read_source(source, audio=DataAudio(min_seconds=0.1))}
    assert isinstance(out["ok"], Sample) and _info(out["ok"].audios[0]).format == "FLAC"
    reasons = {k: (v.reason, v.detail) for k, v in out.items() if isinstance(v, Rejection)}
    assert reasons["cut"][0] == "corrupt_audio" and "cut.wav" in reasons["cut"][1] and "audio 0" in reasons["cut"][1]
    assert reasons["m4a"][0] == "unsupported_audio" and "song.m4a" in reasons["m4a"][1]
    assert reasons["gone"][0] == "missing_audio" and "nowhere.wav" in reasons["gone"][1]
    assert reasons["away"][0] == "outside_root"
    assert reasons["two"] == ("placeholder_mismatch", "2 <audio> placeholder(s) for 1 audio(s)")
    assert set(reasons) == {"cut", "m4a", "gone", "away", "two"}
    # a longer min_seconds turns the 0.5 s clip away as audio_too_short
    strict = {item.id: item for item in read_source(source, audio=DataAudio(min_seconds=1.0))}
    assert strict["short"].reason == "audio_too_short" and "good.wav" in strict["short"].detail
    assert (tmp_path / good).read_bytes() == wav(0.5)  # the input files are untouched


def _has_av() -> bool:
    import importlib.util

    return importlib.util.find_spec("av") is not None


# ------------------------------------------------------------------------------------------------ formats


def _messages(sample: Sample) -> list[list[tuple]]:
    return [[(p["type"], p.get("index", p.get("text"))) for p in m["content"]] for m in sample.messages]


def test_llamafactory_sharegpt_with_audios_and_images(tmp_path):
    # LLaMA-Factory data/README.md: `audios` next to `images`, `<audio>` / `<image>` placeholders in the text
    from video_data import png_bytes

    clip = _write(tmp_path, "1.wav", wav(0.5, 44_100, channels=2))
    img = _write(tmp_path, "1.png", png_bytes(40))
    record = {"messages": [{"role": "user", "content": "<image>Look and <audio>listen: what is it?"},
                           {"role": "assistant", "content": "A tone and a green square."},
                           {"role": "user", "content": "<audio>And this?"}, {"role": "assistant", "content": "The same tone."}],
              "images": [img], "audios": [clip, clip]}
    conversations = {"conversations": [{"from": "human", "value": "<audio>Transcribe."}, {"from": "gpt", "value": "la"}], "audios": [clip]}
    (tmp_path / "demo.json").write_text(json.dumps([record, conversations]))
    first, second = read_source(DataSource(path=str(tmp_path / "demo.json")))  # format auto: sharegpt
    assert isinstance(first, Sample) and isinstance(second, Sample), (first, second)
    assert _messages(first)[0] == [("image", 0), ("text", "Look and"), ("audio", 0), ("text", "listen: what is it?")]
    assert _messages(first)[2] == [("audio", 1), ("text", "And this?")]
    assert len(first.images) == 1 and len(first.audios) == 2 and first.audios[0] == first.audios[1] == second.audios[0]
    assert _messages(second)[0] == [("audio", 0), ("text", "Transcribe.")]


def test_openai_input_audio_and_audio_content_parts(tmp_path):
    clip = _write(tmp_path, "c.flac", flac(0.5))
    b64 = base64.b64encode(wav(0.5)).decode()
    rows = [
        {"id": "input_audio", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                                                                         {"type": "text", "text": "What is it?"}]},
                                            {"role": "assistant", "content": "A tone."}]},
        {"id": "chat-template", "messages": [{"role": "user", "content": [{"type": "audio", "audio": f"file://{tmp_path / clip}"},
                                                                            {"type": "text", "text": "And?"}]},
                                              {"role": "assistant", "content": [{"type": "text", "text": "Tone."}]}]},
        {"id": "audio_url", "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": clip}}, {"type": "text", "text": "?"}]},
                                          {"role": "assistant", "content": "Tone."}]},
        {"id": "untyped", "messages": [{"role": "user", "content": [{"input_audio": {"data": b64, "format": "wav"}}, {"type": "text", "text": "?"}]},
                                        {"role": "assistant", "content": "Tone."}]},
        {"id": "listed", "audios": [clip], "messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hm?"}]},
                                                         {"role": "assistant", "content": "A tone."}]},
        {"id": "both", "audios": [clip], "messages": [{"role": "user", "content": [{"type": "audio", "path": clip}, {"type": "text", "text": "?"}]},
                                                       {"role": "assistant", "content": "?"}]},
        {"id": "bad-b64", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@@@", "format": "wav"}}]},
                                        {"role": "assistant", "content": "?"}]},
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "m.jsonl"), format="messages"))}
    for sid in ("input_audio", "chat-template", "audio_url", "untyped", "listed"):
        assert isinstance(out[sid], Sample) and _messages(out[sid])[0][0] == ("audio", 0) and len(out[sid].audios) == 1, sid
    assert out["input_audio"].audios == out["untyped"].audios  # the same bytes, the same stored clip
    assert out["chat-template"].audios == out["audio_url"].audios == out["listed"].audios == [flac(0.5)]  # kept as it was
    assert out["both"].reason == "placeholder_mismatch" and "1 audio part(s) and also 1 listed audio(s)" in out["both"].detail
    assert out["bad-b64"].reason == "corrupt_audio"


def test_webdataset_members_and_parquet_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tar = tmp_path / "shard-000.tar"
    members = [("a.flac", flac(0.5)), ("a.json", json.dumps({"messages": [{"role": "user", "content": "<audio>What is it?"},
                                                                            {"role": "assistant", "content": "A tone."}]}).encode()),
               ("b.wav", wav(0.5, 8_000)), ("b.txt", b"a short tone"),  # a transcript sample
               ("c.0.wav", wav(0.3)), ("c.1.wav", wav(0.4)), ("c.json", json.dumps({"question": "<audio><audio>Which is longer?",
                                                                                       "answer": "The second."}).encode())]
    with tarfile.open(tar, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    out = {s.id: s for s in read_source(DataSource(path=str(tar)))}
    assert _messages(out["a"])[0] == [("audio", 0), ("text", "What is it?")]
    assert _messages(out["b"]) == [[("audio", 0)], [("text", "a short tone")]] and audio_shape(out["b"].audios[0]) == (8_000, 16_000)
    assert _messages(out["c"])[0] == [("audio", 0), ("audio", 1), ("text", "Which is longer?")]
    assert [audio_shape(a)[0] for a in out["c"].audios] == [4_800, 6_400]  # in the order of their extensions
    # a VQA table with an audio bytes column, and a speech-recognition table (audio + transcript, no question)
    pq.write_table(pa.Table.from_pylist([{"question": "What is it?", "answer": "A tone.", "audio": {"bytes": wav(0.5), "path": None}}]),
                   tmp_path / "vqa.parquet")
    [s] = list(read_source(DataSource(path=str(tmp_path / "vqa.parquet"))))
    assert _messages(s)[0] == [("audio", 0), ("text", "What is it?")] and audio_shape(s.audios[0]) == (8_000, 16_000)
    pq.write_table(pa.Table.from_pylist([{"audio": wav(0.5), "text": "la la"}]), tmp_path / "asr.parquet")
    [s] = list(read_source(DataSource(path=str(tmp_path / "asr.parquet"), columns={"audios": "audio", "answer": "text"})))
    assert _messages(s) == [[("audio", 0)], [("text", "la la")]] and s.meta["answers"] == ["la la"]


def test_datasets_audio_feature_from_disk_and_through_the_hub_reader(tmp_path):
    datasets = pytest.importorskip("datasets")

    rows = {"audio": [{"bytes": wav(0.5, 22_050), "path": "one.wav"}, {"bytes": flac(0.5), "path": "two.flac"}],
            "question": ["What is it?", "And this?"], "answer": ["A tone.", "Another tone."]}
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio(decode=False))
    ds.save_to_disk(str(tmp_path / "saved"))
    saved = list(read_source(DataSource(path=str(tmp_path / "saved"))))  # format auto: parquet (a save_to_disk folder)
    (tmp_path / "hub").mkdir()
    ds.to_parquet(str(tmp_path / "hub" / "train.parquet"))
    hub = list(read_source(DataSource(path=str(tmp_path / "hub"), format="hf")))  # datasets.load_dataset on a local folder
    for samples in (saved, hub):
        assert [s.id for s in samples] == [f"{'saved' if samples is saved else str(tmp_path / 'hub')}-00000{i}" for i in range(2)]
        assert all(_messages(s)[0][0] == ("audio", 0) for s in samples)
        assert samples[1].audios == [flac(0.5)] and audio_shape(samples[0].audios[0]) == (8_000, 16_000)


# ------------------------------------------------------------------------------------------------ the unit


def test_the_unit_hands_waveforms_at_the_feature_extractor_rate_to_the_processor():
    from types import SimpleNamespace

    stored = normalize_audio(wav(1.0)).data
    unit = get_unit("audio")
    assert unit.processor_kwarg == "audio" and unit.encoder == "audio" and unit.dummy_counter == "num_dummy_audios"
    inputs = unit.processor_inputs([stored, stored])
    assert set(inputs) == {"audio", "sampling_rate"} and inputs["sampling_rate"] == 16_000 and [w.shape for w in inputs["audio"]] == [(16_000,)] * 2
    at_24k = SimpleNamespace(feature_extractor=SimpleNamespace(sampling_rate=24_000))  # a model with another rate
    inputs = unit.processor_inputs([stored], at_24k)
    assert inputs["sampling_rate"] == 24_000 and inputs["audio"][0].shape == (24_000,)
    assert dominant_hz(inputs["audio"][0], 24_000) == pytest.approx(440, abs=1)
    assert unit.dummy_input(at_24k).shape == (2_400,) and not unit.dummy_input(at_24k).any()
    assert unit.owns("input_features") and unit.owns("feature_attention_mask") and not unit.owns("pixel_values")
    s = check_images(Sample("x", [{"role": "user", "content": [{"type": "audio", "index": 0}]}], audios=[stored]))
    assert not isinstance(s, Rejection) and s[1].audios[0].seconds == 1.0 and not s[1].audios[0].converted


def test_an_audio_mask_as_long_as_the_text_goes_to_the_audio_unit():
    import torch

    from vlmctl.data.collate import split_processor_outputs

    # one clip's frame mask [1, frames] has the shape of a per-token tensor when frames == tokens
    out = {"input_ids": torch.zeros(1, 200), "attention_mask": torch.ones(1, 200), "input_features": torch.zeros(1, 32, 200),
           "feature_attention_mask": torch.ones(1, 200, dtype=torch.long)}
    token, media = split_processor_outputs(out)
    assert token == {} and set(media) == {"audio"} and set(media["audio"]) == {"input_features", "feature_attention_mask"}


def test_build_sample_prepends_unplaced_audio_after_images_and_videos():
    s = build_sample([("user", "Describe all of it."), ("assistant", "ok")], images=[b"i"], videos=[b"v"], audios=[b"a", b"b"],
                     id="s", source="s", location="s:1")
    assert _messages(s)[0] == [("image", 0), ("video", 0), ("audio", 0), ("audio", 1), ("text", "Describe all of it.")]


# ------------------------------------------------------------------------------------------------ prepare


def test_prepare_stores_flac_and_one_schema_for_mixed_shards(tmp_path):
    import pyarrow.parquet as pq

    from video_data import png_bytes

    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.prepare import prepare_data

    clip = _write(tmp_path, "c.wav", wav(1.5, 44_100, channels=2))
    native = _write(tmp_path, "n.flac", flac(0.5))
    img = _write(tmp_path, "i.png", png_bytes(40))
    rows = [{"id": f"img{i}", "messages": [{"role": "user", "content": f"<image>Color {i}?"}, {"role": "assistant", "content": "Green."}],
             "images": [img]} for i in range(3)]
    rows += [{"id": f"aud{i}", "messages": [{"role": "user", "content": f"<audio>Sound {i}?"}, {"role": "assistant", "content": "A tone."}],
              "audios": [clip if i else native]} for i in range(2)]
    rows.append({"id": "bad", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["i.png"]})
    rows.append({"id": "long", "messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["c.wav"]})
    rows[-1]["audios"] = [_write(tmp_path, "long.wav", wav(3.0))]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataSection(sources=[DataSource(path=str(tmp_path / "mixed.jsonl"), format="sharegpt")], prepared_dir=tmp_path / "prepared",
                       val_ratio=0, audio=DataAudio(max_seconds=2), num_proc=1)
    result = prepare_data(data, progress=False)
    assert result.kept == 5 and result.rejected == {"corrupt_audio": 1, "audio_too_long": 1}
    audios = result.manifest["audios"]
    assert audios["count"] == 2 and audios["seconds"]["max"] == 1.5 and audios["total_hours"] == pytest.approx(2.0 / 3600, abs=1e-4)
    assert audios["original_sampling_rate"] == {16000: 1, 44100: 1} and audios["original_channels"] == {1: 1, 2: 1}
    assert audios["kept_as_is"] == 1  # the 16 kHz mono FLAC
    assert audios["tokens_per_clip"] is None and audios["settings"]["max_seconds"] == 2  # no model: nothing counted
    assert audios["stored"].startswith("16000 Hz mono 16-bit FLAC") and result.manifest["videos"] is None
    files = [tmp_path / "prepared" / f for f in result.manifest["splits"]["train"]["shards"]]
    assert len(files) == 2  # the shard being written when the first audio came ended there
    schemas = {str(pq.read_schema(f).remove_metadata()) for f in files}
    assert len(schemas) == 1 and "audios" in next(iter(schemas)) and "videos" not in next(iter(schemas))
    ds = ShardDataset(files)
    samples = [ds[i] for i in range(len(ds))]
    assert [s.id for s in samples] == ["img0", "img1", "img2", "aud0", "aud1"]
    assert all(s.audios == [] for s in samples[:3]) and samples[3].audios == [flac(0.5)]
    assert audio_shape(samples[4].audios[0]) == (24_000, 16_000)
    rejected = {r["id"]: r for r in map(json.loads, (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines())}
    assert rejected["bad"]["reason"] == "corrupt_audio" and "i.png" in rejected["bad"]["detail"]
    assert rejected["long"]["reason"] == "audio_too_long"
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["audios"]["original_sampling_rate"] == {"16000": 1, "44100": 1} and manifest["totals"]["rejected"] == result.rejected
