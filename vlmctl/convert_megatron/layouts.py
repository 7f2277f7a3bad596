"""Where each weight of a Hugging Face VLM lives in a Megatron checkpoint, and how it is laid out there.

A layout is a list of `Rule`s between the *canonical* Megatron names (one tensor per name, full size, layers
numbered globally: `language_model.decoder.layers.3.self_attention.linear_qkv.weight`, the fused layer-norm names
of Transformer Engine's layers) and the names of the transformers model's `state_dict()`. Rules are derived from
the model's own keys by ordered patterns, so optional tensors (biases, q/k norms, an untied output layer) follow the
config. `vlmctl.convert_megatron.checkpoint` turns real checkpoints into canonical names and back.

Layouts (a family's `FamilySpec.megatron_layout` names one):

- `megatron_llava`: Megatron-LM's `LLaVAModel` (`megatron/core/models/multimodal/llava_model.py`): `vision_model` a
  `CLIPViTModel` (clip or siglip subtype: `conv1`, `position_embeddings`, `class_token`, `ln_pre` / `ln_post`,
  `decoder.layers`), `vision_projection.encoder.linear_fc1/linear_fc2` (the MLP projector), `language_model` a
  `GPTModel`. Only the vision layers HF LLaVA reads (`vision_feature_layer`) are Megatron layers; the others, the
  SigLIP pooling head and CLIP's unused post layer norm have no Megatron place (`extra`).
- `bridge_qwen25_vl`: Megatron-Bridge's `Qwen25VLModel` (`megatron/bridge/models/qwen_vl/qwen25_vl_bridge.py`): the
  transformers vision tower as it is under `visual.` (replicated), `language_model` a `GPTModel`.
- `bridge_qwen3_vl`: Megatron-Bridge's `Qwen3VLModel` (`qwen3_vl_bridge.py`): `vision_model` a Megatron vision
  transformer (`patch_embed.proj`, `pos_embed`, `decoder.layers`, `decoder.deepstack_merger_list`, `merger` with
  `patch_norm`), `language_model` a `GPTModel` with q/k layer norms.

Tensor layouts (`Rule.kind`), as megatron-core lays them out (`transformer/attention.py`, `transformer/mlp.py`):

- `qkv`: `linear_qkv` holds, per query group g, the group's query heads then its key head then its value head:
  [groups * (heads/groups + 2) * head_dim, in]; transformers keeps q, k, v apart.
- `qkv_cat`: the same Megatron tensor from one transformers `qkv` tensor [q; k; v] (vision towers, heads = groups).
- `gate_up`: `linear_fc1` of a gated MLP is [gate; up] (SwiGLU), transformers' `gate_proj`, `up_proj`.
- `vocab`: embeddings and the output layer have the vocabulary padded to a multiple of 128 x tensor-parallel size
  (Megatron-LM's `--make-vocab-size-divisible-by`); the padding rows are dropped on import, zeros on export.
- `class_token`: CLIP's class embedding [hidden] is Megatron's `class_token` [1, 1, hidden].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlmctl.errors import ModelError

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

LLAVA, QWEN25_VL, QWEN3_VL = "megatron_llava", "bridge_qwen25_vl", "bridge_qwen3_vl"
LAYOUTS = (LLAVA, QWEN25_VL, QWEN3_VL)
# layouts whose vision tower Megatron splits over the tensor-parallel ranks (Megatron-Bridge keeps Qwen2.5-VL's
# transformers tower replicated)
VISION_SPLIT = (LLAVA, QWEN3_VL)
VOCAB_DIVISOR = 128  # Megatron-LM's default --make-vocab-size-divisible-by
# Megatron module prefixes that hold model weights (what is read from a checkpoint; optimizer state is not)
MODEL_PREFIXES = ("language_model.", "vision_model.", "vision_projection.", "visual.")


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor `mg` and the transformers tensors `hf` it is made of (`kind`: see the module docstring;
    `heads`, `groups`, `head_dim` for the attention kinds)."""

    mg: str
    hf: tuple[str, ...]
    kind: str = "copy"
    heads: int = 0
    groups: int = 0
    head_dim: int = 0


@dataclass
class Layout:
    """A model's rules, the transformers tensors Megatron has no place for (`extra`), and the Megatron names that
    may be in a checkpoint without a rule (`optional`: the output layer of a tied model on a later pipeline stage)."""

    name: str
    rules: list[Rule]
    extra: list[str]
    optional: tuple[str, ...] = ()

    def hf_keys(self) -> set[str]:
        return {k for r in self.rules for k in r.hf}

    def mg_keys(self) -> set[str]:
        return {r.mg for r in self.rules}


# ---------------------------------------------------------------------------------------------------- tensor layouts


def padded_vocab(vocab: int, tensor_parallel: int = 1) -> int:
    """`vocab` rounded up to a multiple of 128 x `tensor_parallel` (Megatron-LM's `_vocab_size_with_padding`)."""
    step = VOCAB_DIVISOR * tensor_parallel
    return -(-vocab // step) * step


def _qkv_to_mg(q, k, v, heads: int, groups: int, head_dim: int):
    import torch

    rest = q.shape[1:]
    per = heads // groups
    q = q.reshape(groups, per * head_dim, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_to_hf(t, heads: int, groups: int, head_dim: int):
    rest = t.shape[1:]
    per = heads // groups
    if t.shape[0] != groups * (per + 2) * head_dim:
        raise ModelError(f"linear_qkv has {t.shape[0]} rows; {heads} heads in {groups} groups of head size {head_dim} "
                         f"need {groups * (per + 2) * head_dim}",
                         hint="the checkpoint was trained with other attention settings than the config passed with --base")
    t = t.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = t.split([per * head_dim, head_dim, head_dim], dim=1)
    return [x.reshape(-1, *rest) for x in (q, k, v)]


def to_megatron(rule: Rule, tensors: list["torch.Tensor"], vocab_rows: int | None = None) -> "torch.Tensor":
    """The Megatron tensor of `rule` from its transformers `tensors` (in `rule.hf` order); `vocab_rows`: the padded
    vocabulary of `vocab` rules."""
    import torch

    if rule.kind == "qkv":
        return _qkv_to_mg(*tensors, rule.heads, rule.groups, rule.head_dim).contiguous()
    if rule.kind == "qkv_cat":
        q, k, v = tensors[0].chunk(3, dim=0)
        return _qkv_to_mg(q, k, v, rule.heads, rule.groups, rule.head_dim).contiguous()
    if rule.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    if rule.kind == "class_token":
        return tensors[0].reshape(1, 1, -1).clone()
    if rule.kind == "vocab" and vocab_rows is not None and vocab_rows > tensors[0].shape[0]:
        pad = tensors[0].new_zeros(vocab_rows - tensors[0].shape[0], *tensors[0].shape[1:])
        return torch.cat([tensors[0], pad], dim=0)
    return tensors[0].clone()


def to_hf(rule: Rule, tensor: "torch.Tensor", shapes: dict[str, tuple[int, ...]]) -> list["torch.Tensor"]:
    """The transformers tensors of `rule` (in `rule.hf` order) from its Megatron `tensor`; `shapes`: the model's
    tensor shapes (the vocabulary rows kept, the shapes checked). Raises ModelError for a tensor of another size."""
    if rule.kind == "qkv":
        out = _qkv_to_hf(tensor, rule.heads, rule.groups, rule.head_dim)
    elif rule.kind == "qkv_cat":
        import torch

        out = [torch.cat(_qkv_to_hf(tensor, rule.heads, rule.groups, rule.head_dim), dim=0)]
    elif rule.kind == "gate_up":
        out = list(tensor.chunk(2, dim=0))
    elif rule.kind == "class_token":
        out = [tensor.reshape(-1)]
    elif rule.kind == "vocab":
        rows = shapes[rule.hf[0]][0]
        if tensor.shape[0] < rows:
            raise ModelError(f"{rule.mg} has {tensor.shape[0]} vocabulary rows, the config {rows}",
                             hint="pass --base with the model (config and tokenizer) the checkpoint was trained from")
        out = [tensor[:rows]]
    else:
        out = [tensor]
    for name, t in zip(rule.hf, out):
        if tuple(t.shape) != tuple(shapes[name]):
            raise ModelError(f"{rule.mg} gives {name} the shape {tuple(t.shape)}, the model's is {tuple(shapes[name])}",
                             hint="pass --base with the config the Megatron checkpoint was trained with")
    return [t.contiguous() for t in out]


# ---------------------------------------------------------------------------------------------------- rules from keys


def _setting(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, None)
    return default if value is None else value


def _attention(cfg: Any, heads_name: str = "num_attention_heads", groups_name: str = "num_key_value_heads") -> dict[str, int]:
    heads = int(_setting(cfg, heads_name))
    groups = int(_setting(cfg, groups_name, heads))
    head_dim = int(_setting(cfg, "head_dim", 0) or cfg.hidden_size // heads)
    return {"heads": heads, "groups": groups, "head_dim": head_dim}


def _gpt_patterns(hf: str, lm_head: str) -> list[tuple[str, str, str]]:
    """(transformers key regex, Megatron name template, kind) of a decoder-only language model at `hf`."""
    h, mg = re.escape(hf), "language_model"
    layer = rf"{h}\.layers\.(\d+)\."
    out = rf"{mg}.decoder.layers.\1."
    return [
        (rf"{h}\.embed_tokens\.weight", f"{mg}.embedding.word_embeddings.weight", "vocab"),
        (rf"{re.escape(lm_head)}\.weight", f"{mg}.output_layer.weight", "vocab"),
        (rf"{h}\.norm\.weight", f"{mg}.decoder.final_layernorm.weight", "copy"),
        (layer + r"input_layernorm\.weight", out + "self_attention.linear_qkv.layer_norm_weight", "copy"),
        (layer + r"self_attn\.q_proj\.(weight|bias)", out + r"self_attention.linear_qkv.\2", "qkv:lm"),
        (layer + r"self_attn\.[kv]_proj\.(weight|bias)", "", "part"),
        (layer + r"self_attn\.o_proj\.weight", out + "self_attention.linear_proj.weight", "copy"),
        (layer + r"self_attn\.q_norm\.weight", out + "self_attention.q_layernorm.weight", "copy"),
        (layer + r"self_attn\.k_norm\.weight", out + "self_attention.k_layernorm.weight", "copy"),
        (layer + r"post_attention_layernorm\.weight", out + "mlp.linear_fc1.layer_norm_weight", "copy"),
        (layer + r"mlp\.gate_proj\.weight", out + "mlp.linear_fc1.weight", "gate_up"),
        (layer + r"mlp\.up_proj\.weight", "", "part"),
        (layer + r"mlp\.down_proj\.weight", out + "mlp.linear_fc2.weight", "copy"),
    ]


def _vit_layer_patterns(hf_layer: str, mg_layer: str, *, hf_names: dict[str, str]) -> list[tuple[str, str, str]]:
    """Patterns of a pre-norm ViT block with biases (CLIP / SigLIP / Qwen3-VL) onto a Megatron `TransformerLayer`.
    `hf_names`: the transformers names of norm1, norm2, fc1, fc2, out (and q or qkv)."""
    n = {k: re.escape(v) for k, v in hf_names.items()}
    out = [
        (hf_layer + n["norm1"] + r"\.(weight|bias)", mg_layer + r"self_attention.linear_qkv.layer_norm_\2", "copy"),
        (hf_layer + n["out"] + r"\.(weight|bias)", mg_layer + r"self_attention.linear_proj.\2", "copy"),
        (hf_layer + n["norm2"] + r"\.(weight|bias)", mg_layer + r"mlp.linear_fc1.layer_norm_\2", "copy"),
        (hf_layer + n["fc1"] + r"\.(weight|bias)", mg_layer + r"mlp.linear_fc1.\2", "copy"),
        (hf_layer + n["fc2"] + r"\.(weight|bias)", mg_layer + r"mlp.linear_fc2.\2", "copy"),
    ]
    if "qkv" in n:
        out.append((hf_layer + n["qkv"] + r"\.(weight|bias)", mg_layer + r"self_attention.linear_qkv.\2", "qkv_cat:vision"))
    else:
        out += [(hf_layer + r"self_attn\.q_proj\.(weight|bias)", mg_layer + r"self_attention.linear_qkv.\2", "qkv:vision"),
                (hf_layer + r"self_attn\.[kv]_proj\.(weight|bias)", "", "part")]
    return out


def _rules(keys: list[str], patterns: list[tuple[str, str, str]],
           attention: dict[str, dict[str, int]]) -> tuple[list[Rule], list[str], list[str]]:
    """Rules for the `keys` the patterns match (first match wins), the keys matched as `extra`, and the keys no
    pattern matches."""
    rules, extra, unmatched = [], [], []
    for key in keys:
        for rx, template, kind in patterns:
            m = re.fullmatch(rx, key)
            if m is None:
                continue
            if kind in ("part", "extra"):
                if kind == "extra":
                    extra.append(key)
                break
            base, _, which = kind.partition(":")
            hf: tuple[str, ...] = (key,)
            if base == "qkv":
                hf = (key, key.replace("q_proj", "k_proj"), key.replace("q_proj", "v_proj"))
            elif base == "gate_up":
                hf = (key, key.replace("gate_proj", "up_proj"))
            rules.append(Rule(m.expand(template), hf, base, **attention.get(which, {})))
            break
        else:
            unmatched.append(key)
    return rules, extra, unmatched


def vision_layers_used(config: Any) -> int:
    """Vision layers HF LLaVA reads: `hidden_states[vision_feature_layer]` is the output of that many layers
    (transformers `LlavaModel.get_image_features`). Raises ModelError for a list of feature layers."""
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ModelError(f"vision_feature_layer={layer!r}: Megatron's LLaVA reads one vision layer",
                         hint="convert a model whose vision_feature_layer is one integer")
    total = int(config.vision_config.num_hidden_layers)
    return total + 1 + layer if layer < 0 else layer


def llava_patterns(config: Any, family: Any) -> list[tuple[str, str, str]]:
    """Megatron-LM LLaVA: CLIP or SigLIP tower, MLP projector, GPT language model."""
    vision_type = config.vision_config.model_type
    if vision_type not in ("clip_vision_model", "siglip_vision_model"):
        raise ModelError(f"Megatron-LM's LLaVA has no layout for a {vision_type} vision tower",
                         hint="Megatron interop covers CLIP and SigLIP towers (vision_model_type clip / siglip)")
    if config.vision_feature_select_strategy == "default" and vision_type == "siglip_vision_model":
        raise ModelError("a SigLIP tower has no class token to drop (vision_feature_select_strategy=default)",
                         hint="use vision_feature_select_strategy=full")
    vt = re.escape(family.vision_tower)
    used = vision_layers_used(config)
    # layers past the feature layer are not part of Megatron's tower
    keep = "|".join(str(i) for i in range(used)) or "x"
    layer, mg_layer = rf"{vt}\.encoder\.layers\.({keep})\.", r"vision_model.decoder.layers.\1."
    clip = vision_type == "clip_vision_model"
    patterns = [
        (rf"{vt}\.embeddings\.patch_embedding\.(weight|bias)", r"vision_model.conv1.\1", "copy"),
        (rf"{vt}\.embeddings\.position_embedding\.weight", "vision_model.position_embeddings.weight", "copy"),
        (rf"{vt}\.embeddings\.class_embedding", "vision_model.class_token", "class_token"),
        (rf"{vt}\.pre_layrnorm\.(weight|bias)", r"vision_model.ln_pre.\1", "copy"),
        (rf"{vt}\.post_layernorm\.(weight|bias)", r"vision_model.ln_post.\1", "extra" if clip else "copy"),
        *_vit_layer_patterns(layer, mg_layer, hf_names={"norm1": "layer_norm1", "norm2": "layer_norm2", "fc1": "mlp.fc1",
                                                         "fc2": "mlp.fc2", "out": "self_attn.out_proj"}),
        (rf"{vt}\.encoder\.layers\.\d+\..*", "", "extra"),
        (rf"{vt}\.head\..*", "", "extra"),  # SigLIP's attention-pooling head: LLaVA does not use it
    ]
    proj = [re.escape(p) for p in family.projector][0]
    patterns += [(rf"{proj}\.linear_1\.(weight|bias)", r"vision_projection.encoder.linear_fc1.\1", "copy"),
                 (rf"{proj}\.linear_2\.(weight|bias)", r"vision_projection.encoder.linear_fc2.\1", "copy")]
    return patterns + _gpt_patterns(family.language_model, family.lm_head)


def qwen2_5_vl_patterns(config: Any, family: Any) -> list[tuple[str, str, str]]:
    """Megatron-Bridge Qwen2.5-VL: transformers' vision tower under `visual.`, GPT language model."""
    vt = re.escape(family.vision_tower)
    return [(rf"{vt}\.(.*)", r"visual.\1", "copy"), *_gpt_patterns(family.language_model, family.lm_head)]


def qwen3_vl_patterns(config: Any, family: Any) -> list[tuple[str, str, str]]:
    """Megatron-Bridge Qwen3-VL: Megatron vision transformer with DeepStack mergers, GPT language model."""
    vt = re.escape(family.vision_tower)
    ds, mg_ds = rf"{vt}\.deepstack_merger_list\.(\d+)\.", r"vision_model.decoder.deepstack_merger_list.\1."
    return [
        (rf"{vt}\.patch_embed\.proj\.(weight|bias)", r"vision_model.patch_embed.proj.\1", "copy"),
        (rf"{vt}\.pos_embed\.weight", "vision_model.pos_embed.weight", "copy"),
        *_vit_layer_patterns(rf"{vt}\.blocks\.(\d+)\.", r"vision_model.decoder.layers.\1.",
                             hf_names={"norm1": "norm1", "norm2": "norm2", "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2",
                                       "out": "attn.proj", "qkv": "attn.qkv"}),
        (ds + r"norm\.(weight|bias)", mg_ds + r"patch_norm.\2", "copy"),
        (ds + r"(linear_fc[12])\.(weight|bias)", mg_ds + r"\2.\3", "copy"),
        (rf"{vt}\.merger\.norm\.(weight|bias)", r"vision_model.merger.patch_norm.\1", "copy"),
        (rf"{vt}\.merger\.(linear_fc[12])\.(weight|bias)", r"vision_model.merger.\1.\2", "copy"),
        *_gpt_patterns(family.language_model, family.lm_head),
    ]


PATTERNS = {LLAVA: llava_patterns, QWEN25_VL: qwen2_5_vl_patterns, QWEN3_VL: qwen3_vl_patterns}


def layout_for(name: str, config: Any, family: Any, shapes: dict[str, tuple[int, ...]], tied: bool) -> Layout:
    """The `Layout` `name` of a transformers model of `family` with `config` and tensor `shapes` (its state-dict
    names). `tied`: the output layer shares the embedding (no `output_layer` in the checkpoint). Raises ModelError
    for a layout vlmctl does not know, a model it does not fit, or heads that do not divide into groups."""
    if name not in PATTERNS:
        raise ModelError(f"no Megatron layout named {name!r}", hint=f"layouts: {', '.join(LAYOUTS)}")
    text = config.get_text_config()
    attention = {"lm": _attention(text)}
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        heads = int(_setting(vision, "num_attention_heads", 0) or _setting(vision, "num_heads"))
        attention["vision"] = {"heads": heads, "groups": heads, "head_dim": int(vision.hidden_size) // heads}
    for part, att in attention.items():
        if att["heads"] % att["groups"]:
            raise ModelError(f"{att['heads']} attention heads do not split into {att['groups']} key/value groups ({part})")
    keys = sorted(shapes)
    if tied:
        keys = [k for k in keys if k != f"{family.lm_head}.weight"]
    rules, extra, stray = _rules(keys, PATTERNS[name](config, family), attention)
    if stray:
        raise ModelError(f"the Megatron {name} layout has no place for {len(stray)} tensors of the model (e.g. {stray[0]})",
                         hint="the model does not have the architecture this layout covers")
    optional = ("language_model.output_layer.weight",) if tied else ()
    return Layout(name, rules, extra, optional)

