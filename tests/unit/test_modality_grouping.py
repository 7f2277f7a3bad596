"""`train.group_by_modality` outside the sampler: each sample's modality read from the shards, the collator's dummies
under grouping (none for an encoder no rank of the step runs), and how the trainer builds its sampler and collator."""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from vlmctl.data.sample import Sample

ANSWER = {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 32), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def text_sample(i: int) -> Sample:
    return Sample(f"t{i}", [user({"type": "text", "text": "What color? " * (i + 1)}), ANSWER])


def image_sample(i: int) -> Sample:
    return Sample(f"i{i}", [user({"type": "image", "index": 0}, {"type": "text", "text": "What color?"}), ANSWER], images=[png()])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(processor, family spec) of the tiny LLaVA preset (images only)."""
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model

    out = tmp_path_factory.mktemp("grouping") / "model"
    build_model(ModelSection(preset="tiny", init="random", output_dir=out), tokenizer_texts=["What color is it? Red."] * 20)
    _, processor, family = load_model(out, dtype="fp32")
    return processor, family


def test_shards_give_each_samples_modality_from_its_parts_without_decoding(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.sample import arrow_schema

    red, clip, wav = png(), b"not a clip: never decoded", b"not audio either"
    part = lambda kind: {"type": kind, "index": 0}  # noqa: E731
    samples = [
        Sample("image", [user(part("image"), {"type": "text", "text": "Q?"}), ANSWER], images=[red]),
        Sample("text", [user({"type": "text", "text": "Q?"}), ANSWER]),
        Sample("video+image", [user(part("image"), part("video")), ANSWER], images=[red], videos=[clip]),
        Sample("audio+image", [user(part("audio"), part("image")), ANSWER], images=[red], audios=[wav]),
        Sample("audio", [user(part("audio")), ANSWER], audios=[wav]),
        Sample("video+audio", [user(part("video"), part("audio")), ANSWER], videos=[clip], audios=[wav]),
    ]
    schema = arrow_schema(("image", "video", "audio"))
    pq.write_table(pa.Table.from_pylist([s.to_row() for s in samples], schema=schema), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([samples[1].to_row(), samples[0].to_row()], schema=arrow_schema()), tmp_path / "b.parquet")
    ds = ShardDataset([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert ds.modalities().tolist() == ["image", "text", "video", "audio", "audio", "video", "text", "image"]


def test_grouped_collator_adds_no_dummy_for_an_encoder_no_rank_of_the_step_runs(tiny):
    from vlmctl.data.collate import Collator, PackedCollator, encode_sample

    processor, family = tiny
    texts = [text_sample(i) for i in range(2)]
    mixed = Collator(processor, family)(texts)  # off: a text-only rank runs the dummy image
    assert mixed["num_dummy_images"] == 1 and "pixel_values" in mixed and mixed["input_ids"].shape[0] == 3
    grouped = Collator(processor, family, grouped=True)
    text_step = grouped(texts)  # every rank of the step is text-only: no vision tower anywhere
    assert text_step["num_dummy_images"] == 0 and "pixel_values" not in text_step and text_step["input_ids"].shape[0] == 2
    assert text_step["num_samples"] == 2 and text_step["num_label_tokens"] == mixed["num_label_tokens"]
    image_step = grouped([image_sample(0), image_sample(1)])
    assert image_step["num_dummy_images"] == 0 and image_step["pixel_values"].shape[0] == 2
    # an audio step's samples may have images on another rank: the vision tower's dummy stays
    rows = [encode_sample(s, processor, family) for s in texts]
    assert grouped.pad(rows, group="audio")["num_dummy_images"] == 1
    assert grouped.pad(rows)["num_dummy_images"] == 0  # the group read from the rows: text

    packed = PackedCollator(processor, family, tokens_per_batch=4096, grouped=True)
    assert packed(texts)["num_dummy_images"] == 0 and "pixel_values" not in packed(texts)
    # an empty row still runs one forward pass: the image step's dummy image, or a text-only filler row
    empty_image = packed.pack([], group="image")
    assert empty_image["num_dummy_images"] == 1 and empty_image["num_samples"] == 0
    empty_text = packed.pack([], group="text")
    assert empty_text["num_dummy_images"] == 0 and empty_text["num_samples"] == 0 and "pixel_values" not in empty_text
    assert empty_text["input_ids"].shape[1] > 0 and (empty_text["labels"] == -100).all()
    tight = PackedCollator(processor, family, tokens_per_batch=3, grouped=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dropped = tight(texts)  # every sample left out (stale lengths): the row is still text-only
    assert tight.dropped == 2 and dropped["num_samples"] == 0 and "pixel_values" not in dropped


def _cfg(strategy: str, packing: bool, grouped: bool = True):
    train = SimpleNamespace(objective="sft", strategy=strategy, packing=packing, group_by_modality=grouped, tokens_per_batch=512,
                            micro_batch_size=2, group_by_length=True, seed=3, gradient_accumulation_steps=2)
    return SimpleNamespace(train=train, data=SimpleNamespace(max_length=256, sources=[]))


CTX = SimpleNamespace(dims=SimpleNamespace(sp=1, dp_size=2, dp_rank=1), env=SimpleNamespace(is_main=True))


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "zero2", "zero3"])
@pytest.mark.parametrize("packing", [False, True])
def test_the_trainer_groups_dummies_only_where_skipping_a_tower_is_safe(strategy, packing, tiny):
    from vlmctl.data.collate import PackedCollator
    from vlmctl.train.data import build_collator

    tm = SimpleNamespace(processor=tiny[0], family=tiny[1])
    collator = build_collator(_cfg(strategy, packing), CTX, tm)
    assert isinstance(collator, PackedCollator) == packing and collator.max_length == 256
    assert collator.grouped == (strategy in ("fsdp", "ddp"))  # DeepSpeed keeps every dummy (build_collator says why)
    assert not build_collator(_cfg(strategy, packing, grouped=False), CTX, tm).grouped


def test_the_trainer_samples_by_modality_and_warns_of_a_group_too_small_for_a_step(capsys):
    from vlmctl.train.data import build_sampler

    names = np.array(["image"] * 40 + ["text"] * 20 + ["video"] * 3)
    dataset = SimpleNamespace(modalities=lambda: names, sample_costs=None)
    lengths = np.full(len(names), 50)
    for packing in (False, True):
        sampler = build_sampler(_cfg("fsdp", packing), CTX, dataset, lengths)
        assert sampler.grouping and sampler.step_batches == 2 and sampler.world_size == 2 and sampler.rank == 1
        assert "the 3 video samples are fewer than one optimizer step" in capsys.readouterr().err
    assert not build_sampler(_cfg("fsdp", False, grouped=False), CTX, dataset, lengths).grouping
