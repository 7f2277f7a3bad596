"""Which energon shape a sample fits (`vlmctl.data.energon.single_turn`) and which prompts count as captioning."""

from __future__ import annotations

import pytest

from vlmctl.config.data import DataSection
from vlmctl.data.energon import EnergonWriter, is_caption_prompt, single_turn
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

IMG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16  # only the signature is looked at
TEXT = lambda t: {"type": "text", "text": t}  # noqa: E731
IMAGE = {"type": "image", "index": 0}


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
        "has video parts": Sample(id="v", messages=[{"role": "user", "content": [IMAGE, TEXT("Q?")]}, {"role": "assistant", "content": [TEXT("A.")]}],
                                  images=[IMG], videos=[b"mp4"]),
    }
    for why, s in cases.items():
        assert single_turn(s) == why


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
