"""megatron-core on CPU for the Megatron interop tests: the models it builds from a transformers config, and the
few places where megatron-core 0.16 assumes CUDA, pointed at the CPU.

megatron-core builds and runs its local (non Transformer Engine) layers on CPU under gloo once
`torch.cuda.current_device` names the CPU, `Tensor.cuda` and `torch.cuda.synchronize` do nothing, the default
causal mask is made on the CPU and its CUDA RNG tracker's `fork` is a no-op (dropout is 0 in these models).
`CLIPViTModel`'s default norms are torch's `LayerNorm`, which does not take megatron-core's `config` argument when
Transformer Engine is missing: `WrappedTorchNorm` takes their place. The local ViT layer spec is causal and keeps
its norms under their own names; the specs here attend without a mask and store the fused names, as
Transformer Engine's ViT spec does (what Megatron-LM's LLaVA runs with).
"""

from __future__ import annotations

import contextlib
import os

import torch


def patch_cpu() -> None:
    """Point megatron-core's CUDA assumptions at the CPU (see the module docstring). Call before building."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    defaults = list(CLIPViTModel.__init__.__defaults__)
    defaults[0] = defaults[1] = WrappedTorchNorm  # ln_pre_impl, ln_post_impl
    CLIPViTModel.__init__.__defaults__ = tuple(defaults)


def init(tp: int = 1) -> None:
    """gloo process group from torchrun's environment and megatron-core's model-parallel groups of size `tp`."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _common(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(use_cpu_initialization=True, bias_activation_fusion=False, apply_rope_fusion=False,
                             gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def gpt_config(text, *, qkv_bias: bool, qk_norm: bool = False):
    heads = text.num_attention_heads
    return _common(num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, num_attention_heads=heads,
                   num_query_groups=text.num_key_value_heads, ffn_hidden_size=text.intermediate_size,
                   kv_channels=getattr(text, "head_dim", None) or text.hidden_size // heads, normalization="RMSNorm",
                   layernorm_epsilon=text.rms_norm_eps, gated_linear_unit=True, add_bias_linear=False,
                   add_qkv_bias=qkv_bias, qk_layernorm=qk_norm, activation_func=torch.nn.functional.silu)


def _rope_base(text) -> int:
    return int((getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000))


def gpt_model(text, vocab: int, *, tied: bool, qkv_bias: bool = True, qk_norm: bool = False):
    """megatron-core's `GPTModel` (local spec) of a Qwen2-style (`qk_norm`: Qwen3-style) transformers text config,
    vocabulary `vocab`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    return GPTModel(gpt_config(text, qkv_bias=qkv_bias, qk_norm=qk_norm), spec,
                    vocab_size=vocab, max_sequence_length=text.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=_rope_base(text), share_embeddings_and_output_weights=tied, parallel_output=False)


def llava_model(config, vocab: int, *, tied: bool):
    """megatron-core's `LLaVAModel` of a transformers LLaVA config (CLIP or SigLIP tower, 2-layer GELU MLP
    projector, Qwen2-style language model)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLPSubmodules

    text, vision = config.text_config, config.vision_config
    act = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
           "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[vision.hidden_act]
    vit = _common(num_layers=vision.num_hidden_layers, hidden_size=vision.hidden_size,
                  num_attention_heads=vision.num_attention_heads, ffn_hidden_size=vision.intermediate_size,
                  normalization="LayerNorm", layernorm_epsilon=vision.layer_norm_eps, add_bias_linear=True,
                  add_qkv_bias=True, activation_func=act)
    vit.vision_model_type = "siglip" if vision.model_type == "siglip_vision_model" else "clip"
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    spec.submodules.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                                   "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    projection = _common(num_layers=1, hidden_size=text.hidden_size, ffn_hidden_size=text.hidden_size,
                         num_attention_heads=1, add_bias_linear=True, activation_func=torch.nn.functional.gelu)
    return LLaVAModel(
        gpt_config(text, qkv_bias=True), get_gpt_layer_local_spec(normalization="RMSNorm"), vocab,
        text.max_position_embeddings, vit, spec, drop_vision_class_token=config.vision_feature_select_strategy == "default",
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        vision_projection_type="mlp", share_embeddings_and_output_weights=tied, parallel_output=False, language_position_embedding_type="rope",
        language_rotary_base=_rope_base(text), img_h=vision.image_size, img_w=vision.image_size,
        patch_dim=vision.patch_size, image_token_index=config.image_token_id)


def causal_mask(length: int) -> torch.Tensor:
    """megatron-core's attention mask (True: masked) of a causal row of `length` tokens."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool), 1)[None, None]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))
