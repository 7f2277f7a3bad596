"""Teacher-forced loss of a model on the assistant turns of samples (`vlmctl eval --task loss`)."""

from __future__ import annotations

from typing import Sequence

from vlmctl.data.sample import Sample
from vlmctl.inference import ProgressFn

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.


def teacher_forced_loss(model, processor, samples: Sequence[Sample], *, batch_size: int,
                        progress: ProgressFn | None = None) -> list[tuple[float, int]]:
    """Per-sample (summed cross-entropy in nats, number of label tokens) on the assistant tokens, in sample order.

    `model`, `processor` as returned by `vlmctl.inference.load_for_generation`. Inputs and labels come from
    `vlmctl.data.collate.Collator` with the model's family spec (`family_of`: media parts written as in training,
    e.g. Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>`; assistant turns labelled, everything else -100; rows
    right-padded to the longest sample, [batch_size, T]); logits [batch_size, T, vocab] at position t predict the token at t + 1, and are cast
    to fp32 before the cross-entropy. Mean loss per token = sum of nats / sum of tokens; perplexity = exp(mean).
    Raises DataError for samples the collator cannot encode.
    """
    import torch
    import torch.nn.functional as F

    from vlmctl.data.collate import IGNORE_INDEX, Collator, model_inputs

    collator = Collator(processor, family_of(model), dummy_image=False)
    device = next(model.parameters()).device
    out: list[tuple[float, int]] = []
    for start in range(0, len(samples), batch_size):
        batch = collator(list(samples[start : start + batch_size]))
        labels = batch["labels"].to(device)
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in model_inputs(batch).items()}
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            logits = model(**inputs).logits.float()
        shifted = labels[:, 1:]
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none")
        mask = shifted != IGNORE_INDEX
        for row in range(labels.shape[0]):
            out.append((float(nll[row][mask[row]].sum()), int(mask[row].sum())))
        if progress:
            progress(len(out), len(samples))
    return out


def family_of(model):
    """The registered family spec of `model` (by its config's `model_type`), or None for a model of no family."""
    from vlmctl.errors import ModelError
    from vlmctl.families import detect_family, get_family

    config = getattr(model, "config", None)
    try:
        return get_family(detect_family(config)) if config is not None else None
    except ModelError:
        return None


__all__ = ["family_of", "teacher_forced_loss"]
