"""Media parts by modality: the image unit (dummy input, token count), the unit registry as the collator uses it,
and `Sample` rows with media parts (new columns optional, old shards unchanged)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from PIL import Image

from vlmctl.data.modalities import UNITS, ImageUnit, ModalityUnit, get_unit, media_token_ids, units_for
from vlmctl.data.sample import MEDIA_COLUMNS, MODALITIES, Sample, arrow_schema
from vlmctl.errors import DataError


def png(color=(200, 30, 30), size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


ANSWER = {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(processor, family spec) of the tiny LLaVA preset: a 32 px SigLIP processor, 64 visual tokens per image."""
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model

    out = tmp_path_factory.mktemp("modalities") / "model"
    build_model(ModelSection(preset="tiny", init="random", output_dir=out), tokenizer_texts=["What color is it? Red."] * 20)
    _, processor, family = load_model(out, dtype="fp32")
    return processor, family


# ------------------------------------------------------------------------------------------------ image unit


def test_image_unit_counts_tokens_from_the_family_spec_and_makes_its_dummy_input(tiny):
    from vlmctl.data.collate import dummy_row, encode_sample

    processor, family = tiny
    unit = get_unit("image")
    assert isinstance(unit, ImageUnit) and unit.processor_kwarg == "images" and unit.dummy_counter == "num_dummy_images"
    # the dummy input: a black square of the processor's fixed input size; 56 px where the size is an area
    dummy = unit.dummy_input(processor)
    side = processor.image_processor.size["height"]
    assert dummy.size == (side, side) and dummy.mode == "RGB" and dummy.getextrema() == ((0, 0), (0, 0), (0, 0))
    assert unit.dummy_input(SimpleNamespace(image_processor=SimpleNamespace(size={"shortest_edge": 3136}))).size == (56, 56)
    # token count: the family's rule, equal to what the processor expands one image into
    image = png(size=(57, 31))
    assert unit.size(image) == (57, 31)
    assert unit.num_tokens(image, family, processor) == family.num_visual_tokens(57, 31, processor) == 64
    sample = Sample("s", [user({"type": "image", "index": 0}, {"type": "text", "text": "Color?"}), ANSWER], images=[image])
    assert encode_sample(sample, processor, family).num_visual_tokens == 64
    row = dummy_row(unit, processor, family)
    assert row.num_visual_tokens == 64 and row.num_images == 1 and (row.labels == -100).all()
    assert tuple(row.image_inputs["pixel_values"].shape) == (1, 3, side, side)
    assert unit.token_ids(processor) == media_token_ids(processor) == {processor.tokenizer.convert_tokens_to_ids("<image>")}
    assert [p.size for p in unit.decode([image, png(size=(8, 9))])] == [(57, 31), (8, 9)]


def test_unit_prompt_and_modalities_come_from_the_family_spec(tiny):
    from vlmctl.families import FAMILIES

    processor, _ = tiny
    unit = get_unit("image")
    for spec in FAMILIES.values():
        assert units_for(spec) == [u for u in UNITS.values() if u.name in spec.modalities]  # Qwen-VL: image and video
        if "image" in spec.modalities:  # Qwen2-Audio: audio only
            assert unit.prompt(processor, spec) == spec.image_prompt and unit.accepted_by(spec)
    flat = SimpleNamespace(image_prompt="<a><image><b>")  # a spec without a modalities map
    assert unit.prompt(processor, flat) == "<a><image><b>" and units_for(flat) == [unit]
    assert unit.prompt(processor, None) == "<image>" and units_for(None) == [unit]  # no spec: the processor's token
    audio_only = SimpleNamespace(modalities={"audio": "<audio>"}, prompt=lambda modality: "<audio>")
    assert units_for(audio_only) == [UNITS["audio"]] and unit.prompt(processor, audio_only) == "<image>"
    with pytest.raises(DataError, match="no modality unit"):
        get_unit("smell")


def test_collator_adds_dummy_rows_only_for_the_family_modalities(tiny):
    from vlmctl.data.collate import Collator, PackedCollator

    processor, family = tiny
    text_only = [Sample(f"t{i}", [user({"type": "text", "text": "Hi" * (i + 1)}), ANSWER]) for i in range(2)]
    with_image = Collator(processor, family)(text_only)
    assert with_image["input_ids"].shape[0] == 3 and with_image["num_dummy_images"] == 1
    no_image = SimpleNamespace(modalities={"video": "<video>"}, prompt=lambda modality: "<video>")  # videos need no dummy
    batch = Collator(processor, no_image)(text_only)
    assert batch["input_ids"].shape[0] == 2 and batch["num_dummy_images"] == 0 and "pixel_values" not in batch
    row = PackedCollator(processor, family, tokens_per_batch=4096).pack([])  # an empty packed row still runs once
    assert row["num_dummy_images"] == 1 and row["num_samples"] == 0


def test_processor_outputs_go_to_the_unit_that_owns_them():
    import torch

    from vlmctl.data.collate import split_processor_outputs

    class Clips(ModalityUnit):  # a stand-in for a video unit
        name, processor_kwarg = "video", "videos"

        def owns(self, key):
            return "video" in key

        decode = num_tokens = dummy_input = collate = None

    out = {"input_ids": torch.zeros(1, 5), "attention_mask": torch.ones(1, 5), "mm_token_type_ids": torch.zeros(1, 5),
           "pixel_values": torch.zeros(4, 6), "image_grid_thw": torch.ones(1, 3), "pixel_values_videos": torch.zeros(8, 6)}
    token, media = split_processor_outputs(out, [UNITS["image"], Clips()])
    assert set(token) == {"mm_token_type_ids"} and token["mm_token_type_ids"].shape == (5,)
    assert set(media) == {"image", "video"} and set(media["image"]) == {"pixel_values", "image_grid_thw"}
    assert set(media["video"]) == {"pixel_values_videos"}
    _, media = split_processor_outputs(out)  # the registered units: the video unit claims its keys, images the rest
    assert set(media["video"]) == {"pixel_values_videos"} and set(media["image"]) == {"pixel_values", "image_grid_thw"}


# ------------------------------------------------------------------------------------------- sample and rows


def test_sample_media_parts_by_modality():
    red, clip, wav = png(), b"\x00\x00\x00\x18ftypmp42", b"RIFF....WAVE"
    s = Sample("m", [user({"type": "image", "index": 0}, {"type": "video", "index": 0}, {"type": "audio", "index": 0}), ANSWER],
               images=[red], videos=[clip], audios=[wav], source="x.json")
    assert s.media == {"image": [red], "video": [clip], "audio": [wav]} and s.images == [red] and s.videos == [clip]
    assert s == Sample("m", s.messages, media={"image": [red], "video": [clip], "audio": [wav]}, source="x.json")
    images_only = Sample("i", [user({"type": "image", "index": 0}), ANSWER], [red])
    assert images_only.media == {"image": [red]} and images_only.videos == [] and Sample("t", []).images == []
    images_only.images = [red, red]  # prepare's checks replace references by bytes
    assert images_only.media["image"] == [red, red]
    with pytest.raises(DataError, match="unknown media"):
        Sample("u", [], media={"pointcloud": [b""]})
    with pytest.raises(DataError, match="given twice"):
        Sample("u", [], images=[red], media={"image": [red]})
    assert MODALITIES == tuple(MEDIA_COLUMNS) == ("image", "video", "audio")


def test_media_parts_round_trip_through_rows_and_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset

    red, clip, wav = png(), b"\x00\x00\x00\x18ftypmp42", b"RIFF....WAVE"
    media = Sample("m", [user({"type": "video", "index": 0}, {"type": "text", "text": "And?"}, {"type": "audio", "index": 0},
                              {"type": "image", "index": 0}), ANSWER],
                   images=[red], videos=[clip], audios=[wav], source="a.json", meta={"k": 1}, num_tokens=9)
    plain = Sample("p", [user({"type": "image", "index": 0}, {"type": "text", "text": "Q?"}), ANSWER], images=[red])
    row = media.to_row()
    assert row["videos"] == [{"bytes": clip, "path": None}] and row["audios"] == [{"bytes": wav, "path": None}]
    assert Sample.from_row(row) == media and "videos" not in plain.to_row()
    schema = arrow_schema(("image", "video", "audio"))
    assert schema.names[-2:] == ["videos", "audios"] and arrow_schema().names == [n for n in schema.names if n not in ("videos", "audios")]
    pq.write_table(pa.Table.from_pylist([media.to_row(), plain.to_row()], schema=schema), tmp_path / "new.parquet")
    ds = ShardDataset([tmp_path / "new.parquet"])
    assert [ds[0], ds[1]] == [media, plain]
    with pytest.raises(DataError, match="unknown media"):
        arrow_schema(("image", "smell"))


def test_an_old_format_row_and_shard_with_only_images_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset

    red = png()
    old_row = {  # a row of shards written before media by modality: no videos/audios columns
        "id": "old", "source": "llava.json", "num_tokens": None, "meta": None,
        "messages": [{"role": "user", "content": [{"type": "image", "text": None, "index": 0}, {"type": "text", "text": "Q?", "index": None}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "A.", "index": None}]}],
        "images": [{"bytes": red, "path": None}],
    }
    s = Sample.from_row(old_row)
    assert s.media == {"image": [red]} and s.messages[0]["content"] == [{"type": "image", "index": 0}, {"type": "text", "text": "Q?"}]
    assert s.to_row() == old_row  # and written back the same way
    old_schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("messages", arrow_schema().field("messages").type),
                            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
                            ("num_tokens", pa.int32()), ("meta", pa.string())])
    pq.write_table(pa.Table.from_pylist([old_row], schema=old_schema), tmp_path / "old.parquet")
    ds = ShardDataset([tmp_path / "old.parquet"])
    assert ds[0] == s and not ds.exact_lengths and ds.lengths.tolist() == [len("Q?A.") // 4 + 64]


def test_parts_of_a_modality_without_a_unit_are_refused_where_they_are_encoded():
    from vlmctl.data.collate import template_media, template_messages

    red = png()
    s = Sample("m", [user({"type": "image", "index": 0}, {"type": "text", "text": "Q?"}, {"type": "image", "index": 0}), ANSWER], images=[red])
    messages, media = template_media(s)
    assert messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Q?"}, {"type": "image"}]
    assert media == {"image": [red, red]} and template_messages(s) == (messages, [red, red])
    with pytest.raises(DataError, match="no modality unit"):
        get_unit("smell")  # every modality a Sample can hold has a unit now: audio parts pass as audio parts
    assert template_media(Sample("a", [user({"type": "audio", "index": 0}), ANSWER], audios=[b"RIFF....WAVE"]))[0][0]["content"] == [{"type": "audio"}]
    with pytest.raises(DataError, match="points at image 1"):
        template_media(Sample("bad", [user({"type": "image", "index": 1}), ANSWER], images=[red]))
