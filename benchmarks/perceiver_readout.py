"""Where a perceiver-connector model (`model.projector=perceiver`, Idefics2) can learn where an object is: trains the
vision encoder and the connector of a built `vlmctl demo` model end to end together with a linear readout on one
stage's output, on the demo's position questions only ("Is the X on the left or the right?", one object per
picture), and prints the readout's accuracy on the val position questions every 50 steps.

    python benchmarks/perceiver_readout.py DEMO [STAGE] [QK] [STEPS]

STAGE: `encoder` (the encoder's last layer, [patches, vision hidden] flattened), `projection` (after the connector's
modality projection), `resampler` (the visual tokens, [queries, hidden] flattened; default) or `resampler-mean` (the
visual tokens averaged, which is what a language model whose attention is still uniform sees of them). QK: a factor
applied to the resampler's query and key projection weights before training (their attention logits scale by
QK**2; 1 keeps the built model's). STEPS: default 300, batches of 32 pictures, AdamW at 1e-3, fp32, one process.
The demo is one built with `vlmctl demo DEMO model.projector=perceiver ...` (its outputs/model and prepared data).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch


def main(demo: Path, stage: str = "resampler", qk: float = 1.0, steps: int = 300) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.data.collate import Collator
    from vlmctl.data.loader import ShardDataset
    from vlmctl.families import get_family

    torch.manual_seed(0)
    rng = random.Random(0)
    model = AutoModelForImageTextToText.from_pretrained(demo / "outputs/model", dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    collate = Collator(AutoProcessor.from_pretrained(demo / "outputs/model"), get_family("idefics2"), dummy_image=False)
    splits = {}
    for split in ("train", "val"):
        data = ShardDataset.from_dir(demo / "data/prepared" / split)
        splits[split] = [data[i] for i in range(len(data)) if data[i].id.startswith("position")]
    connector = model.model.connector
    with torch.no_grad():
        for layer in connector.perceiver_resampler.layers:
            layer.self_attn.q_proj.weight.mul_(qk)
            layer.self_attn.k_proj.weight.mul_(qk)

    def features(samples) -> torch.Tensor:
        batch = collate(samples)
        pixels = batch["pixel_values"]
        if stage in ("encoder", "projection"):
            out = model.model.vision_model(pixel_values=pixels[:, 0]).last_hidden_state
            out = connector.modality_projection(out) if stage == "projection" else out
        else:
            out = model.model.get_image_features(pixels, batch["pixel_attention_mask"])
            out = getattr(out, "pooler_output", out)
            out = torch.stack(list(out)) if isinstance(out, (list, tuple)) else out
            out = out.reshape(len(samples), -1, out.shape[-1])
        return out.mean(1) if stage == "resampler-mean" else out.flatten(1)

    def labels(samples) -> torch.Tensor:
        return torch.tensor([int(s.messages[-1]["content"][0]["text"] == "left") for s in samples])

    with torch.no_grad():
        width = features(splits["val"][:2]).shape[1]
    readout = torch.nn.Linear(width, 2)
    params = [*model.model.vision_model.parameters(), *connector.parameters(), *readout.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    majority = max(labels(splits["val"]).float().mean().item(), 1 - labels(splits["val"]).float().mean().item())
    print(f"stage {stage}, QK {qk}: {len(splits['train'])} train / {len(splits['val'])} val position pictures "
          f"(majority answer {majority:.1%})")
    start = time.perf_counter()
    for step in range(1, steps + 1):
        samples = rng.sample(splits["train"], 32)
        loss = torch.nn.functional.cross_entropy(readout(features(samples)), labels(samples))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            with torch.no_grad():
                hits = (readout(features(splits["val"])).argmax(-1) == labels(splits["val"])).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, val {hits:.1%} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 5:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), *(sys.argv[2:3]), *(float(a) for a in sys.argv[3:4]), *(int(a) for a in sys.argv[4:5]))
