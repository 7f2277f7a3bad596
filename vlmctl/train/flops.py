"""The cost model of a training sample: matmul FLOPs per term, for MFU, `vlmctl bench` and compute-balanced batching.

    cost = CostModel.from_model(model, family, trainable_parts={"projector", "llm"})
    cost.batch_flops(batch)                                   # one collated micro-batch (packed or padded)
    cost.sample_flops(text_tokens=300, labelled_tokens=40, image_grids=[(1, 28, 42)])   # one sample
    cost.sample_flops(text_tokens=60, labelled_tokens=20, audio_frames=[3000], visual_tokens=125)  # one audio sample
    cost.sample_costs(tokens, visual_tokens, labelled_tokens, images)  # N samples from counts (arrays [N])
    mfu(flops, seconds, peak_flops(device), world_size)

Everything is read from the model (parameter shapes, config) and from the batch's shapes, through the family spec:
the parts' module paths (`vlmctl.families.part_of_parameter`) and its encoders (`family.encoders`), each with its
cost rule (`vlmctl.families.encoders`: `vision_cost` for image encoders, with the family's merger, windows, pixel
shuffle or feature-layer settings, `audio_cost` for Whisper-style audio towers). Every encoder is the `vision` part
for freezing and backward factors; an audio encoder gets the `audio` terms below, an image encoder the `vision` ones
(Qwen2.5-Omni has both). An encoder whose cost rule returns a `vlmctl.families.encoders.CountsItself` counts itself
(Qwen3-Omni's chunked audio encoder, Phi-4-multimodal's crops and conformer), so this module names no family: the
rule's result has `paths`, the module paths whose parameters it charges (its encoder's, its projectors'; the counts
here leave them out), `batch_terms(batch, cost_model)` and `sample_terms(tokens, items, cost_model)`, its training
FLOPs in terms of `TERMS` under this cost model's backward factors (`weight_factor`, `attention_factor`) for a
micro-batch and for samples known by their counts, which `batch_terms` and `sample_costs(media=...)` add.
`sample_flops` leaves such encoders out (it counts the rest of the sample).

Counted FLOPs are those of the matrix multiplications (linear layers, convolutions, attention's two matmuls), as in
Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", sec. 2.1) and Hoffmann et al. 2022 (Chinchilla,
appendix F) and as `torch.utils.flop_counter.FlopCounterMode` counts them. Norms, activations, softmax, rotary
embeddings, biases and embedding lookups add O(d) FLOPs per token against O(d^2) and are left out. Each term below
is given for the forward pass; training multiplies it by a backward factor (next section).

Terms (N_x = parameters of the weight matrices and convolution kernels of x, biases, norm scales and embeddings
excluded; d_x = attention width = heads x head_dim; L_x = layers), forward FLOPs:

    vision            2 * N_vision * (patches + cls)               Kaplan: 2N per token (the patch-embedding
                                                                   convolution: once per patch)
    vision_attention  4 * d_v * sum_layers sum_blocks s_b^2         Chinchilla app. F: QK^T 2*s^2*d + scores.V
                                                                   2*s^2*d; bidirectional, no causal halving
    audio             sum_convs 2 * N_conv * positions_conv        Whisper-style encoder: the convolution stem
                      + 2 * N_audio * positions                    (each kernel once per output position), then
                                                                   the layers on the stem's output positions
    audio_attention   4 * d_a * L_a * positions^2 per clip         bidirectional over the clip's positions
    projector         2 * N_projector * visual_tokens              the merger / connector runs on visual tokens
                                                                   (audio: on the tower's pooled rows)
    llm               2 * N_llm * tokens                           input embedding excluded (a lookup)
    lm_head           2 * vocab * d * labelled_tokens              logits are computed only where a label is
    llm_attention     4 * d_llm * L_llm * sum_segments s^2 / 2     causal: half the s^2 scores (PaLM app. B counts
                                                                   the full 12 * L * d * s per token of training)

- Mixture-of-experts language models (Qwen3-VL-MoE, any config with `num_experts_per_tok` and `num_experts` or
  `num_local_experts`): a token runs through `num_experts_per_tok` of the experts, so the expert weights (parameters
  under an `experts` module, stacked [experts, ...] or one module per expert) count in N_llm by top_k / experts;
  the router and the dense layers count in full (Switch Transformer, Fedus et al. 2022, sec. 2: FLOPs per token
  follow the active parameters, not the total).
- Vision attention blocks `s_b`, per image: Qwen2.5-VL (transformers `modeling_qwen2_5_vl`
  `Qwen2_5_VisionTransformerPretrainedModel.forward` and `vision_utils.get_vision_window_index`) runs window
  attention in every layer except `fullatt_block_indexes`: windows of `window_size` px, i.e.
  `window_size // spatial_merge_size // patch_size` merged tokens a side, (window_size / patch_size)^2 = 64 patches
  for 112 px / 14 px; the windows at the right and bottom edges are partial (exact sizes when the image grid is
  known, else every window is taken as full). Full-attention layers, and every layer of a vision config without
  `window_size` (Qwen2-VL, Qwen3-VL, CLIP, SigLIP, Idefics3), attend over one frame of one image: s = h * w patches
  (+1 for a CLS token, `vlmctl.families.CLS_VISION_TYPES`). Layers after LLaVA's `vision_feature_layer` run
  forward only (their output is not used).
- Patches per image: t * h * w from `image_grid_thw` when the batch has it, else (H / patch_size) * (W / patch_size)
  from `pixel_values` [N, C, H, W] (LLaVA) or [B, N, C, H, W] with all-zero padding images skipped (Idefics3).
  Videos (Qwen2/2.5-VL, `video_grid_thw`): t * h * w patches per clip, t = frames / temporal_patch_size (2): one
  patch embeds two frames (the patch-embedding convolution's kernel spans them, so its parameters count that), and
  attention runs per temporal slice of h * w patches, like an image of t frames (transformers
  `Qwen2_5_VisionTransformerPretrainedModel.forward`: `cu_seqlens` repeats h * w for each of the t slices).
- Visual tokens (the projector's rows, also part of the language model's tokens): the batch's image and video
  placeholder tokens (`config.image_token_id`, `config.video_token_id`); from counts, patches /
  spatial_merge_size^2 (Qwen's merger: transformers `Qwen2_5_VLPatchMerger` concatenates spatial_merge_size^2
  neighbouring patches before its MLP), patches / scale_factor^2 (Idefics3's pixel shuffle), or patches (+ CLS with
  `vision_feature_select_strategy: full`, LLaVA).
- Audio clips (Qwen2-Audio, transformers `modeling_qwen2_audio` `Qwen2AudioEncoder.forward`, which is Whisper's
  encoder, Radford et al. 2022, plus an average pooling): `input_features` [N_clips, mel bins, F] with F the
  feature extractor's window (2 x max_source_positions frames, 30 s for Whisper: it pads every clip to that, and the
  encoder refuses any other length). conv1 (kernel 3, stride 1) runs at F positions, conv2 (kernel 3, stride 2) at
  F / 2 = max_source_positions positions, which the layers and their attention see; the pooling (2, stride 2)
  leaves F / 4 rows, all of which go through the projector before the rows past the clip's audio tokens are
  dropped. The padded frames of a short clip are counted: the model computes them in every layer
  (`feature_attention_mask` only hides them as attention keys) and no layout of the batch avoids them, as the
  padding of a LLaVA `pad` image is counted; the collator's padding of token rows is not. N_audio: the tower's
  matrices other than the stem's convolutions (the layers); d_a: d_model; the clip's audio tokens (its
  `<|AUDIO|>` placeholders, `config.audio_token_id`) are language-model tokens like visual ones.
- Audio clips of Qwen2.5-Omni (transformers `Qwen2_5OmniAudioEncoder.forward`, `audio_cost(chunk_key="n_window")`):
  the tower takes a clip's real frames only (the `feature_attention_mask` sums), cut into chunks of 2 x n_window
  frames; the stem runs on every chunk of the batch padded to the longest, the layers on each chunk's real output
  positions, attention within each chunk, the pooling per clip (`AudioShape.batch_counts`).
- Projector rows: a projector is charged to the encoder it sits in (Qwen's merger, Qwen2.5-Omni's audio `proj`),
  else to the family's only encoder: visual tokens through the image encoder's, pooled clip rows through the audio
  encoder's (`audio_projector_params`).
- Language-model segments: a packed row's `seq_lens` (or `packed_cu_seqlens`), a padded batch's per-row
  `attention_mask` sums. Only real tokens count: padding, and the full T^2 scores an eager or SDPA kernel computes
  over a packed row, are not useful work. Layers listed as `sliding_attention` in the text config's `layer_types`
  attend over at most `sliding_window` keys.
- Labelled tokens: positions t > 0 whose label is not -100, the targets the loss is taken on (the trainer passes
  their positions as `logits_to_keep`). A padded batch whose loss takes full logits does more head work than this;
  the extra is not counted either.

Backward factors, per part in forward order vision -> projector -> llm. The forward pass costs 2 FLOPs per parameter
per token; the backward pass 2 more for the activations' gradient (needed in a part when it or any earlier part is
trained: the gradient has to travel through it) and 2 more for the weights' gradient (when the part's weights are
trained). A fully trained model costs Kaplan's 6N (PaLM appendix B: training = 3x the forward pass).

    part        trained            frozen, an earlier part trained      frozen, nothing earlier trained
    weights     6                  4                                    2 (forward only)
    attention   3 x forward        3 x forward                          1 x forward

So a frozen vision tower costs its forward pass only, while a frozen language model behind a trained projector
(`stage: align`) still back-propagates its activations (4N). The layer that reads a part's input (the vision
tower's patch-embedding convolution, the audio tower's first convolution over the mel features; a projector's
first linear layer unless a norm with weights comes before it) needs no input gradient when nothing earlier is
trained: 4 instead of 6 when trained. The audio tower takes the `vision` part's factors. LoRA (`lora=True`, "llm"
trained): the language model's weights get no gradient but its activations do, so it counts as a frozen language
model the gradient travels through (4N); the adapters' own FLOPs (a fraction r / d of the adapted layers') are not
counted. Recomputation by activation checkpointing is not useful work and is not counted (PaLM appendix B's model
FLOPs, not hardware FLOPs). On tiny models of every family these terms equal what `FlopCounterMode` counts for a
forward + backward pass, up to the causal half (tests/unit/test_flops.py).

Per-sample costs for compute-balanced batching (`sample_costs`) use the same terms on the counts a sampler has
before collation: the sample's tokens (`num_tokens` of the prepared shards), its visual and labelled tokens and
its number of images (of an audio model: its audio tokens and clips, each clip a whole window). Prepared shards
record the total and each media item's tokens (`media_tokens`); `vlmctl.data.loader.ShardDataset.count_estimates`
derives the rest (its docstring says how), per modality too, so that each encoder is charged its own modalities'
items and tokens (an encoder that counts itself by its `sample_terms`); images are taken as equal-sized, one frame
each, with full windows. Without the per-modality counts a model with both an image and an audio encoder
(Qwen2.5-Omni) has each media item taken as an image and as a clip, and encoders that count themselves are left
out. What a balancer needs is the ranking and the ratios of samples' costs, which the tokens and the quadratic
attention term dominate.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per second / (peak FLOP/s per device x devices), see
`mfu`; the peak figures come from `vlmctl.train.metrics.peak_flops`.

Not modelled: Qwen3-VL's deepstack additions (elementwise), the first decoder
layer's input gradient that LoRA with nothing earlier trained does not need.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from vlmctl.errors import DataError, ModelError
from vlmctl.families.encoders import AudioShape, CountsItself, ImageShape, VisionShape, submodule as _submodule

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.

__all__ = ["TERMS", "AudioShape", "CostModel", "ImageShape", "VisionShape", "batch_audio_frames", "batch_images",
           "batch_segments", "mfu"]

TERMS = ("vision", "vision_attention", "audio", "audio_attention", "projector", "llm", "lm_head", "llm_attention")
"""The terms of `CostModel.sample_terms` / `batch_terms`, in forward order."""

PART_ORDER = ("vision", "projector", "llm")
IGNORE_INDEX = -100  # label of positions without a target (transformers' convention, as in vlmctl.data.collate)


def _audio_totals(audio: AudioShape | None, frames: Sequence[int]) -> dict[str, Any] | None:
    """`AudioShape.counts` summed over the clips of a batch of `frames` mel frames each (`AudioShape.batch_counts`);
    None without clips or an audio tower."""
    if audio is None or not frames:
        return None
    return audio.batch_counts([int(f) for f in frames])


@dataclass(frozen=True)
class CostModel:
    """Training FLOPs of samples and micro-batches of one model (formulas and sources: module docstring).

    Parameter counts are of weight matrices / convolution kernels, embeddings excluded; `*_input_params` are the
    layers reading a part's input (see the module docstring). `trained`: parts whose weights get gradients;
    `grad_through`: parts the gradient travels through (a part at or before them is trained).
    """

    vision_params: int
    vision_input_params: int
    projector_params: int
    projector_input_params: int
    llm_params: int
    head_params: int
    vision: VisionShape | None
    llm_width: int
    llm_full_layers: int
    llm_sliding_layers: int
    sliding_window: int | None
    image_token_id: int | None
    trained: frozenset[str]
    grad_through: frozenset[str]
    video_token_id: int | None = None
    audio: AudioShape | None = None  # the tower is an audio encoder (its convolutions are `audio.stem`)
    audio_params: int = 0  # the audio tower's matrices other than the stem (its layers)
    audio_projector_params: int = 0  # the projector of the audio tower's pooled rows (the others: of visual tokens)
    audio_projector_input_params: int = 0
    own_terms: tuple[CountsItself, ...] = ()  # the encoders whose cost rules count them (module docstring)
    # the modalities each encoder encodes (`EncoderSpec.modalities`): the image encoder's, the audio encoder's, and
    # those of each of `own_terms`, in order; what `sample_costs(media=...)` charges to each
    vision_media: tuple[str, ...] = ("image", "video")
    audio_media: tuple[str, ...] = ("audio",)
    own_media: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def from_model(cls, model, family, trainable_parts: set[str], *, lora: bool = False) -> "CostModel":
        """The cost model of `model`, an unwrapped HF VLM of `family` (a `vlmctl.families` spec; any device, meta
        included), trained on `trainable_parts` (subset of {"vision", "projector", "llm"}). `lora`: the language
        model is trained through LoRA adapters (its weights get no gradient, its activations do). Count on the model
        before peft wraps it: peft's `modules_to_save` copies would be counted twice.

        The encoders are the family's (`family.encoders`), each counted by its own cost rule
        (`vlmctl.families.encoders.vision_cost` / `audio_cost`): an image encoder gives `vision` (its matrices
        `vision_params`, its convolutions `vision_input_params`), an audio encoder `audio` (its convolutions are the
        stem, its other matrices `audio_params`). Both are the `vision` part for freezing and backward factors. A
        rule returning a `vlmctl.families.encoders.CountsItself` counts its encoder itself (`own_terms`, module
        docstring).

        Raises ModelError for unknown part names, a family with more than one image or audio encoder, a vision
        config without width / depth / patch size, an audio config without the keys `audio_cost` reads, or a cost
        rule whose result is none of these.
        """
        unknown = set(trainable_parts) - set(PART_ORDER)
        if unknown:
            raise ModelError(f"unknown model parts {sorted(unknown)}", hint=f"parts are {', '.join(PART_ORDER)}")
        shapes: dict[type, tuple[str, Any]] = {}
        media: dict[type, tuple[str, ...]] = {}
        own: list[CountsItself] = []
        own_media: list[tuple[str, ...]] = []
        for name, encoder in family.encoders.items():
            shape = encoder.shape(model)
            if shape is None:
                continue
            if isinstance(shape, CountsItself):
                own.append(shape)
                own_media.append(tuple(encoder.modalities))
                continue
            if not isinstance(shape, (VisionShape, AudioShape)):
                raise ModelError(f"family {family.name}: the cost rule of encoder {name} returned a {type(shape).__name__}",
                                 hint="a cost rule returns a VisionShape, an AudioShape or a CountsItself "
                                      "(vlmctl.families.encoders)")
            media[type(shape)] = tuple(encoder.modalities)
            if type(shape) in shapes:
                raise ModelError(f"family {family.name} has two {type(shape).__name__} encoders ({shapes[type(shape)][0]}, {name}); "
                                 "the cost model counts one of each", hint="count FLOPs without this family's cost model")
            shapes[type(shape)] = (name, shape)
        vision = shapes.get(VisionShape, (None, None))[1]
        audio_name, audio = shapes.get(AudioShape, (None, None))
        counts = _param_counts(model, family, audio_encoder=audio_name, owned=tuple(p for o in own for p in o.paths))
        config = model.config
        text = config.get_text_config()
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        types = list(getattr(text, "layer_types", None) or [])
        window = getattr(text, "sliding_window", None)
        sliding = sum(t == "sliding_attention" for t in types) if window else 0
        trained = {p for p in trainable_parts if not (lora and p == "llm")}
        first = min((PART_ORDER.index(p) for p in trainable_parts), default=len(PART_ORDER))
        image_id = getattr(config, "image_token_id", None)
        return cls(
            **counts, vision=vision,
            llm_width=heads * int(head_dim), llm_full_layers=int(text.num_hidden_layers) - sliding,
            llm_sliding_layers=sliding, sliding_window=int(window) if sliding else None,
            image_token_id=getattr(config, "image_token_index", None) if image_id is None else image_id,
            trained=frozenset(trained), grad_through=frozenset(PART_ORDER[first:]),
            video_token_id=getattr(config, "video_token_id", None), audio=audio, own_terms=tuple(own),
            vision_media=media.get(VisionShape, ()), audio_media=media.get(AudioShape, ()), own_media=tuple(own_media),
        )

    # ---- backward factors ----

    def weight_factor(self, part: str, *, input_layer: bool = False) -> int:
        """FLOPs per parameter per token of `part`: 2 forward, +2 activations' gradient, +2 weights' gradient.
        `input_layer`: for the layer reading the part's input, whose input gradient only an earlier trained part
        needs."""
        earlier = PART_ORDER[: PART_ORDER.index(part)]
        needs_input_grad = any(p in self.grad_through for p in earlier) if input_layer else part in self.grad_through
        return 2 + 2 * needs_input_grad + 2 * (part in self.trained)

    def attention_factor(self, part: str) -> int:
        """Training / forward ratio of a part's attention (no weights): 3 when the gradient passes through, else 1."""
        return 3 if part in self.grad_through else 1

    # ---- terms ----

    def _terms(self, segments: Sequence[int], labelled: int, images: Sequence[ImageShape],
               visual_tokens: int, audio_frames: Sequence[int] = ()) -> dict[str, float]:
        """Training FLOPs per term (see TERMS) of LLM `segments` (tokens per attention segment), `labelled` targets,
        `images` through the vision tower and `visual_tokens` through the projector, clips of `audio_frames` mel
        frames each through the audio tower (and their pooled rows through the projector)."""
        vision = self.vision if images else None
        terms = self._combine(
            tokens=sum(segments), llm_pairs=sum(self.llm_pairs(s) for s in segments), labelled=labelled,
            visual=visual_tokens, patches=sum(im.patches for im in images),
            frames=sum((im.grid[0] if im.grid else 1) for im in images),
            vision_pairs=sum(vision.attention_pairs(im) for im in images) if vision is not None else 0,
            audio=_audio_totals(self.audio, audio_frames))
        return {k: float(v) for k, v in terms.items()}

    def llm_pairs(self, s):
        """Query-key pairs of one causal segment of `s` tokens summed over the language model's layers (full layers
        see s^2 / 2, sliding ones at most `sliding_window` keys per query). Elementwise over a numpy array."""
        return self.llm_full_layers * s * s / 2 + self.llm_sliding_layers * _causal_pairs(s, self.sliding_window)

    def _combine(self, *, tokens, llm_pairs, labelled, visual, patches, frames, vision_pairs,
                 audio: dict[str, Any] | None = None) -> dict[str, Any]:
        """The terms' formulas (module docstring), from a batch's or a sample's totals: LLM `tokens`, `llm_pairs`
        (`llm_pairs` summed over segments), `labelled` targets, `visual` tokens (the projector's rows from images),
        vision-tower `patches`, image `frames` (one CLS position each), `vision_pairs`
        (`VisionShape.attention_pairs` summed) and `audio` (`AudioShape.counts` summed over clips; None: no clip).
        Scalars or numpy arrays of samples, elementwise."""
        terms = dict.fromkeys(TERMS, 0.0)
        if self.vision is not None:
            v = self.vision
            live = (v.layers - v.unused_layers) / v.layers  # layers past the last feature layer run forward only
            positions = patches + v.cls * frames
            terms["vision"] = ((self.weight_factor("vision") * live + 2 * (1 - live)) * self.vision_params * positions
                               + self.weight_factor("vision", input_layer=True) * self.vision_input_params * patches)
            terms["vision_attention"] = (self.attention_factor("vision") * live + (1 - live)) * 4.0 * v.width * vision_pairs
        per_token = (self.weight_factor("projector") * self.projector_params
                     + self.weight_factor("projector", input_layer=True) * self.projector_input_params)
        terms["projector"] = visual * per_token
        if self.audio is not None and audio is not None:
            a = self.audio
            # the first convolution reads the mel features (no input gradient); the tower is the `vision` part
            factors = [self.weight_factor("vision", input_layer=True)] + [self.weight_factor("vision")] * (len(a.stem) - 1)
            terms["audio"] = (sum(f * conv[0] * n for f, conv, n in zip(factors, a.stem, audio["stem"]))
                              + self.weight_factor("vision") * self.audio_params * audio["positions"])
            terms["audio_attention"] = self.attention_factor("vision") * 4.0 * a.width * a.layers * audio["pairs"]
            per_row = (self.weight_factor("projector") * self.audio_projector_params
                       + self.weight_factor("projector", input_layer=True) * self.audio_projector_input_params)
            terms["projector"] = terms["projector"] + audio["rows"] * per_row
        terms["llm"] = self.weight_factor("llm") * self.llm_params * tokens
        terms["lm_head"] = self.weight_factor("llm") * self.head_params * labelled
        terms["llm_attention"] = self.attention_factor("llm") * 4.0 * self.llm_width * llm_pairs
        return terms

    def sample_terms(self, *, text_tokens: int, labelled_tokens: int, image_patches: Sequence[int] = (),
                     image_grids: Sequence[Sequence[int]] = (), visual_tokens: int | None = None,
                     audio_frames: Sequence[int] = ()) -> dict[str, float]:
        """`sample_flops` per term (FLOPs, keys TERMS)."""
        images = [ImageShape(int(t) * int(h) * int(w), (int(t), int(h), int(w))) for t, h, w in image_grids]
        images += [ImageShape(int(p)) for p in image_patches]
        clips = [int(f) for f in audio_frames] if self.audio is not None else []
        if visual_tokens is None:
            visual_tokens = sum(self.vision.visual_tokens(im) for im in images) if self.vision else 0
            visual_tokens += sum(self.audio.counts(f)["rows"] for f in clips)
        # an audio model's media tokens are audio tokens: the projector's rows are the clips' pooled windows
        projected = int(visual_tokens) if self.audio is None else 0
        return self._terms([int(text_tokens) + int(visual_tokens)], int(labelled_tokens), images, projected, clips)

    def sample_flops(self, *, text_tokens: int, labelled_tokens: int, image_patches: Sequence[int] = (),
                     image_grids: Sequence[Sequence[int]] = (), visual_tokens: int | None = None,
                     audio_frames: Sequence[int] = ()) -> float:
        """Training FLOPs of one sample from its counts (for compute-balanced batching).

        `text_tokens`: its non-visual tokens; `labelled_tokens`: targets the loss is taken on; images given as
        `image_patches` (patches per image: t * h * w; window attention then assumes full windows) and/or
        `image_grids` ((t, h, w) patch grids per image: exact windows); audio clips (an audio model; ignored by
        others) as `audio_frames`, mel frames per clip as the encoder takes them (`AudioShape.window` for
        Whisper-style encoders: every clip is padded to the window); `visual_tokens`: placeholder tokens of its
        images or clips (default: derived from the patches and the vision config; a clip as its pooled rows, i.e.
        as long as its frames). The sample's sequence is text_tokens + visual_tokens tokens, attended as one causal
        segment.
        """
        terms = self.sample_terms(text_tokens=text_tokens, labelled_tokens=labelled_tokens, image_patches=image_patches,
                                  image_grids=image_grids, visual_tokens=visual_tokens, audio_frames=audio_frames)
        return sum(terms.values())

    def sample_costs(self, tokens, visual_tokens, labelled_tokens, images, *,
                     media: Mapping[str, Mapping[str, Any]] | None = None) -> np.ndarray:
        """Training FLOPs of each of N samples from the counts a sampler knows before collation (compute-balanced
        batching, `vlmctl.data.packing.balance_bins`): `tokens` (text + visual, the prepared `num_tokens`),
        `visual_tokens`, `labelled_tokens` and `images` (media items per sample), arrays [N]. Returns float64 [N].

        The same terms as `sample_flops`, vectorized: a sample is one causal segment of `tokens` tokens; its images'
        patches are (visual_tokens - images x CLS tokens kept) x patches per visual token (`VisionShape`), split
        evenly among its images, each one frame, windows taken as full (as `sample_flops(image_patches=...)`); an
        audio encoder's clips are each a whole window (`sample_flops(audio_frames=[window] * clips, ...)`).

        `media`: the same counts per modality, {modality: {"tokens": [N], "items": [N]}}
        (`vlmctl.data.loader.ShardDataset.count_estimates`' `media`): each encoder is then charged the items and
        placeholder tokens of its own modalities (`vision_media`, `audio_media`, `own_media`), and an encoder that
        counts itself adds its `CountsItself.sample_terms`. Without it every item is taken as one of the image
        encoder's and as one of the audio encoder's (a clip), and encoders that count themselves are left out.
        """
        tokens, visual, labelled, images = (np.asarray(x, dtype=np.float64) for x in (tokens, visual_tokens, labelled_tokens, images))
        zero = np.zeros_like(tokens)

        def counts(modalities: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
            picked = [media[m] for m in modalities if m in media]
            return (sum((np.asarray(c["tokens"], dtype=np.float64) for c in picked), zero),
                    sum((np.asarray(c["items"], dtype=np.float64) for c in picked), zero))

        if media is None:  # every item an image (an audio model's: a clip)
            (visual_v, frames), clips = (visual, images), images
        else:
            (visual_v, frames), (_, clips) = counts(self.vision_media), counts(self.audio_media)
        patches = vision_pairs = zero
        v, audio, projected = self.vision, None, visual_v
        if v is not None:
            patches = np.where(frames > 0, np.maximum(visual_v - v.keep_cls * frames, 0) * v.patches_per_token, 0.0)
            per_image = np.divide(patches, frames, out=np.zeros_like(patches), where=frames > 0)
            vision_pairs = frames * v.count_pairs(per_image)
        if self.audio is not None:  # every clip costs one window
            clip = self.audio.counts(self.audio.window)
            audio = {"stem": [clips * n for n in clip["stem"]], **{k: clips * clip[k] for k in ("positions", "pairs", "rows")}}
            if media is None:
                projected = zero
        terms = self._combine(tokens=tokens, llm_pairs=self.llm_pairs(tokens), labelled=labelled, visual=projected,
                              patches=patches, frames=frames, vision_pairs=vision_pairs, audio=audio)
        total = np.sum([np.broadcast_to(t, tokens.shape) for t in terms.values()], axis=0)
        if media is not None:
            for encoder, modalities in zip(self.own_terms, self.own_media):
                own_tokens, items = counts(modalities)
                for value in encoder.sample_terms(own_tokens, items, self).values():
                    total = total + np.broadcast_to(np.asarray(value, dtype=np.float64), tokens.shape)
        return total

    def batch_terms(self, batch: dict[str, Any]) -> dict[str, float]:
        """`batch_flops` per term (FLOPs, keys TERMS)."""
        if "input_ids" not in batch:
            raise DataError("a batch without input_ids has no FLOPs to count", hint="pass the collator's output")
        segments = batch_segments(batch)
        labels = batch.get("labels")
        labelled = int((labels[..., 1:] != IGNORE_INDEX).sum()) if labels is not None else 0
        images = batch_images(batch, self.vision.patch_size if self.vision else None)
        if self.image_token_id is not None:
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            hits = ids == self.image_token_id
            if self.video_token_id is not None:
                hits = hits | (ids == self.video_token_id)
            visual = int((hits & (mask != 0)).sum() if mask is not None else hits.sum())
        else:
            visual = sum(self.vision.visual_tokens(im) for im in images) if self.vision else 0
        clips = batch_audio_frames(batch, real=self.audio.chunk is not None) if self.audio is not None else []
        terms = self._terms(segments, labelled, images, visual, clips)
        for encoder in self.own_terms:
            for key, value in encoder.batch_terms(batch, self).items():
                terms[key] += float(value)
        return terms

    def batch_flops(self, batch: dict[str, Any]) -> float:
        """Training FLOPs of one collated micro-batch (`vlmctl.data.collate` output, CPU tensors): a packed row
        (`seq_lens` / `packed_cu_seqlens`, [1, T]) or a padded batch (`attention_mask` [B, T]), with `labels`
        [B, T] (-100: not labelled), `pixel_values` and, for Qwen-VL, `image_grid_thw` [N_images, 3]; for an audio
        model `input_features` [N_clips, mel bins, frames] (`batch_audio_frames`). Counts every row the batch holds
        (a dummy-image or dummy-clip row included). Raises DataError for a batch without `input_ids`."""
        return sum(self.batch_terms(batch).values())


def _causal_pairs(s, window: int | None):
    """Query-key pairs of causal attention over `s` tokens, each query seeing at most `window` keys (elementwise
    over a numpy array)."""
    if window is None:
        return s * s / 2
    return np.where(s <= window, s * s / 2, window * s - window * window / 2)


def batch_segments(batch: dict[str, Any]) -> list[int]:
    """Tokens per causal attention segment of a collated batch: a packed row's samples, a padded batch's rows (real
    tokens only), else every row of `input_ids` in full."""
    if batch.get("seq_lens") is not None:
        return [int(n) for n in batch["seq_lens"]]
    if batch.get("packed_cu_seqlens") is not None:
        cu = [int(x) for x in batch["packed_cu_seqlens"]]
        return [b - a for a, b in zip(cu, cu[1:])]
    if batch.get("attention_mask") is not None:
        return [int(n) for n in (batch["attention_mask"] != 0).sum(-1).reshape(-1)]
    ids = batch["input_ids"]
    return [int(ids.shape[-1])] * (ids.numel() // max(int(ids.shape[-1]), 1))


def batch_images(batch: dict[str, Any], patch_size: int | None) -> list[ImageShape]:
    """The images a batch sends through the vision tower: from `image_grid_thw` (t, h, w per image), else from the
    shapes of `pixel_values` ([N, C, H, W]; [B, N, C, H, W] with all-zero padding images skipped; [P, D] patch
    rows: one image of P patches); then its videos, from `video_grid_thw` (t, h, w per clip)."""
    return _images(batch, patch_size) + _grids(batch.get("video_grid_thw"))


def batch_audio_frames(batch: dict[str, Any], *, real: bool = False) -> list[int]:
    """Mel frames per audio clip the audio tower runs on: `input_features` [N_clips, mel bins, frames] ([mel bins,
    frames]: one clip) gives N_clips clips of `frames` each. Every frame counts, `feature_attention_mask` [N_clips,
    frames] notwithstanding: the mask marks the clip's real frames, but a Whisper-style encoder computes the whole
    window (module docstring). `real`: the clips' real frames instead (the mask's sums), for encoders that compute
    only those (Qwen2.5-Omni's, `AudioShape.chunk`). [] without `input_features`."""
    features = batch.get("input_features")
    if features is None:
        return []
    mask = batch.get("feature_attention_mask")
    if real and mask is not None:
        return [int(n) for n in mask.reshape(-1, mask.shape[-1]).sum(-1).tolist()]
    clips = 1 if features.ndim == 2 else int(features.shape[0])
    return [int(features.shape[-1])] * clips


def _grids(grid) -> list[ImageShape]:
    if grid is None:
        return []
    return [ImageShape(t * h * w, (t, h, w)) for t, h, w in (map(int, row) for row in grid.reshape(-1, 3).tolist())]


def _images(batch: dict[str, Any], patch_size: int | None) -> list[ImageShape]:
    grid = batch.get("image_grid_thw")
    if grid is not None:
        return _grids(grid)
    pv = batch.get("pixel_values")
    if pv is None:
        return []
    if pv.ndim == 2:
        return [ImageShape(int(pv.shape[0]))]
    if patch_size is None:
        raise ModelError("pixel_values without a vision config", hint="count FLOPs with the VLM's own CostModel")
    h, w = int(pv.shape[-2]) // patch_size, int(pv.shape[-1]) // patch_size
    if pv.ndim == 5:  # per-sample image stacks, padded with all-zero images the model skips
        n = int(pv.flatten(2).ne(0).any(-1).sum())
    else:
        n = int(pv.shape[0])
    return [ImageShape(h * w, (1, h, w)) for _ in range(n)]


def _param_counts(model, family, audio_encoder: str | None = None, owned: tuple[str, ...] = ()) -> dict[str, int]:
    """Weight-matrix / kernel parameters per part (input layers apart) and the LM head's, embeddings excluded. The
    parameters of the encoder named `audio_encoder` (a key of `family.encoders`) are `audio_params`, its
    convolutions left out (`AudioShape.stem` counts them); those under the module paths `owned` are left out (a cost
    rule that counts its encoder itself charges them)."""
    import torch

    from vlmctl.families import part_of_parameter
    from vlmctl.families.spec import encoder_of_parameter

    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    skip |= {id(p) for path in owned for p in _submodule(model, path).parameters()}
    head = model.get_output_embeddings()
    head_params = int(head.weight.numel()) if head is not None else 0
    if head is not None:
        skip.add(id(head.weight))
    inputs = {id(p) for m in _input_layers(model, family) for p in m.parameters()}
    counts = {"vision_params": 0, "vision_input_params": 0, "projector_params": 0, "projector_input_params": 0,
              "llm_params": 0, "audio_params": 0, "audio_projector_params": 0, "audio_projector_input_params": 0}
    # a projector belongs to the encoder it sits in (Qwen's merger, Qwen2.5-Omni's audio `proj`), else to the only one
    only = next(iter(family.encoders)) if len(family.encoders) == 1 else None
    experts, active = _experts_per_token(getattr(model, "config", None))
    routed = 0  # the language model's expert weights, all experts: a token runs `active` of `experts`
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in skip or p.ndim < 2:
            continue
        part = part_of_parameter(name, family)
        key = f"{part}_input_params" if id(p) in inputs and part != "llm" else f"{part}_params"
        if part == "vision" and audio_encoder is not None and encoder_of_parameter(name, family) == audio_encoder:
            if id(p) in inputs:
                continue  # the stem's convolutions: `AudioShape.stem`
            key = "audio_params"
        elif part == "projector" and audio_encoder is not None and (encoder_of_parameter(name, family) or only) == audio_encoder:
            key = f"audio_{key}"
        quant = getattr(p, "quant_state", None)  # bitsandbytes 4-bit packs two weights per byte: count the matrix
        n = math.prod(quant.shape) if quant is not None else p.numel()
        if experts and part == "llm" and "experts" in name.split("."):
            routed += n
        else:
            counts[key] += n
    if routed:
        counts["llm_params"] += round(routed * active / experts)
    return {**counts, "head_params": head_params}


def _experts_per_token(config) -> tuple[int, int]:
    """(experts, experts per token) of a mixture-of-experts language model's config, (0, 0) for a dense one."""
    if config is None:
        return 0, 0
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    active = getattr(text, "num_experts_per_tok", None)
    return (int(experts), int(active)) if experts and active else (0, 0)


def _input_layers(model, family) -> list:
    """Layers whose input gradient only an earlier trained part needs: the vision tower's convolutions (the patch
    embedding reads pixels) and each projector module's first parametrized layer when it is a linear one (of each
    element, for a list of projectors such as Qwen3-VL's deepstack mergers). A projector that starts with a norm
    (Qwen's merger) needs the gradient through its first linear layer anyway, to reach the norm's scale."""
    import torch

    out = [m for enc in family.encoders.values() for m in _submodule(model, enc.path).modules()
           if isinstance(m, torch.nn.modules.conv._ConvNd)]
    for path in family.projector:
        mod = _submodule(model, path)
        for unit in (list(mod) if isinstance(mod, torch.nn.ModuleList) else [mod]):
            # registration order stands in for execution order
            first = next((m for m in unit.modules() if any(True for _ in m.parameters(recurse=False))), None)
            if isinstance(first, torch.nn.Linear):
                out.append(first)
    return out


def mfu(flops: float, seconds: float, peak_flops_per_device: float | None, num_devices: int) -> float | None:
    """Model FLOPs utilization (PaLM, Chowdhery et al. 2022, appendix B): `flops` of useful work (summed over the
    `num_devices` devices) done in `seconds`, divided by `peak_flops_per_device` (FLOP/s, dense bf16 data-sheet
    figure) x `num_devices`. A fraction in [0, 1] in practice; None without a peak figure (CPUs, unknown devices)
    or without elapsed time."""
    if not peak_flops_per_device or seconds <= 0 or num_devices < 1:
        return None
    return flops / seconds / (peak_flops_per_device * num_devices)
