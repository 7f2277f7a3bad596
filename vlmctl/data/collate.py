"""Turn canonical samples into model inputs: chat template, image processing, assistant-only labels, padding
or packing.

Used by training (in DataLoader workers) and by evaluation (teacher-forced loss)::

    enc = encode_sample(sample, processor)       # one sample -> input_ids [T], labels [T], pixel_values [N, 3, H, W]
    batch = Collator(processor)([s1, s2, s3])    # samples -> padded tensors [B, T] + image tensors
    row = PackedCollator(processor, tokens_per_batch=4096)([s1, s2, s3])   # samples -> one packed row [1, T]

How the labels are found: the conversation is rendered with the processor's chat template; the character span
of each assistant turn is the difference between the template rendered up to that turn with
`add_generation_prompt=True` and rendered including it (so no template markers are parsed by hand). The text is
tokenized without image expansion (offsets give the token <-> character map), then aligned with the processor's
own output, where every image placeholder became its expansion (a run of visual tokens; Idefics3 adds tile
markers). Labels are the token ids inside assistant spans (their content and end-of-turn token) and -100
everywhere else: system and user turns, template markers and visual tokens never carry loss.

Family-specific inputs are whatever the processor returns besides `input_ids`/`attention_mask`: per-token tensors
(Qwen-VL's `mm_token_type_ids`) are padded like `input_ids`; image tensors (`pixel_values`, `image_grid_thw`, ...)
are concatenated along dim 0, or stacked per sample for processors that return [1, N_images, ...] (Idefics3).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from typing import Any

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

IGNORE_INDEX = -100
TEXT_KEYS = ("input_ids", "attention_mask")


@dataclass
class Encoded:
    """One encoded sample. Tensors are 1-D over tokens (`input_ids`, `labels`: [T]); `image_inputs` holds the
    processor's image tensors with images along dim 0 (e.g. `pixel_values` [N_images, 3, H, W])."""

    input_ids: Any
    labels: Any
    image_inputs: dict[str, Any] = field(default_factory=dict)
    num_images: int = 0
    num_visual_tokens: int = 0
    token_inputs: dict[str, Any] = field(default_factory=dict)  # other per-token tensors [T], padded with 0

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def template_messages(sample: Sample) -> tuple[list[dict], list[bytes]]:
    """The sample's messages in transformers' chat-template form, and the image bytes in order of appearance.

    Image parts become `{"type": "image"}`; an image used twice is passed twice (processors consume one image per
    placeholder).
    """
    messages, images = [], []
    for m in sample.messages:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                idx = p["index"]
                if not 0 <= idx < len(sample.images):
                    raise DataError(f"sample {sample.id!r}: image part points at image {idx}, but the sample has {len(sample.images)}",
                                    hint="re-run `vlmctl data prepare`; prepared samples keep image indices in range")
                parts.append({"type": "image"})
                images.append(sample.images[idx])
            else:
                parts.append({"type": "text", "text": p.get("text") or ""})
        messages.append({"role": m["role"], "content": parts})
    return messages, images


def assistant_spans(messages: list[dict], processor) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation and return (text, [(start, end) character span of each assistant turn]).

    A span covers the turn's content and its end-of-turn marker, with trailing whitespace removed (ChatML:
    `red<|im_end|>` of `<|im_start|>assistant\\nred<|im_end|>\\n`).
    Raises DataError when the template does not render a prefix of the conversation as a prefix of the whole.
    """
    render = lambda msgs, gen: processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True) if i else _render_empty(processor)
        upto = render(messages[: i + 1], False)
        if not text.startswith(upto) or not upto.startswith(before):
            raise DataError("the chat template does not render conversation prefixes as prefixes of the whole conversation",
                            hint="use a chat template that renders turns independently (e.g. ChatML) via model.chat_template")
        end = len(upto.rstrip())
        spans.append((len(before), end))
    return text, spans


def _render_empty(processor) -> str:
    try:
        return processor.apply_chat_template([], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - templates may reject an empty conversation
        return ""


def image_token_ids(processor) -> set[int]:
    """Ids of tokens the processor expands into visual tokens (image placeholder, and video where present)."""
    tok = processor.tokenizer
    ids = set()
    for attr in ("image_token_id", "video_token_id"):
        value = getattr(processor, attr, None)
        if isinstance(value, int):
            ids.add(value)
    for attr in ("image_token", "video_token"):
        token = getattr(processor, attr, None) or getattr(tok, attr, None)
        if isinstance(token, str):
            tid = tok.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tok.unk_token_id:
                ids.add(tid)
    return ids


def decode_images(images: list[bytes]) -> list:
    from PIL import Image

    out = []
    for data in images:
        img = Image.open(io.BytesIO(data))
        out.append(img.convert("RGB") if img.mode != "RGB" else img)
    return out


def encode_sample(sample: Sample, processor, family: Any = None, max_length: int | None = None) -> Encoded:
    """Encode one sample for teacher-forced training.

    Returns `Encoded` with `input_ids`/`labels` of shape [T] (int64; labels are -100 outside assistant turns) and
    the processor's image tensors. `max_length` truncates text after the last visual token; a sample whose visual
    tokens would be cut raises DataError (prepare drops such samples as too_long).
    """
    import torch

    messages, image_bytes = template_messages(sample)
    text, spans = assistant_spans(messages, processor)
    images = decode_images(image_bytes) if image_bytes else None
    proc_out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    ids = proc_out["input_ids"][0].to(torch.long)
    plain = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = _align_labels(ids.tolist(), plain["input_ids"], plain["offset_mapping"], spans, image_token_ids(processor), sample.id)
    labels = torch.tensor(labels, dtype=torch.long)
    token_inputs, image_inputs = split_processor_outputs(proc_out)
    visual_ids = torch.tensor(sorted(image_token_ids(processor)), dtype=torch.long)
    is_visual = torch.isin(ids, visual_ids)
    if max_length is not None and ids.shape[0] > max_length:
        last_visual = int(is_visual.nonzero().max()) if is_visual.any() else -1
        if last_visual >= max_length:
            raise DataError(f"sample {sample.id!r} has {ids.shape[0]} tokens with visual tokens beyond max_length={max_length}",
                            hint="raise data.max_length, or re-run `vlmctl data prepare` which drops too-long samples")
        ids, labels, is_visual = ids[:max_length], labels[:max_length], is_visual[:max_length]
        token_inputs = {k: v[:max_length] for k, v in token_inputs.items()}
    return Encoded(ids, labels, image_inputs, num_images=len(image_bytes), num_visual_tokens=int(is_visual.sum()),
                   token_inputs=token_inputs)


def split_processor_outputs(out) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per-token tensors [T] such as Qwen's `mm_token_type_ids`, image tensors) of a 1-sample processor output."""
    length = out["input_ids"].shape[-1]
    token, image = {}, {}
    for k, v in out.items():
        if k in TEXT_KEYS or not hasattr(v, "shape"):
            continue
        if v.ndim == 2 and tuple(v.shape) == (1, length):
            token[k] = v[0]
        else:
            image[k] = v
    return token, image


def _align_labels(expanded: list[int], plain: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                  visual: set[int], sample_id: str) -> list[int]:
    """Labels over the processor's (image-expanded) ids from the plain tokenization's character offsets.

    The plain ids are text segments separated by image placeholders. Each segment appears unchanged in the
    expanded ids; what lies between two segments is a placeholder's expansion (a run of visual tokens, or for
    Idefics3 also its tile markers), labelled -100. A segment after a placeholder is found at its first complete
    occurrence (the last segment at the end).
    """
    def in_span(start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in spans)

    segments: list[list[tuple[int, int, int]]] = [[]]
    for tid, (start, end) in zip(plain, offsets):
        if tid in visual:
            if segments[-1] or len(segments) == 1:
                segments.append([])
            continue
        segments[-1].append((tid, start, end))

    def mismatch(detail: str) -> DataError:
        return DataError(f"sample {sample_id!r}: cannot align the processor's tokens with the text ({detail})",
                         hint="check that the processor and tokenizer of the model folder belong together")

    labels: list[int] = []
    j = 0
    for k, seg in enumerate(segments):
        ids = [t for t, _, _ in seg]
        if k > 0:  # skip the expansion of the placeholder(s) before this segment
            last = k == len(segments) - 1
            if last:
                found = len(expanded) - len(ids)
                if found <= j or expanded[found:] != ids:
                    raise mismatch("text after the last image")
            else:
                found = next((i for i in range(j + 1, len(expanded) - len(ids) + 1) if expanded[i:i + len(ids)] == ids), -1)
                if found < 0:
                    raise mismatch("text between images")
            labels.extend([IGNORE_INDEX] * (found - j))
            j = found
        if expanded[j:j + len(ids)] != ids:
            raise mismatch(f"position {j}")
        labels.extend(t if in_span(a, b) else IGNORE_INDEX for t, a, b in seg)
        j += len(ids)
    if j != len(expanded):
        raise mismatch(f"{len(expanded) - j} extra tokens")
    return labels


def dummy_image_row(processor, family: Any = None) -> Encoded:
    """A row holding only one blank image's visual tokens, with no labels (contributes 0 to a summed loss).

    Appended to micro-batches without images so that every rank runs the vision tower every step: FSDP2 and
    ZeRO-3 gather the vision tower's parameters collectively, and a rank that skipped it would hang the others.
    """
    import torch
    from PIL import Image

    token = getattr(family, "image_prompt", None) or getattr(processor, "image_token", None) or processor.tokenizer.image_token
    side = _image_side(processor)
    out = processor(text=[token], images=[Image.new("RGB", (side, side), (0, 0, 0))], return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].to(torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    token_inputs, image_inputs = split_processor_outputs(out)
    visual = torch.isin(ids, torch.tensor(sorted(image_token_ids(processor)), dtype=torch.long))
    return Encoded(ids, labels, image_inputs, num_images=1, num_visual_tokens=int(visual.sum()), token_inputs=token_inputs)


def _image_side(processor) -> int:
    """A small side for the dummy image: the fixed input size where the processor resizes to one (LLaVA), else
    56 px, the smallest image Qwen-VL processors accept (their `size` is in pixels of area, not a side)."""
    size = getattr(getattr(processor, "image_processor", None), "size", None) or {}
    if isinstance(size, dict) and isinstance(size.get("height"), int):
        return size["height"]
    return 56


class Collator:
    """Samples -> one padded micro-batch.

    Returns a dict with `input_ids`, `attention_mask`, `labels` ([B, T], right padding), the concatenated image
    tensors, and counters that are not model inputs: `num_label_tokens`, `num_text_tokens`,
    `num_visual_tokens` (ints over the real samples) and `num_dummy_images` (0 or 1, see `dummy_image_row`).
    """

    def __init__(self, processor, family: Any = None, max_length: int | None = None, dummy_image: bool = True,
                 pad_to_multiple_of: int | None = None):
        self.processor = processor
        self.family = family
        self.max_length = max_length
        self.dummy_image = dummy_image
        self.pad_to_multiple_of = pad_to_multiple_of
        self._dummy: Encoded | None = None

    def encode(self, sample: Sample) -> Encoded:
        return encode_sample(sample, self.processor, self.family, self.max_length)

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        rows = [self.encode(s) for s in samples]
        return self.pad(rows)

    def pad(self, rows: list[Encoded]) -> dict[str, Any]:
        import torch

        real = rows
        dummy = 0
        if self.dummy_image and not any(r.num_images for r in rows):
            if self._dummy is None:
                self._dummy = dummy_image_row(self.processor, self.family)
            rows = [*rows, self._dummy]
            dummy = 1
        width = max(r.length for r in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        pad_id = self.processor.tokenizer.pad_token_id
        pad_id = 0 if pad_id is None else pad_id
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : r.length] = r.input_ids
            labels[i, : r.length] = r.labels
            attention_mask[i, : r.length] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        for k in sorted({k for r in rows for k in r.token_inputs}):
            batch[k] = torch.zeros((len(rows), width), dtype=next(r.token_inputs[k].dtype for r in rows if k in r.token_inputs))
            for i, r in enumerate(rows):
                if k in r.token_inputs:
                    batch[k][i, : r.length] = r.token_inputs[k]
        batch.update(_stack_images(rows))
        label_tokens = sum(int((r.labels[1:] != IGNORE_INDEX).sum()) for r in real)
        visual = sum(r.num_visual_tokens for r in real)
        batch["num_label_tokens"] = label_tokens
        batch["num_visual_tokens"] = visual
        batch["num_text_tokens"] = sum(r.length for r in real) - visual
        batch["num_dummy_images"] = dummy
        batch["num_samples"] = len(real)
        return batch


class PackedCollator(Collator):
    """Samples (one bin of `PackedBatchSampler`) -> one packed row of at most `tokens_per_batch` tokens.

    Returns `vlmctl.data.packing.pack_samples`' row: `input_ids`, `labels`, `position_ids` [1, T] (positions
    restart at 0 per sample), `packed_cu_seqlens` int32 [n + 1], `packed_max_seqlen`, the family's per-token
    tensors [1, T] and image tensors, `seq_lens` (list of tokens per sample), and the same counters as `Collator`
    (no `attention_mask`: transformers derives the per-sample causal mask from the position ids).

    The bins are planned on known lengths (the shards' `num_tokens`); a sample whose encoded length no longer fits
    (the processor changed since `data prepare`) is left out of the row and counted in `self.dropped` with a warning.
    A row without images gets the dummy image as one more zero-label sample (see `dummy_image_row`); so does an
    empty row, so every rank still runs one forward pass per micro-batch.
    """

    def __init__(self, processor, family: Any = None, max_length: int | None = None, *, tokens_per_batch: int,
                 dummy_image: bool = True):
        super().__init__(processor, family, max_length=max_length, dummy_image=dummy_image)
        self.tokens_per_batch = tokens_per_batch
        self.dropped = 0

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        rows, used = [], 0
        for s in samples:
            r = self.encode(s)
            if used + r.length > self.tokens_per_batch:
                self.dropped += 1
                warnings.warn(f"sample {s.id!r} ({r.length} tokens) does not fit its packed micro-batch of "
                              f"train.tokens_per_batch={self.tokens_per_batch} tokens (its planned length was stale): "
                              f"left out ({self.dropped} so far); re-run `vlmctl data prepare` with this model", stacklevel=2)
                continue
            rows.append(r)
            used += r.length
        return self.pack(rows)

    def pack(self, rows: list[Encoded]) -> dict[str, Any]:
        from vlmctl.data.packing import pack_samples

        real = rows
        dummy = 0
        if self.dummy_image and not any(r.num_images for r in rows) or not rows:
            if self._dummy is None:
                self._dummy = dummy_image_row(self.processor, self.family)
            rows = [*rows, self._dummy]
            dummy = 1
        batch = pack_samples([{"input_ids": r.input_ids, "labels": r.labels, **r.token_inputs, **r.image_inputs} for r in rows])
        visual = sum(r.num_visual_tokens for r in real)
        batch["num_label_tokens"] = sum(int((r.labels[1:] != IGNORE_INDEX).sum()) for r in real)
        batch["num_visual_tokens"] = visual
        batch["num_text_tokens"] = sum(r.length for r in real) - visual
        batch["num_dummy_images"] = dummy
        batch["num_samples"] = len(real)
        return batch


def _stack_images(rows: list[Encoded]) -> dict[str, Any]:
    """Image tensors of the batch. Most processors return images along dim 0 ([N_images, ...], Qwen: patches along
    dim 0 plus `image_grid_thw` [N_images, 3]): concatenated. Idefics3-style processors return [1, N, 3, H, W]
    per sample: stacked to [B, N_max, ...], zero-padded (all-zero images are skipped by those models)."""
    import torch

    keys = sorted({k for r in rows for k in r.image_inputs})
    per_sample = any(r.image_inputs.get("pixel_values") is not None and r.image_inputs["pixel_values"].ndim == 5 for r in rows)
    out = {}
    for k in keys:
        present = [r.image_inputs[k] for r in rows if k in r.image_inputs]
        if not per_sample:
            out[k] = torch.cat(present, dim=0)
            continue
        n = max(t.shape[1] for t in present)
        ref = present[0]
        stacked = torch.zeros((len(rows), n, *ref.shape[2:]), dtype=ref.dtype)
        for i, r in enumerate(rows):
            if k in r.image_inputs:
                t = r.image_inputs[k][0]
                stacked[i, : t.shape[0]] = t
        out[k] = stacked
    return out


COUNTER_KEYS = ("num_label_tokens", "num_visual_tokens", "num_text_tokens", "num_dummy_images", "num_samples", "seq_lens")


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without the counters and labels: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k not in COUNTER_KEYS and k != "labels"}


def is_packed(batch: dict[str, Any]) -> bool:
    """True for a `PackedCollator` row (one [1, T] row of several samples)."""
    return "packed_cu_seqlens" in batch
