"""Packed-training throughput variants on one GPU, Qwen2.5-VL architecture, random init, baseline workload.

Usage (CUDA machine): python benchmarks/bench_throughput_gpu.py [3b|7b] [VARIANT ...]
Variants: the keys of SETTINGS. Prints one RESULT line per variant. liger-kernel patches transformers' classes
globally, so run one variant per process when comparing liger settings.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vlmctl.bench import qwen_vl_samples, run_packed_bench
from vlmctl.train.kernels import apply_liger, resolve_attn_implementation, set_attention

size = sys.argv[1] if len(sys.argv) > 1 else "3b"
variants = sys.argv[2:] or ["sdpa", "varlen", "varlen_liger", "varlen_liger_gc"]
steps = int(os.environ.get("STEPS", 10))

text = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
            vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1e6)
if size == "7b":
    text.update(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=text["hidden_size"], patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], in_chans=3, hidden_act="silu")
cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                       vision_start_token_id=151652, vision_end_token_id=151653)

SETTINGS = {
    # name: (attention, liger, gradient checkpointing, tokens per batch, vision varlen, compile)
    "sdpa": ("sdpa", False, False, 16384, False, False),
    "varlen": ("varlen", False, False, 16384, False, False),
    "varlen_liger": ("varlen", True, False, 16384, False, False),
    "varlen_liger_gc": ("varlen", True, True, 32768, False, False),
    "vvarlen_liger": ("varlen", True, False, 16384, True, False),
    "vvarlen_liger_8k": ("varlen", True, False, 8192, True, False),
    "vvarlen_flce_compile": ("varlen", "flce", False, 16384, True, True),
    "vvarlen_flce": ("varlen", "flce", False, 16384, True, False),
    "vvarlen_flce_gc8k": ("varlen", "flce", True, 8192, True, False),
    "vvarlen_flce_gc32k": ("varlen", "flce", True, 32768, True, False),
    "vvarlen_flce_compile_gc32k": ("varlen", "flce", True, 32768, True, True),
    "vvarlen_liger_gc32k": ("varlen", True, True, 32768, True, False),
    "vvarlen_liger_gc8k": ("varlen", True, True, 8192, True, False),
}

samples = qwen_vl_samples(2000, cfg, seed=0)
results = []
for name in variants:
    attn, liger, ckpt, budget, vision_varlen, compile_layers = SETTINGS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        # a copy: set_attention writes the vision tower's dispatch name into the config
        model = Qwen2_5_VLForConditionalGeneration(copy.deepcopy(cfg)).to(torch.bfloat16)
    set_attention(model, resolve_attn_implementation(attn, "cuda"), vision_varlen=vision_varlen)
    print(f"[{name}] attention: text {model.config.text_config._attn_implementation}, vision {model.config.vision_config._attn_implementation}", flush=True)
    if liger:
        # "flce": only the fused linear cross-entropy (torch.compile fuses the norms and MLP itself)
        apply_liger(model, "qwen2_5_vl", kernels=liger != "flce")
    if compile_layers:
        for layer in model.model.language_model.layers:
            layer.compile(dynamic=True)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        r = run_packed_bench(model, samples, name=f"{size}-{name}", tokens_per_batch=budget, steps=steps, use_liger=liger)
        print("RESULT " + json.dumps(r.as_dict()), flush=True)
        results.append(r.as_dict())
    except torch.OutOfMemoryError:
        print(f"RESULT {json.dumps({'name': f'{size}-{name}', 'error': 'out of memory'})}", flush=True)
    except Exception as exc:  # record and go on with the next variant
        print(f"RESULT {json.dumps({'name': f'{size}-{name}', 'error': f'{type(exc).__name__}: {str(exc)[:300]}'})}", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, f"throughput_{size}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
