"""Two probes behind the perceiver demo's position rows in docs/benchmarks.md (`vlmctl demo DIR model.projector=perceiver
model.perceiver_queries=16 model.perceiver_depth=1 model.perceiver_heads=4`; Idefics2 with 16 patches per image).

    python benchmarks/perceiver_seed.py seed DEMO [GAP]   # rewrite DEMO/outputs/model with position-seeded queries
    python benchmarks/perceiver_seed.py side DEMO MODEL   # how well a linear probe reads the object's side

`seed`: runs 256 of the demo's training pictures through the built model and takes, for each patch, the mean of the
resampler's normalized context (`input_context_norm` output, [16, hidden]) less its mean over the patches: the part
of each patch's key input that depends on where the patch is, not on the picture. Each latent query is set to the key of
its patch's part, and the query projection to s x identity, with s chosen so that a query's attention logit on its own
patch exceeds the others by GAP on average (default 5). The model is saved in place (safetensors), so `vlmctl train` in
DEMO starts from it. Needs a resampler with one block, as many queries as patches and a square query projection.

`side`: on 400 position pictures (one object each; the answer is its side), fits a logistic regression (L-BFGS, fp32, L2 1e-3) on
300 and prints its accuracy on the other 100 for the modality projection's output (the resampler's input) and the
connector's output (the visual tokens), each flattened to [16 x hidden] and standardized.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(model_dir: Path, demo: Path):
    import torch
    from transformers import AutoProcessor, Idefics2ForConditionalGeneration

    model = Idefics2ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(demo / "outputs/model")


def _pictures(demo: Path, prefix: str, n: int):
    from PIL import Image

    data = [d for d in json.loads((demo / "data/raw/shapes_vqa.json").read_text()) if d["id"].startswith(prefix)][:n]
    return data, [Image.open(demo / "data/raw" / d["image"]).convert("RGB") for d in data]


def _run(model, processor, images, batch: int = 50) -> None:
    import torch

    with torch.no_grad():
        for k in range(0, len(images), batch):
            part = images[k:k + batch]
            model(**processor(images=[[im] for im in part], text=["<image>"] * len(part), return_tensors="pt"))


def seed(demo: Path, gap: float = 5.0) -> None:
    import torch

    model, processor = _load(demo / "outputs/model", demo)
    resampler = model.model.connector.perceiver_resampler
    layer, attn = resampler.layers[0], resampler.layers[0].self_attn
    seen = []
    hook = layer.input_context_norm.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    _run(model, processor, _pictures(demo, "", 256)[1])
    hook.remove()
    context = torch.cat(seen)  # [pictures, patches, hidden]
    position = context.mean(0) - context.mean((0, 1))
    with torch.no_grad():
        keys = attn.k_proj(position)  # [patches, hidden]
        n, heads, dim = keys.shape[0], attn.num_heads, attn.head_dim
        if resampler.latents.shape[0] != n or attn.q_proj.weight.shape[0] != attn.q_proj.weight.shape[1]:
            raise SystemExit("seed needs as many queries as patches and a square query projection")

        def logits(scale: float):
            q = scale * keys / keys.pow(2).mean(-1, keepdim=True).sqrt()  # q_proj(s I) of the RMS-normalized latents
            k = attn.k_proj(context)
            return torch.einsum("ihd,bjhd->bhij", q.view(n, heads, dim), k.view(-1, n, heads, dim)) * attn.scaling

        own = torch.eye(n, dtype=torch.bool)
        unit = logits(1.0)
        scale = gap / (unit[..., own].mean() - unit[..., ~own].mean()).item()
        share = logits(scale).softmax(-1)[..., own].mean().item()
        resampler.latents.copy_(keys)
        attn.q_proj.weight.copy_(torch.eye(attn.q_proj.weight.shape[0]) * scale)
        if attn.q_proj.bias is not None:
            attn.q_proj.bias.zero_()
    model.save_pretrained(demo / "outputs/model")
    print(f"seeded {n} queries: query scale {scale:.2f}, attention on the own patch {share:.3f} (of the patches)")


def side(demo: Path, model_dir: Path) -> None:
    import torch

    model, processor = _load(model_dir, demo)
    data, images = _pictures(demo, "position", 400)
    y = torch.tensor([d["conversations"][1]["value"] == "left" for d in data], dtype=torch.float32)
    outs: dict[str, list] = {"resampler input": [], "connector output": []}
    connector = model.model.connector
    hooks = [connector.modality_projection.register_forward_hook(lambda m, i, o: outs["resampler input"].append(o.detach().flatten(1))),
             connector.register_forward_hook(lambda m, i, o: outs["connector output"].append(o.detach().flatten(1)))]
    _run(model, processor, images)
    for h in hooks:
        h.remove()
    for name, parts in outs.items():
        x = torch.cat(parts)
        x = (x - x[:300].mean(0)) / (x[:300].std(0) + 1e-6)
        w = torch.zeros(x.shape[1], requires_grad=True)
        b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=500)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x[:300] @ w + b, y[:300]) + 1e-3 * w.pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        accuracy = (((x[300:] @ w + b) > 0).float() == y[300:]).float().mean().item()
        print(f"{name}: side read at {accuracy:.1%} (100 held-out pictures, majority {max(y[300:].mean().item(), 1 - y[300:].mean().item()):.1%})")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "seed":
        seed(Path(args[1]), float(args[2]) if len(args) > 2 else 5.0)
    elif len(args) == 3 and args[0] == "side":
        side(Path(args[1]), Path(args[2]))
    else:
        raise SystemExit(__doc__)
