"""Qwen3-VL MoE (Qwen3-VL-30B-A3B, -235B-A22B; `Qwen3VLMoeForConditionalGeneration`): Qwen3-VL's vision tower,
DeepStack mergers and mRoPE with a mixture-of-experts decoder. Built by the Qwen-VL factory (`qwen_vl.qwen_vl`),
so it shares `QwenVLSpec`: the visual-token rule, the mRoPE position hook for packed rows, the image-size settings.

Module paths (transformers 5.23, checked by tests/unit/test_families_qwen3_vl_moe.py):

| part           | path                                                    |
|----------------|---------------------------------------------------------|
| vision tower   | model.visual                                            |
| projector      | model.visual.merger, model.visual.deepstack_merger_list |
| language model | model.language_model                                    |
| lm head        | lm_head                                                 |

As in Qwen3-VL the projector sits inside the vision tower. Each decoder layer's `mlp` is a router (`gate`) and the
fused experts (`experts`).

The processor is Qwen3-VL's (`Qwen3VLProcessor`, no MoE variant). FSDP2 and activation checkpointing wrap each
`Qwen3VLMoeTextDecoderLayer` (attention, router and all its experts, whose weights are 3-D tensors
[experts, ...] in `Qwen3VLMoeTextExperts`): every rank holds a shard of every expert, gathers a whole layer for
its forward, and runs only the experts its tokens are routed to (data-dependent control flow stays inside one
FSDP unit, so the collectives still line up across ranks). The router's load-balancing loss is off
(`output_router_logits=False`, transformers' default).

Expert parallelism (not implemented) would need: an `ep` dimension of `distributed.mesh.ParallelDims` (experts
split over ranks, carved out of the data-parallel shard dimension); a plan hook on this spec that swaps each
`Qwen3VLMoeTextExperts` for a module holding its rank's experts and exchanging routed tokens with all-to-all
(dispatch by `router_indices`, combine with the router weights; torchtitan's `ExpertParallel` and
`moe.token_dispatcher` are the model); FSDP2 sharding the local experts over the remaining data-parallel ranks
only; gradient reduction of expert weights over that smaller group; the router aux loss (and its coefficient)
to keep the load balanced; checkpoint save / convert that re-assemble the experts' 3-D tensors from their shards.
"""

from __future__ import annotations

from dataclasses import replace

from vlmctl.families.qwen_vl import qwen_vl
from vlmctl.families.registry import register

# The published processor is Qwen3-VL's: patch 16, shortest_edge 65536, longest_edge 16777216 pixels.
QWEN3_VL_MOE = register(replace(
    qwen_vl("qwen3_vl_moe", "Qwen3VLMoe", patch=16, min_pixels=65536, max_pixels=16777216,
            decoder_layer="Qwen3VLMoeTextDecoderLayer", video_processor="Qwen3VLVideoProcessor",
            tiny_preset="tiny-qwen3-vl-moe", projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
            notes="Qwen3-VL with a mixture-of-experts decoder; FSDP units are whole MoE layers (no expert parallelism)."),
    processor_class="Qwen3VLProcessor",
    lmms_model="huggingface",  # lmms-eval's qwen3_vl adapter loads the dense class for local folders
))
