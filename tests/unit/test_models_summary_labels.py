"""What the parameter table of `vlmctl model build` calls the encoder in front of the projector: the audio tower of
an audio-language family (Qwen2-Audio), the vision tower of every family that takes images."""

from __future__ import annotations

from vlmctl.families import FAMILIES
from vlmctl.models.summary import part_labels, training_summary

INFO = {"parameters": {"vision": 30, "projector": 5, "llm": 100, "total": 135}}


def test_the_audio_family_has_an_audio_tower_and_image_families_a_vision_tower():
    s = training_summary({**INFO, "family": "qwen2_audio"}, stage="finetune", strategy="ddp", num_gpus=1, device="cpu")
    assert s["part_labels"] == {"vision": "audio tower", "projector": "projector", "llm": "language model"}
    assert s["trained"] == {"vision": False, "projector": True, "llm": True} and s["trainable_parameters"] == 105
    for name, fam in FAMILIES.items():
        label = part_labels(name)["vision"]
        assert label == ("vision tower" if "image" in fam.modalities else "audio tower"), name
    assert part_labels("llava")["vision"] == "vision tower"
    assert part_labels("not-a-family") == {"vision": "vision tower", "projector": "projector", "llm": "language model"}
