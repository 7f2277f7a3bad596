"""Training-throughput benchmark: tokens/s, MFU (vision tower included), step time, peak memory.

The workload reproduces the plain-transformers baseline's sample distribution for Qwen-VL architectures (one
square image of 224/336/448/560 px, i.e. 64..400 merged visual tokens, plus 64..1536 uniformly random text
tokens, every text token labelled), so vlmctl and the baseline can be measured in one run on the same GPU.

FLOPs per sample (forward + backward = 3x forward), following the PaLM accounting (Chowdhery et al. 2022,
appendix B: 6N per token for the weights, 12 * layers * d_model * seq per token for attention, halved here for
causal masking):

    6 * (N_llm - N_embed) * s              language-model weights, s = tokens of the sample (text + visual)
  + 6 * N_embed * s_labelled               LM head, only on labelled tokens (the only logits vlmctl computes)
  + 6 * L * d * s^2                        causal self-attention (12 * L * d * s^2 / 2)
  + 6 * N_vision * p                       vision-tower weights, p = patches of the sample's images
  + 12 * L_v * d_v * p * min(p, w)         vision attention, w = tokens per attention window (64 patches for
                                           Qwen2.5-VL's 112 px windows; full attention layers are approximated
                                           the same way, as in the baseline script)

MFU = FLOPs / step time / peak, with peak = 989 TFLOP/s (H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}
DEFAULT_PEAK = 989e12


@dataclass
class WorkloadSpec:
    image_sizes: tuple[int, ...] = (224, 336, 448, 560)
    text_tokens: tuple[int, int] = (64, 1536)
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2


@dataclass
class BenchResult:
    name: str
    steps: int
    tokens_per_s: float
    text_tokens_per_s: float
    visual_tokens_per_s: float
    samples_per_s: float
    step_time_s: float
    mfu: float
    peak_memory_gib: float
    tokens_per_step: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def qwen_vl_samples(n: int, cfg, spec: WorkloadSpec = WorkloadSpec(), seed: int = 0) -> list[dict[str, Any]]:
    """`n` encoded samples shaped like the baseline's: dicts with input_ids/labels (L,), mm_token_type_ids (L,),
    pixel_values (patches, 3 * t * patch^2) float32 and image_grid_thw (1, 3), plus `n_patches`, `n_visual`,
    `n_text` counts. `cfg` is a Qwen2/2.5-VL config (token ids, vocabulary size)."""
    import torch

    rng = random.Random(seed)
    vocab = cfg.text_config.vocab_size
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    out = []
    for _ in range(n):
        side = rng.choice(spec.image_sizes)
        gh = gw = side // spec.patch_size
        n_visual = gh * gw // spec.merge_size**2
        n_text = rng.randint(*spec.text_tokens)
        ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n_visual + [cfg.vision_end_token_id]
        ids += [t if t not in special else t + len(special) + 1 for t in (rng.randrange(0, vocab - len(special) - 1) for _ in range(n_text))]
        ids_t = torch.tensor(ids)
        labels = ids_t.clone()
        labels[: n_visual + 2] = -100
        out.append({
            "input_ids": ids_t,
            "labels": labels,
            "mm_token_type_ids": (ids_t == cfg.image_token_id).long(),
            "pixel_values": torch.randn(gh * gw, 3 * spec.temporal_patch_size * spec.patch_size**2),
            "image_grid_thw": torch.tensor([[1, gh, gw]]),
            "n_patches": gh * gw,
            "n_visual": n_visual,
            "n_text": n_text + 2,
        })
    return out


def param_counts(model) -> dict[str, int]:
    """Parameters (count) of the vision tower, the input embedding, and everything else."""
    n_all = sum(p.numel() for p in model.parameters())
    n_vis = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}" or "vision_tower" in n)
    n_emb = model.get_input_embeddings().weight.numel()
    return {"all": n_all, "vision": n_vis, "embed": n_emb, "llm": n_all - n_vis}


def sample_flops(counts: dict[str, int], cfg, s: int, s_labelled: int, patches: int, window: int = 64) -> float:
    """Training FLOPs of one sample (formula in the module docstring)."""
    t, v = cfg.text_config, cfg.vision_config
    d, layers = t.hidden_size, t.num_hidden_layers
    vd, vdepth = v.hidden_size, v.depth
    f = 6 * (counts["llm"] - counts["embed"]) * s + 6 * counts["embed"] * s_labelled
    f += 6 * layers * d * s * s
    f += 6 * counts["vision"] * patches + 12 * vdepth * vd * patches * min(patches, window)
    return float(f)


def run_packed_bench(
    model,
    samples: list[dict[str, Any]],
    *,
    name: str,
    tokens_per_batch: int,
    steps: int,
    warmup: int = 3,
    use_liger: bool = False,
    peak_flops: float = DEFAULT_PEAK,
    log=print,
) -> BenchResult:
    """Train `steps + warmup` packed steps of `samples` on the model's device and measure the last `steps`.

    Each step packs samples (first-fit decreasing) into one row of at most `tokens_per_batch` tokens, computes
    Qwen-VL mRoPE positions per sample, runs forward + backward + fused AdamW.
    """
    import torch

    from vlmctl.data.packing import first_fit_decreasing, mrope_position_ids, pack_samples
    from vlmctl.train.loop import loss_sum

    device = next(model.parameters()).device
    counts = param_counts(model)
    bins = list(first_fit_decreasing(((i, s["input_ids"].numel()) for i, s in enumerate(samples)), tokens_per_batch, lookahead=512))
    # fullest bins first: the partial tail bins of a finite sample set would understate throughput
    bins.sort(key=lambda b: -sum(samples[k]["input_ids"].numel() for k in b))
    if len(bins) < steps + warmup:
        raise ValueError(f"{len(samples)} samples make only {len(bins)} packed rows; need {steps + warmup}")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=device.type == "cuda")
    model.train()
    times, toks, text_toks, vis_toks, n_samples, flops = [], 0, 0, 0, 0, 0.0
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i, b in enumerate(bins[: steps + warmup]):
        group = [samples[k] for k in b]
        packed = pack_samples([{k: v for k, v in s.items() if torch.is_tensor(v)} for s in group])
        seq_lens = packed.pop("seq_lens")
        # mRoPE positions are data preparation (CPU, DataLoader workers in training): outside the timed step
        packed["position_ids"] = mrope_position_ids(model.model.get_rope_index, packed["input_ids"], packed["mm_token_type_ids"], packed["image_grid_thw"], seq_lens)
        n_labelled = max(1, int((packed["labels"][0, 1:] != -100).sum()))  # on CPU: no device sync in the step
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in packed.items()}
        batch["pixel_values"] = batch["pixel_values"].to(model.dtype)
        sync()
        t0 = time.perf_counter()
        # the trainer's own loss: liger's fused cross-entropy, or logits of the labelled tokens only
        loss = loss_sum(model, batch, liger=use_liger) / n_labelled
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            toks += sum(seq_lens)
            text_toks += sum(s["n_text"] for s in group)
            vis_toks += sum(s["n_visual"] for s in group)
            n_samples += len(group)
            flops += sum(sample_flops(counts, model.config, s["input_ids"].numel(), int((s["labels"] != -100).sum()), s["n_patches"]) for s in group)
        log(f"[{name}] step {i} loss {loss.item():.3f} {dt * 1000:.0f} ms tokens {sum(seq_lens)} samples {len(group)}")
    total = sum(times)
    return BenchResult(
        name=name, steps=len(times), tokens_per_s=toks / total, text_tokens_per_s=text_toks / total,
        visual_tokens_per_s=vis_toks / total, samples_per_s=n_samples / total, step_time_s=total / len(times),
        mfu=flops / total / peak_flops, peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        tokens_per_step=toks / len(times),
    )


def run_bench(model_section, train_section, *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(),
              device: str | None = None, log=print) -> BenchResult:
    """`vlmctl bench`: a random-init model of `model_section` (a `preset`, e.g. qwen2.5-vl-3b) trained on the
    synthetic baseline-shaped workload with the settings of `train_section` (tokens_per_batch,
    attn_implementation, liger, gradient_checkpointing, compile, precision).

    Raises UsageError for a model that is not a Qwen-VL preset (the synthetic workload is Qwen-VL shaped).
    """
    import torch

    from vlmctl.errors import UsageError
    from vlmctl.models.build import instantiate, plan_build
    from vlmctl.train.kernels import apply_liger, liger_available, resolve_attn_implementation, set_attention

    plan = plan_build(model_section)
    if not plan.family.mrope:
        raise UsageError(
            f"vlmctl bench runs Qwen-VL architectures; model family {plan.family.name!r} is not one",
            hint="set model.preset to qwen2.5-vl-3b, qwen2.5-vl-7b or tiny-qwen2.5-vl (with model.init=random)",
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = train_section.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    torch.manual_seed(0)
    model = instantiate(plan, device=device, dtype=precision)
    set_attention(model, resolve_attn_implementation(train_section.attn_implementation, device), vision_varlen=device == "cuda")
    liger = train_section.liger == "on" or (train_section.liger == "auto" and liger_available(device))
    if liger:
        apply_liger(model, plan.family.name, kernels=not train_section.compile)
    if train_section.compile:
        for layer in model.model.language_model.layers:
            layer.compile(dynamic=True)
    if train_section.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mean_tokens = (sum(spec.text_tokens) / 2) + sum((s // spec.patch_size) ** 2 / spec.merge_size**2 for s in spec.image_sizes) / len(spec.image_sizes)
    n = int((steps + warmup + 2) * train_section.tokens_per_batch / mean_tokens * 1.3) + 8
    samples = qwen_vl_samples(n, model.config, spec)
    return run_packed_bench(model, samples, name=model_section.preset or "model", tokens_per_batch=train_section.tokens_per_batch,
                            steps=steps, warmup=warmup, use_liger=liger, log=log)
