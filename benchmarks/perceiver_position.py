"""Where a perceiver-connector model (`model.projector=perceiver`, Idefics2) keeps or loses where a patch is, on the
pictures of `vlmctl demo`. Prints, for MODEL (a built or trained HF folder) and the demo folder DEMO:

- a linear probe (logistic regression, 300 pictures to fit, 100 to test) of whether a patch lies in the left or the
  right half, on the encoder's output and on the connector's input (after its modality projection);
- the entropy of the first resampler layer's attention over its keys (patches + latents) against uniform's, and the
  share of that attention on the patches;
- with a trained MODEL, log p(left) - log p(right) of the answer token for 64 training position questions, by the
  true answer (a model that ignores the image gives the same value to all).

    python benchmarks/perceiver_position.py MODEL DEMO
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch


def column_probe(features: torch.Tensor, side: int) -> float:
    """Held-out accuracy of a linear left/right classifier over [pictures, patches, width] `features`."""
    n, patches, width = features.shape
    fit = n * 3 // 4
    x = (features - features[:fit].mean((0, 1))) / (features[:fit].std((0, 1)) + 1e-6)
    y = (torch.arange(patches) % side >= side // 2).long().expand(n, patches)
    w = torch.zeros(width, 2, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1e-2)
    for _ in range(500):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x[:fit].reshape(-1, width) @ w, y[:fit].reshape(-1)).backward()
        opt.step()
    return ((x[fit:] @ w).argmax(-1) == y[fit:]).float().mean().item()


def attention_spread(model, batch) -> tuple[float, float, float]:
    """(mean entropy, uniform entropy, attention share on the patches) of the first resampler layer."""
    layer = model.model.connector.perceiver_resampler.layers[0]
    seen = {}
    hook = layer.self_attn.register_forward_hook(lambda m, a, kw, o: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    hook.remove()
    attn, latents, context = layer.self_attn, seen["latents"], seen["context"]
    b, q, _ = latents.shape
    keys = attn.k_proj(torch.cat([context, latents], 1)).view(b, -1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
    keys = keys.repeat_interleave(attn.num_heads // attn.num_key_value_heads, 1)
    queries = attn.q_proj(latents).view(b, q, attn.num_heads, attn.head_dim).transpose(1, 2)
    weights = (queries @ keys.transpose(-1, -2) * attn.scaling).softmax(-1)
    entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean().item()
    return entropy, math.log(weights.shape[-1]), weights[..., : context.shape[1]].sum(-1).mean().item()


def answer_margins(model, processor, demo: Path) -> dict[str, tuple[float, float]]:
    """Mean and spread of log p(left) - log p(right) on 64 training position questions, by the true answer."""
    from vlmctl.data.collate import Collator
    from vlmctl.data.loader import ShardDataset
    from vlmctl.families import get_family

    data = ShardDataset.from_dir(demo / "data" / "prepared" / "train")
    picked = [i for i in range(len(data)) if data[i].id.startswith("position")][:64]
    collate = Collator(processor, get_family("idefics2"), max_length=None, grouped=False)
    left, right = (processor.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("left", "right"))
    margins: dict[str, list[float]] = {"left": [], "right": []}
    for start in range(0, len(picked), 16):
        batch = collate([data[i] for i in picked[start:start + 16]])
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
        with torch.no_grad():
            logits = model(**inputs).logits
        for row, labels in enumerate(batch["labels"]):
            at = int((labels != -100).nonzero()[0])
            logp = logits[row, at - 1].log_softmax(-1)
            margins["left" if int(labels[at]) == left else "right"].append(float(logp[left] - logp[right]))
    return {k: (statistics.mean(v), statistics.pstdev(v)) for k, v in margins.items() if v}


def main(model_dir: Path, demo: Path) -> None:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    pictures = [[Image.open(f).convert("RGB")] for f in sorted((demo / "data" / "raw" / "images").glob("*.png"))[:400]]
    pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"][:, 0]
    with torch.no_grad():
        encoded = model.model.vision_model(pixel_values=pixels).last_hidden_state
        projected = model.model.connector.modality_projection(encoded)
    side = int(round(encoded.shape[1] ** 0.5))
    print(f"left/right half of a patch, linear probe: encoder output {column_probe(encoded, side):.3f}, "
          f"connector input {column_probe(projected, side):.3f}")
    text = "<|im_start|>user\n<image>Is the square on the left?<|im_end|>\n<|im_start|>assistant\n"
    batch = processor(images=pictures[:8], text=[text] * 8, return_tensors="pt")
    entropy, uniform, on_patches = attention_spread(model, batch)
    print(f"resampler attention: entropy {entropy:.3f} (uniform {uniform:.3f}), {on_patches:.1%} on the patches")
    if (model_dir / "config.json").is_file() and model_dir.name == "final":
        for answer, (mean, sd) in answer_margins(model, processor, demo).items():
            print(f"answer {answer}: log p(left) - log p(right) = {mean:.3f} (spread {sd:.3f})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/perceiver_position.py MODEL DEMO")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
