"""Which energon shape a sample fits (`vlmctl.data.energon.single_turn`) and which prompts count as captioning."""

from __future__ import annotations

import pytest

from vlmctl.config.data import DataSection
from vlmctl.data.energon import EnergonWriter, dataset_yaml, is_caption_prompt, media_extension, single_turn
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

IMG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16  # only the signature is looked at
TEXT = lambda t: {"type": "text", "text": t}  # noqa: E731
IMAGE = {"type": "image", "index": 0}
VIDEO = {"type": "video", "index": 0}
AUDIO = {"type": "audio", "index": 0}
MKV = b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\x82\x88matroska"  # EBML header up to the DocType
WEBM = b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\x82\x84webm"
FLAC = b"fLaC\0\0\0\x22"


def sample(*turns, images=(IMG,), **kw) -> Sample:
    return Sample(id="s", messages=[{"role": r, "content": list(c)} for r, c in turns], images=list(images), **kw)


def test_single_turn_gives_question_and_answer_or_why_not():
    assert single_turn(sample(("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")]))) == ("Q?", "A.")
    assert single_turn(sample(("user", [TEXT("Q?"), IMAGE]), ("assistant", [TEXT("A.")]))) == ("Q?", "A.")
    assert single_turn(sample(("user", [IMAGE]), ("assistant", [TEXT("A caption.")]))) == ("", "A caption.")

    cases = {
        "has a system turn": sample(("system", [TEXT("Be brief.")]), ("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")])),
        "has 2 user turns": sample(("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")]), ("user", [TEXT("Q2?")]), ("assistant", [TEXT("B.")])),
        "has 2 images": sample(("user", [IMAGE, {"type": "image", "index": 1}, TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=(IMG, IMG)),
        "has no image": sample(("user", [TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=()),
        "has text on both sides of its image": sample(("user", [TEXT("Left"), IMAGE, TEXT("right?")]), ("assistant", [TEXT("A.")])),
        "shows its image more than once": sample(("user", [IMAGE, IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")])),
        "has image and video parts": Sample(id="v", messages=[{"role": "user", "content": [IMAGE, TEXT("Q?")]}, {"role": "assistant", "content": [TEXT("A.")]}],
                                            images=[IMG], videos=[MKV]),
        "has audio parts": sample(("user", [AUDIO, TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=(), audios=[FLAC]),
        "has 2 videos": sample(("user", [VIDEO, {"type": "video", "index": 1}]), ("assistant", [TEXT("A.")]), images=(), videos=[MKV, MKV]),
        "has text on both sides of its video": sample(("user", [TEXT("L"), VIDEO, TEXT("R")]), ("assistant", [TEXT("A.")]), images=(), videos=[MKV]),
    }
    for why, s in cases.items():
        assert single_turn(s) == why
    # one video and its question is single-turn too (energon's VidQASample)
    assert single_turn(sample(("user", [VIDEO, TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=(), videos=[MKV])) == ("Q?", "A.")


@pytest.mark.parametrize("prompt, generic", [
    ("", True), ("   ", True), ("Provide a brief description of the given image.", True),
    ("  describe THE image   concisely ", True), ("Describe this photo", True),
    ("What is unusual about this image?", False), ("Describe the image in Japanese.", False),
])
def test_caption_prompts(prompt, generic):
    assert is_caption_prompt(prompt) is generic


def test_explicit_shapes_refuse_samples_that_do_not_fit_and_auto_explains_itself(tmp_path):
    multi = sample(("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")]), ("user", [TEXT("Q2?")]), ("assistant", [TEXT("B.")]))
    multi.location = "chat.json:7"
    for fmt in ("vqa", "captioning"):
        with pytest.raises(DataError, match=r"sample 's' \(chat\.json:7\) cannot be exported with data.export.energon_format=" + fmt):
            EnergonWriter(tmp_path, 1 << 20, fmt).add("train", multi)

    w = EnergonWriter(tmp_path, 1 << 20, "auto")
    w.add("train", sample(("user", [IMAGE]), ("assistant", [TEXT("A caption.")])))
    assert w.shape == "captioning"
    w.add("val", sample(("user", [IMAGE, TEXT("What colour?")]), ("assistant", [TEXT("Grey.")])))
    assert w.shape == "vqa"
    w.add("train", multi)
    assert w.shape == "crude" and "chat.json:7" in w._resolve()[1]


def test_energon_format_is_a_checked_config_key():
    assert DataSection().export.energon_format == "auto"
    assert DataSection(export={"energon_format": "vqa"}).export.energon_format == "vqa"
    with pytest.raises(ValueError, match="energon_format"):
        DataSection(export={"energon_format": "llava"})


@pytest.mark.parametrize("modality, data, ext", [
    ("video", MKV, "mkv"), ("video", WEBM, "webm"), ("video", b"\0\0\0\x20ftypisom", "mp4"),
    ("video", b"\0\0\0\x14ftypqt  ", "mov"), ("video", b"RIFF\0\0\0\0AVI LIST", "avi"), ("video", b"GIF89a", None),
    ("audio", FLAC, "flac"), ("audio", b"RIFF\0\0\0\0WAVEfmt ", "wav"), ("audio", b"ID3\x04", "mp3"),
    ("audio", b"\xff\xfb\x90\x00", "mp3"), ("audio", b"OggS\0", None), ("image", IMG, "png"),
])
def test_media_extension_from_the_bytes(modality, data, ext):
    assert media_extension(modality, data) == ext


def test_video_samples_pick_vidqa_and_mixed_media_pick_crude(tmp_path):
    video = lambda q="What moves?": sample(("user", [VIDEO, TEXT(q)]), ("assistant", [TEXT("A square.")]), images=(), videos=[MKV])  # noqa: E731
    w = EnergonWriter(tmp_path, 1 << 20, "auto")
    w.add("train", video(""))  # a generic prompt still cannot be a CaptioningSample: that holds an image
    assert w.shape == "vqa" and "has a video" in w._resolve()[1]
    w.add("train", sample(("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")])))
    assert w.shape == "crude" and "has a video and sample 's' an image" in w._resolve()[1]

    with pytest.raises(DataError, match=r"energon_format=captioning: it has a video \(energon's CaptioningSample"):
        EnergonWriter(tmp_path, 1 << 20, "captioning").add("train", video())
    w = EnergonWriter(tmp_path, 1 << 20, "vqa")
    w.add("train", video())
    with pytest.raises(DataError, match=r"it has an image while sample 's' has a video"):
        w.add("train", sample(("user", [IMAGE, TEXT("Q?")]), ("assistant", [TEXT("A.")])))
    # crude takes anything, but a clip energon cannot decode by name is refused up front
    w = EnergonWriter(tmp_path, 1 << 20, "crude")
    w.add("train", sample(("user", [AUDIO, TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=(), audios=[FLAC]))
    with pytest.raises(DataError, match=r"its audio 0 is not in a container energon's AV decoder reads") as err:
        w.add("train", sample(("user", [AUDIO, TEXT("Q?")]), ("assistant", [TEXT("A.")]), images=(), audios=[b"OggS\0"]))
    assert "prepare the data again" in err.value.hint


def test_dataset_yaml_for_video():
    import yaml

    assert yaml.safe_load(dataset_yaml("vqa", ["mp4", "mkv"], "video")) == {
        "sample_type": {"__module__": "megatron.energon", "__class__": "VidQASample"},
        "field_map": {"video": "mkv,mp4", "context": "json[question]", "answers": "txt"}}
    assert yaml.safe_load(dataset_yaml("crude", ["mkv"], "video")) == {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
