"""Turn canonical samples into model inputs: chat template, media processing, assistant-only labels, padding
or packing.

Used by training (in DataLoader workers) and by evaluation (teacher-forced loss)::

    enc = encode_sample(sample, processor)       # one sample -> input_ids [T], labels [T], pixel_values [N, 3, H, W]
    batch = Collator(processor)([s1, s2, s3])    # samples -> padded tensors [B, T] + media tensors
    row = PackedCollator(processor, tokens_per_batch=4096)([s1, s2, s3])   # samples -> one packed row [1, T]

How the labels are found: the conversation is rendered with the processor's chat template; the character span
of each assistant turn is the difference between the template rendered up to that turn with
`add_generation_prompt=True` and rendered including it (so no template markers are parsed by hand). The text is
tokenized without image expansion (offsets give the token <-> character map), then aligned with the processor's
own output, where every image placeholder became its expansion (a run of visual tokens; Idefics3 adds tile
markers). Labels are the token ids inside assistant spans (their content and end-of-turn token) and -100
everywhere else: system and user turns, template markers and visual tokens never carry loss.

Media go through their modality units (`vlmctl.data.modalities`): a unit decodes its parts for the processor,
owns some of the processor's outputs and batches them, and gives the dummy input of ranks without that media.
Family-specific inputs are whatever the processor returns besides `input_ids`/`attention_mask`: per-token tensors
(Qwen-VL's `mm_token_type_ids`) are padded like `input_ids`; media tensors are batched by their unit (images:
`pixel_values`, `image_grid_thw`, ... concatenated along dim 0, or stacked per sample for processors that return
[1, N_images, ...] such as Idefics3; videos: `pixel_values_videos` [patches, C*t*p*p], `video_grid_thw` [N, 3],
`second_per_grid_ts` [N] concatenated along dim 0; audio: `input_features` [N, mel bins, frames] and
`feature_attention_mask` [N, frames] concatenated along dim 0). Videos are decoded stored clips (frames [T, H, W, 3]
uint8) passed with their metadata, written into the text as the family's video prompt; audio clips are mono float32
waveforms at the feature extractor's rate (`sampling_rate=` passed along), written as the family's audio prompt. What
differs per family comes from the family spec, never from its name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from vlmctl.data.modalities import UNITS, ModalityUnit, get_unit, media_token_ids, units_for
from vlmctl.data.modalities.image import decode_images
from vlmctl.data.sample import MODALITIES, Sample
from vlmctl.data.samplers import GROUP_MEDIA, modality_of
from vlmctl.errors import DataError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.

IGNORE_INDEX = -100
TEXT_KEYS = ("input_ids", "attention_mask")

__all__ = [
    "COUNTER_KEYS", "IGNORE_INDEX", "Collator", "Encoded", "PackedCollator", "PaddedPairCollator", "PairCollator",
    "assistant_spans", "batch_modality", "encode_pair",
    "decode_images", "dummy_image_row", "dummy_row", "encode_sample", "filler_row", "image_token_ids", "is_packed",
    "model_inputs", "split_processor_outputs", "template_media", "template_messages",
]


@dataclass
class Encoded:
    """One encoded sample. Tensors are 1-D over tokens (`input_ids`, `labels`: [T]); `media_inputs` holds, per
    modality, the processor's tensors of that media (images: `pixel_values` [N_images, 3, H, W], ...);
    `media_counts` the number of parts per modality; `num_visual_tokens` the placeholder-expanded media tokens."""

    input_ids: Any
    labels: Any
    media_inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    media_counts: dict[str, int] = field(default_factory=dict)
    num_visual_tokens: int = 0
    token_inputs: dict[str, Any] = field(default_factory=dict)  # other per-token tensors [T], padded with 0

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def image_inputs(self) -> dict[str, Any]:
        """The processor's image tensors (`media_inputs["image"]`)."""
        return self.media_inputs.get("image", {})

    @property
    def num_images(self) -> int:
        return self.media_counts.get("image", 0)


def template_media(sample: Sample, processor: Any = None, family: Any = None) -> tuple[list[dict], dict[str, list[bytes]]]:
    """The sample's messages in transformers' chat-template form, and its media bytes per modality in order of
    appearance.

    A media part becomes its unit's template part (`{"type": "image"}`; a video or audio clip, with a `processor`,
    the family's prompt as text: `VideoUnit.template_part`, `AudioUnit.template_part`); a part used twice is passed
    twice (processors consume one input per placeholder). Raises DataError for an index out of range, a modality
    without a unit, or a part of a modality `family` does not take (Qwen2-Audio and an image).
    """
    messages, media = [], {}
    for m in sample.messages:
        parts = []
        for p in m["content"]:
            kind = p["type"]
            if kind == "text":
                parts.append({"type": "text", "text": p.get("text") or ""})
                continue
            unit = get_unit(kind)
            if family is not None and not unit.accepted_by(family):
                raise _not_taken(kind, family, sample.id)
            stored = sample.media.get(kind, [])
            idx = p["index"]
            if not 0 <= idx < len(stored):
                raise DataError(f"sample {sample.id!r}: {kind} part points at {kind} {idx}, but the sample has {len(stored)}",
                                hint=f"re-run `vlmctl data prepare`; prepared samples keep {kind} indices in range")
            parts.append(unit.template_part(processor, family))
            media.setdefault(kind, []).append(stored[idx])
        messages.append({"role": m["role"], "content": parts})
    return messages, media


def _not_taken(kind: str, family: Any, sample_id: str) -> DataError:
    """The DataError of a `kind` part under a family that does not take it."""
    article = "an" if kind[0] in "aeiou" else "a"
    return DataError(f"family {getattr(family, 'name', family)} takes no {kind} input (it takes "
                     f"{', '.join(getattr(family, 'modalities', None) or ['image'])}), but sample {sample_id!r} has {article} {kind} part",
                     hint=f"drop the {kind} samples from data.sources, or train a family that takes {kind} input "
                     "(`vlmctl model build --list` shows each family's modalities)")


def template_messages(sample: Sample) -> tuple[list[dict], list[bytes]]:
    """`template_media` with the image bytes only (for image-only callers such as generation prompts)."""
    messages, media = template_media(sample)
    return messages, media.get("image", [])


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
    """Ids of tokens the processor expands into visual tokens: the placeholders of every modality it has (image,
    and video where present; `vlmctl.data.modalities.media_token_ids`)."""
    return media_token_ids(processor)


def _media_kwargs(media: dict[str, list[bytes]], processor: Any = None) -> dict[str, Any]:
    """The processor call's keywords for the modalities present: decoded parts, and e.g. videos' metadata or the
    audio's `sampling_rate` (units with `needs_processor` get the processor: the audio unit resamples to its feature
    extractor's rate)."""
    kwargs: dict[str, Any] = {}
    for kind, parts in media.items():
        if parts:
            unit = get_unit(kind)
            kwargs.update(unit.processor_inputs(parts, processor) if getattr(unit, "needs_processor", False) else unit.processor_inputs(parts))
    return kwargs


def encode_sample(sample: Sample, processor, family: Any = None, max_length: int | None = None) -> Encoded:
    """Encode one sample for teacher-forced training.

    Returns `Encoded` with `input_ids`/`labels` of shape [T] (int64; labels are -100 outside assistant turns) and
    the processor's media tensors per modality. `max_length` truncates text after the last media token; a sample
    whose media tokens would be cut raises DataError (prepare drops such samples as too_long).
    """
    import torch

    messages, media = template_media(sample, processor, family)
    text, spans = assistant_spans(messages, processor)
    proc_out = processor(text=[text], **_media_kwargs(media, processor), return_tensors="pt", add_special_tokens=False)
    if hasattr(family, "processor_outputs"):  # the family's layout for batching (e.g. padded anyres tiles dropped)
        proc_out = family.processor_outputs(proc_out, processor)
    ids = proc_out["input_ids"][0].to(torch.long)
    plain = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    visual = media_token_ids(processor)
    labels = _align_labels(ids.tolist(), plain["input_ids"], plain["offset_mapping"], spans, visual, sample.id)
    labels = torch.tensor(labels, dtype=torch.long)
    token_inputs, media_inputs = split_processor_outputs(proc_out)
    is_visual = torch.isin(ids, torch.tensor(sorted(visual), dtype=torch.long))
    if max_length is not None and ids.shape[0] > max_length:
        last_visual = int(is_visual.nonzero().max()) if is_visual.any() else -1
        if last_visual >= max_length:
            raise DataError(f"sample {sample.id!r} has {ids.shape[0]} tokens with visual tokens beyond max_length={max_length}",
                            hint="raise data.max_length, or re-run `vlmctl data prepare` which drops too-long samples")
        ids, labels, is_visual = ids[:max_length], labels[:max_length], is_visual[:max_length]
        token_inputs = {k: v[:max_length] for k, v in token_inputs.items()}
    counts = {kind: len(parts) for kind, parts in media.items()}
    return Encoded(ids, labels, media_inputs, counts, num_visual_tokens=int(is_visual.sum()), token_inputs=token_inputs)


def split_processor_outputs(out, units: list[ModalityUnit] | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(per-token tensors [T] such as Qwen's `mm_token_type_ids`, {modality: its tensors}) of a 1-sample processor
    output. A tensor belongs to the first of `units` (default: all registered) that owns it (before any shape test:
    one clip's `feature_attention_mask` [1, frames] may have the text's length), else it is a per-token tensor when
    it is [1, T], else it belongs to the catch-all unit (images)."""
    units = list(UNITS.values()) if units is None else units
    claimants = sorted(units, key=lambda u: u.catch_all)  # specific owners first
    length = out["input_ids"].shape[-1]
    token: dict[str, Any] = {}
    media: dict[str, dict[str, Any]] = {}
    for k, v in out.items():
        if k in TEXT_KEYS or not hasattr(v, "shape"):
            continue
        specific = next((u for u in claimants if not u.catch_all and u.owns(k)), None)
        if specific is not None:
            media.setdefault(specific.name, {})[k] = v
            continue
        if v.ndim == 2 and tuple(v.shape) == (1, length):
            token[k] = v[0]
            continue
        owner = next((u for u in claimants if u.owns(k) or u.catch_all), None)
        if owner is None:
            raise DataError(f"the processor returned {k!r}, which no modality unit takes",
                            hint="check that the processor of the model folder belongs to a supported family")
        media.setdefault(owner.name, {})[k] = v
    return token, media


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


def dummy_row(unit: ModalityUnit, processor, family: Any = None) -> Encoded:
    """A row holding only one blank input of `unit`'s modality (its placeholder prompt from the family spec, its
    media tokens), with no labels (contributes 0 to a summed loss).

    Appended to micro-batches without that media so that every rank runs its encoder every step: FSDP2 and
    ZeRO-3 gather the vision tower's parameters collectively, and a rank that skipped it would hang the others.
    """
    import torch

    extra = unit.call_kwargs(processor) if hasattr(unit, "call_kwargs") else {}  # e.g. the audio's sampling_rate
    out = processor(text=[unit.prompt(processor, family)], **{unit.processor_kwarg: [unit.dummy_input(processor)]}, **extra,
                    return_tensors="pt", add_special_tokens=False)
    if hasattr(family, "processor_outputs"):
        out = family.processor_outputs(out, processor)
    ids = out["input_ids"][0].to(torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    token_inputs, media_inputs = split_processor_outputs(out)
    visual = torch.isin(ids, torch.tensor(sorted(media_token_ids(processor)), dtype=torch.long))
    return Encoded(ids, labels, media_inputs, {unit.name: 1}, num_visual_tokens=int(visual.sum()), token_inputs=token_inputs)


def filler_row(processor, family: Any = None) -> Encoded:
    """A row of one short text (the tokenizer's end-of-sequence token) and no media, with no labels: the forward
    pass of an empty packed row in a modality-grouped text-only step, where no rank runs a media encoder."""
    import torch

    out = processor(text=[processor.tokenizer.eos_token or "."], return_tensors="pt", add_special_tokens=False)
    if hasattr(family, "processor_outputs"):
        out = family.processor_outputs(out, processor)
    ids = out["input_ids"][0].to(torch.long)
    token_inputs, media_inputs = split_processor_outputs(out)
    return Encoded(ids, torch.full_like(ids, IGNORE_INDEX), media_inputs, {}, token_inputs=token_inputs)


def dummy_image_row(processor, family: Any = None) -> Encoded:
    """`dummy_row` of the image unit: one blank image's visual tokens."""
    return dummy_row(UNITS["image"], processor, family)


def _counters(real: list[Encoded]) -> dict[str, int]:
    # counters over the real samples (not model inputs; `model_inputs` drops them)
    visual = sum(r.num_visual_tokens for r in real)
    return {
        "num_label_tokens": sum(int((r.labels[1:] != IGNORE_INDEX).sum()) for r in real),
        "num_visual_tokens": visual,
        "num_text_tokens": sum(r.length for r in real) - visual,
    }


def _collate_media(rows: list[Encoded], *, packed: bool) -> dict[str, Any]:
    """Media tensors of the batch: each modality's unit batches its tensors over `rows`."""
    out: dict[str, Any] = {}
    for name, unit in UNITS.items():
        if any(name in r.media_inputs for r in rows):
            out.update(unit.collate([r.media_inputs.get(name, {}) for r in rows], packed=packed))
    return out


class Collator:
    """Samples -> one padded micro-batch.

    Returns a dict with `input_ids`, `attention_mask`, `labels` ([B, T], right padding), the media tensors of
    each modality, and counters that are not model inputs: `num_label_tokens`, `num_text_tokens`,
    `num_visual_tokens`, `num_samples` (ints over the real samples) and per modality of the family
    `num_dummy_<column>` (`num_dummy_images`: 0 or 1, see `dummy_row`).

    `dummy_image=False` adds no dummy rows (single-process evaluation has no collective to keep in step).

    `grouped=True` (`train.group_by_modality`): the sampler gives every rank of an optimizer step samples of one
    modality group (`vlmctl.data.samplers.modality_of`), so an encoder no sample of that group can use
    (`GROUP_MEDIA`) runs on no rank and needs no dummy: a text-only step runs no media encoder, an image step no
    audio tower. Encoders the group may use keep their dummies (an audio step's samples may or may not have
    images). The group is read from the batch's samples (from the rows for `pad` / `pack` called directly).
    """

    def __init__(self, processor, family: Any = None, max_length: int | None = None, dummy_image: bool = True,
                 pad_to_multiple_of: int | None = None, grouped: bool = False):
        self.processor = processor
        self.family = family
        self.max_length = max_length
        self.dummy_image = dummy_image
        self.pad_to_multiple_of = pad_to_multiple_of
        self.grouped = grouped
        self.units = units_for(family)
        self._dummies: dict[str, Encoded] = {}

    def encode(self, sample: Sample) -> Encoded:
        return encode_sample(sample, self.processor, self.family, self.max_length)

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        rows = [self.encode(s) for s in samples]
        return self.pad(rows, group=batch_modality(samples))

    def with_dummies(self, rows: list[Encoded], *, never_empty: bool = False,
                     group: str | None = None) -> tuple[list[Encoded], dict[str, int]]:
        """`rows` plus one dummy row (see `dummy_row`) per modality of the family that no row has, and the
        dummy counters ({`num_dummy_images`: 0 or 1, ...}). `never_empty`: an empty `rows` gets the dummy rows
        even with `dummy_image=False` (a packed micro-batch must still run one forward pass). Units sharing an
        encoder (`ModalityUnit.encoder`: images and videos run the same vision tower) need no dummy when a row has
        parts of any of them. With `grouped`, only encoders of `group`'s media (`GROUP_MEDIA`; default: the rows'
        strongest group) get dummies, and an empty `rows` of a text-only step gets a `filler_row`."""
        counts = {u.dummy_counter: 0 for u in UNITS.values()}
        extra = []
        if self.grouped:
            group = group or modality_of({m: sum(r.media_counts.get(m, 0) for r in rows) for m in MODALITIES})
            used = {u.encoder for u in self.units if u.name in GROUP_MEDIA[group]}
        for unit in self.units:
            if self.grouped and unit.encoder not in used:  # no rank of this step runs that encoder
                continue
            sharing = [u.name for u in self.units if u.encoder == unit.encoder]
            needed = (self.dummy_image and not any(r.media_counts.get(name) for r in rows for name in sharing)) or (never_empty and not rows)
            if needed and unit.name not in self._dummies and unit.dummy_input(self.processor) is not None:
                self._dummies[unit.name] = dummy_row(unit, self.processor, self.family)
            counts[unit.dummy_counter] = int(needed and unit.name in self._dummies)
            if counts[unit.dummy_counter]:
                extra.append(self._dummies[unit.name])
        if never_empty and not rows and not extra:  # grouped text-only step: one forward pass without media
            extra.append(filler_row(self.processor, self.family))
        return [*rows, *extra], counts

    def pad(self, rows: list[Encoded], group: str | None = None) -> dict[str, Any]:
        import torch

        real = rows
        rows, dummies = self.with_dummies(rows, group=group)
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
        batch.update(_collate_media(rows, packed=False))
        batch.update(_counters(real))
        batch.update(dummies)
        batch["num_samples"] = len(real)
        return batch


class PackedCollator(Collator):
    """Samples (one bin of `PackedBatchSampler`) -> one packed row of at most `tokens_per_batch` tokens.

    Returns `vlmctl.data.packing.pack_samples`' row: `input_ids`, `labels`, `position_ids` [1, T] (positions
    restart at 0 per sample), `packed_cu_seqlens` int32 [n + 1], `packed_max_seqlen`, the family's per-token
    tensors [1, T], `seq_lens` (list of tokens per sample); the media tensors of each modality, and the same
    counters as `Collator` (no `attention_mask`: transformers derives the per-sample causal mask from the
    position ids).

    The bins are planned on known lengths (the shards' `num_tokens`); a sample whose encoded length no longer fits
    (the processor changed since `data prepare`) is left out of the row and counted in `self.dropped` with a warning.
    A row without images or videos gets the dummy image as one more zero-label sample (see `dummy_row`); so does
    an empty row, so every rank still runs one forward pass per micro-batch (with `grouped`, only the dummies of
    encoders its step's modality group may use, see `Collator`; an empty text-only row gets a `filler_row`).
    """

    def __init__(self, processor, family: Any = None, max_length: int | None = None, *, tokens_per_batch: int,
                 dummy_image: bool = True, grouped: bool = False):
        super().__init__(processor, family, max_length=max_length, dummy_image=dummy_image, grouped=grouped)
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
        return self.pack(rows, group=batch_modality(samples))  # the samples' group, even if all were left out

    def pack(self, rows: list[Encoded], group: str | None = None) -> dict[str, Any]:
        from vlmctl.data.packing import pack_samples

        real = rows
        rows, dummies = self.with_dummies(rows, never_empty=True, group=group)
        batch = pack_samples([{"input_ids": r.input_ids, "labels": r.labels, **r.token_inputs} for r in rows])
        batch.update(_collate_media(rows, packed=True))
        batch.update(_counters(real))
        batch.update(dummies)
        batch["num_samples"] = len(real)
        return batch


def encode_pair(collator: Collator, sample: Sample) -> tuple[Encoded, Encoded]:
    """(chosen, rejected) of a preference pair, each the prompt with its media followed by one answer
    (`Sample.chosen_messages`, `Sample.rejected_sample`), encoded by `collator`. Raises DataError for a sample
    without a rejected answer."""
    if not sample.is_preference:
        raise DataError(f"sample {sample.id!r} has no rejected answer: a preference objective trains on pairs",
                        hint="prepare preference data (data.kind: preference), or set train.objective: sft")
    return collator.encode(sample), collator.encode(sample.rejected_sample())  # a pair encodes as its chosen answer


class PairCollator(PackedCollator):
    """Preference pairs (samples with a `rejected` answer, `Sample.is_preference`) -> one packed row in which each
    pair is two consecutive segments, chosen then rejected (`encode_pair`), as `vlmctl.train.dpo.pair_segments`
    reads them.

    Returns `PackedCollator`'s row plus `num_pairs` (pairs in the row; their segments come first, the dummy rows
    after) and `pair_ids` (the pairs' sample ids, in row order). A pair whose two sequences no longer fit the row's `tokens_per_batch` is left out whole (counted in
    `self.dropped`). Raises DataError for a sample without a rejected answer."""

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        rows, used, pairs, ids = [], 0, 0, []
        for s in samples:
            chosen, rejected = encode_pair(self, s)
            if used + chosen.length + rejected.length > self.tokens_per_batch:
                self.dropped += 1
                warnings.warn(f"preference pair {s.id!r} ({chosen.length} + {rejected.length} tokens) does not fit its "
                              f"packed micro-batch of train.tokens_per_batch={self.tokens_per_batch} tokens: left out "
                              f"({self.dropped} so far); re-run `vlmctl data prepare` with this model", stacklevel=2)
                continue
            rows += [chosen, rejected]
            used += chosen.length + rejected.length
            pairs += 1
            ids.append(s.id)
        batch = self.pack(rows, group=batch_modality(samples))
        batch["num_pairs"] = pairs
        batch["pair_ids"] = ids
        return batch


class PaddedPairCollator(Collator):
    """Preference pairs -> one padded micro-batch (`train.packing: false`, or a family that cannot pack): rows 2k
    and 2k + 1 are pair k's chosen and rejected sequence (`encode_pair`), right-padded, the dummy rows after them;
    TRL's `DPOTrainer` concatenates a padded batch of chosen and rejected rows alike. Returns `Collator`'s batch
    plus `num_pairs` and `pair_ids`. Raises DataError for a sample without a rejected answer."""

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        rows, ids = [], []
        for s in samples:
            rows += encode_pair(self, s)
            ids.append(s.id)
        batch = self.pad(rows, group=batch_modality(samples))
        batch["num_pairs"] = len(ids)
        batch["pair_ids"] = ids
        return batch


def batch_modality(samples: list[Sample]) -> str:
    """The strongest modality group of `samples` (`modality_of` over the part types of all their messages): the
    step's group when the sampler groups by modality."""
    counts: dict[str, int] = {}
    for s in samples:
        for m in s.messages:
            for p in m["content"]:
                counts[p["type"]] = counts.get(p["type"], 0) + 1
    return modality_of(counts)


COUNTER_KEYS = ("num_label_tokens", "num_visual_tokens", "num_text_tokens", *(u.dummy_counter for u in UNITS.values()),
                "num_samples", "seq_lens", "num_pairs", "pair_ids")


TOWER_INPUTS_KEY = "vision_tower_inputs"
"""The batch key of a vision tower's inputs computed ahead of the step (`vlmctl.train.tower_inputs`: handed to the
tower by a hook, not to the model's forward)."""

NOT_INPUTS = (*COUNTER_KEYS, "labels", TOWER_INPUTS_KEY)
"""Batch keys the model's forward does not take: the counters, the labels, and a vision tower's precomputed inputs."""


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without the counters, labels and precomputed tower inputs (`NOT_INPUTS`): what the model's forward
    takes."""
    return {k: v for k, v in batch.items() if k not in NOT_INPUTS}


def is_packed(batch: dict[str, Any]) -> bool:
    """True for a `PackedCollator` row (one [1, T] row of several samples)."""
    from vlmctl.families.spec import is_packed as packed  # one definition of the marker, with the families

    return packed(batch)
