"""Assistant-only labels and batch assembly, on real multi-turn samples with the built tiny model's processor."""

from __future__ import annotations

import json

import pytest

from vlmctl.data.sample import Sample
from real_data import REAL



@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_processor

    out = tmp_path_factory.mktemp("collate") / "model"
    texts = [json.dumps(json.loads((REAL / "llamafactory_mllm_demo" / "mllm_demo.json").read_text()), ensure_ascii=False)] * 5
    build_model(ModelSection(preset="tiny", init="random", output_dir=out), tokenizer_texts=texts + ["What is unusual about this image?"] * 20)
    return load_processor(out)


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def _parts(value: str, image_index: int = 0) -> list[dict]:
    """LLaVA/ShareGPT content with `<image>` placeholders -> content parts (images in order of appearance)."""
    parts = []
    for i, chunk in enumerate(value.split("<image>")):
        if i:
            parts.append({"type": "image", "index": image_index})
        if chunk.strip():
            parts.append(_text(chunk.strip()))
    return parts


def llava_samples() -> list[Sample]:
    folder = REAL / "llava_examples"
    out = []
    for rec in json.loads((folder / "llava_format.json").read_text()):
        roles = {"human": "user", "gpt": "assistant"}
        messages = [{"role": roles[t["from"]], "content": _parts(t["value"])} for t in rec["conversations"]]
        images = [(folder / rec["image"]).read_bytes()] if "image" in rec else []
        out.append(Sample(id=rec["id"], messages=messages, images=images, source="llava_format.json"))
    return out


def mllm_demo_samples() -> list[Sample]:
    folder = REAL / "llamafactory_mllm_demo"
    out = []
    for i, rec in enumerate(json.loads((folder / "mllm_demo.json").read_text())):
        # Repeated paths are one image used twice (index 0 both times), as prepare stores them.
        paths = list(dict.fromkeys(rec["images"]))
        messages, seen = [], 0
        for m in rec["messages"]:
            parts = []
            for j, chunk in enumerate(m["content"].split("<image>")):
                if j:
                    parts.append({"type": "image", "index": paths.index(rec["images"][seen])})
                    seen += 1
                if chunk:
                    parts.append(_text(chunk))
            messages.append({"role": m["role"], "content": parts})
        out.append(Sample(id=f"mllm-{i}", messages=messages, images=[(folder / p).read_bytes() for p in paths]))
    return out


def label_runs(labels: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t in labels:
        if t == -100:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(t)
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("source", ["llava", "mllm_demo"])
def test_labels_cover_exactly_every_assistant_turn(processor, source):
    from vlmctl.data.collate import encode_sample, image_token_ids

    samples = llava_samples() if source == "llava" else mllm_demo_samples()
    with_system = Sample(id="sys", messages=[{"role": "system", "content": [_text("Answer briefly.")]}, *samples[0].messages],
                         images=samples[0].images)
    tok = processor.tokenizer
    visual = image_token_ids(processor)
    for sample in [*samples, with_system]:
        enc = encode_sample(sample, processor)
        ids, labels = enc.input_ids.tolist(), enc.labels.tolist()
        assert len(ids) == len(labels)
        expected = [" ".join(p["text"] for p in m["content"] if p["type"] == "text") for m in sample.messages if m["role"] == "assistant"]
        runs = label_runs(labels)
        assert [tok.decode(r) for r in runs] == [e + "<|im_end|>" for e in expected], sample.id
        # labels equal the input ids where set; visual tokens and user/system text never carry loss
        assert all(lab in (-100, i) for lab, i in zip(labels, ids))
        assert not any(lab in visual for lab in labels)
        placeholders = sum(1 for m in sample.messages for p in m["content"] if p["type"] == "image")
        assert sum(1 for i in ids if i in visual) == 64 * placeholders == enc.num_visual_tokens
        user_text = [p["text"] for m in sample.messages if m["role"] != "assistant" for p in m["content"] if p["type"] == "text"]
        labelled = tok.decode([t for t in labels if t != -100])
        assert not any(u in labelled for u in user_text if len(u) > 8)


def test_two_images_of_one_sample_are_both_processed(processor):
    from vlmctl.data.collate import encode_sample

    sample = mllm_demo_samples()[0]  # the same image before the first and after the second question
    enc = encode_sample(sample, processor)
    assert enc.num_images == 2 and enc.image_inputs["pixel_values"].shape[0] == 2


def test_collator_pads_counts_and_adds_a_dummy_image_to_text_only_batches(processor):
    from vlmctl.data.collate import Collator

    llava = llava_samples()
    text_only = [s for s in llava if not s.images]
    collate = Collator(processor)
    batch = collate(text_only)
    # one extra row of visual tokens only, no labels: the vision tower runs, the loss does not change
    assert batch["input_ids"].shape[0] == len(text_only) + 1 and batch["num_dummy_images"] == 1
    assert (batch["labels"][-1] == -100).all() and batch["pixel_values"].shape[0] == 1
    assert batch["num_visual_tokens"] == 0
    mixed = collate(llava)
    assert mixed["num_dummy_images"] == 0 and mixed["input_ids"].shape[0] == len(llava)
    assert mixed["pixel_values"].shape[0] == sum(len(s.images) for s in llava)
    lengths = mixed["attention_mask"].sum(1)
    assert int(lengths.max()) == mixed["input_ids"].shape[1]
    for row, n in enumerate(lengths.tolist()):  # right padding: padding carries neither attention nor loss
        assert (mixed["labels"][row, n:] == -100).all() and (mixed["attention_mask"][row, n:] == 0).all()
    assert mixed["num_label_tokens"] == int((mixed["labels"][:, 1:] != -100).sum())
    assert mixed["num_text_tokens"] + mixed["num_visual_tokens"] == int(lengths.sum())


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-idefics3"])
def test_other_families_collate_and_run_forward(preset, tmp_path):
    """Qwen-VL (patches + image_grid_thw + per-token mm_token_type_ids) and Idefics3 (tiles with row/column markers
    around the visual tokens, images per sample) go through the same collator."""
    import math

    import torch

    from vlmctl.config import ModelSection
    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.models import build_model, load_model
    from vlmctl.train.objectives import token_loss_sum

    texts = ["What is unusual about this image? A man is ironing clothes. What color is the vehicle? Yellow."] * 20
    build_model(ModelSection(preset=preset, init="random", output_dir=tmp_path / "m"), tokenizer_texts=texts)
    model, processor, family = load_model(tmp_path / "m", dtype="fp32")
    samples = llava_samples()
    collate = Collator(processor, family)
    tok = processor.tokenizer
    for batch in (collate(samples[:2]), collate(samples[2:])):
        expected = [" ".join(p["text"] for p in m["content"]) for m in samples[0].messages if m["role"] == "assistant"]
        if batch["num_dummy_images"] == 0:
            assert [tok.decode(r) for r in label_runs(batch["labels"][0].tolist())] == [e + "<|im_end|>" for e in expected]
        with torch.no_grad():
            loss = token_loss_sum(model(**model_inputs(batch), use_cache=False).logits, batch["labels"])
        assert math.isfinite(float(loss)) and float(loss) > 0
    assert collate(samples[2:])["num_dummy_images"] == 1
    # one packed row of the same samples: the same summed loss as the padded batches (mRoPE positions per sample)
    from vlmctl.data.collate import PackedCollator
    from vlmctl.families.qwen_vl import packed_mrope_positions
    from vlmctl.train.kernels import token_losses

    padded = [collate(samples[:2]), collate(samples[2:])]
    with torch.no_grad():
        padded_sum = sum(float(token_loss_sum(model(**model_inputs(b), use_cache=False).logits, b["labels"])) for b in padded)
    row = PackedCollator(processor, family, tokens_per_batch=100_000)(samples)
    assert row["input_ids"].shape[0] == 1 and row["num_samples"] == len(samples)
    assert row["num_label_tokens"] == sum(b["num_label_tokens"] for b in padded)
    if family.mrope:
        row["position_ids"] = packed_mrope_positions(model.model.get_rope_index, row["input_ids"], row["mm_token_type_ids"],
                                                     row["seq_lens"], image_grid_thw=row["image_grid_thw"])
    with torch.no_grad():
        losses, _ = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
    assert float(losses.sum()) == pytest.approx(padded_sum, rel=1e-4)


def test_packed_collator_concatenates_samples_with_restarting_positions(processor):
    import torch

    from vlmctl.data.collate import Collator, PackedCollator

    llava = llava_samples()
    row = PackedCollator(processor, tokens_per_batch=10_000)(llava)
    padded = Collator(processor)(llava)
    lens = padded["attention_mask"].sum(1).tolist()
    assert row["seq_lens"] == lens and row["input_ids"].shape == (1, sum(lens)) and "attention_mask" not in row
    assert row["packed_cu_seqlens"].tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert row["packed_max_seqlen"] == max(lens)
    assert row["position_ids"][0].tolist() == [i for n in lens for i in range(n)]
    starts = row["packed_cu_seqlens"][:-1].tolist()
    assert (row["labels"][0, starts] == -100).all()  # no sample's first token is a target of the previous one
    for key in ("num_label_tokens", "num_text_tokens", "num_visual_tokens", "num_dummy_images", "num_samples"):
        assert row[key] == padded[key], key
    assert torch.equal(row["pixel_values"], padded["pixel_values"])
    # a row of text-only samples gets the dummy image as one more zero-label sample
    text_only = [s for s in llava if not s.images]
    row = PackedCollator(processor, tokens_per_batch=10_000)(text_only)
    assert row["num_dummy_images"] == 1 and len(row["seq_lens"]) == len(text_only) + 1 and row["pixel_values"].shape[0] == 1
    assert (row["labels"][0, -row["seq_lens"][-1]:] == -100).all() and row["num_samples"] == len(text_only)
    # a sample that no longer fits its planned row is left out, with a warning
    collate = PackedCollator(processor, tokens_per_batch=max(lens))
    with pytest.warns(UserWarning, match="does not fit"):
        row = collate(llava[:2])
    assert collate.dropped == 1 and row["num_samples"] == 1
