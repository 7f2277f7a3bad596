"""Megatron checkpoints <-> transformers models: `vlmctl convert --from megatron` and `--to megatron`.

    model, processor, notes = load_megatron(Path("ckpts/llava"), base="hf/llava-qwen2")   # any TP / PP split
    write_megatron(model, processor, Path("out"), tensor_parallel=2)                      # a torch_dist save dir

A Megatron checkpoint holds weights only: the model's transformers config and processor come from `base` (the HF
folder the Megatron run was converted from), or from the `hf/` folder vlmctl writes next to its exports. The
family's `megatron_layout` (`FamilySpec`) picks the layout (`layouts`); `checkpoint` reads and writes the files.

An export (`write_megatron`) is a save directory Megatron-LM and Megatron-Bridge load with `--load DIR`
(`--finetune`, no optimizer state):

    DIR/latest_checkpointed_iteration.txt     "0"
    DIR/iter_0000000/                          torch_dist: .metadata, __0_0.distcp, common.pt, metadata.json
    DIR/hf/                                    config.json, the processor, megatron.json (the Megatron-LM arguments
                                               of this model), extra.safetensors (tensors Megatron has no place for)

torch_dist stores each tensor whole, so the export serves any tensor-parallel size that divides the heads;
`tensor_parallel` checks that it does and pads the vocabulary to a multiple of 128 x N.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vlmctl.convert_megatron import checkpoint as ckpt
from vlmctl.convert_megatron.layouts import (LLAVA, VISION_SPLIT, Layout, layout_for, padded_vocab, to_hf, to_megatron,
                                             vision_layers_used)
from vlmctl.errors import ModelError, UsageError

if TYPE_CHECKING:
    import torch

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

HF_DIR = "hf"
ARGS_FILE = "megatron.json"
EXTRA_FILE = "extra.safetensors"
Progress = Callable[[str], None]


@dataclass
class MegatronSource:
    """A Megatron checkpoint to import: its save directory, iteration folder and the HF folder of its config."""

    path: Path
    iteration: Path
    hf_ref: str | None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"Megatron checkpoint at {self.iteration} ({ckpt.describe(self.iteration)})"


def find_source(src: Path, base: str | None) -> MegatronSource:
    """The iteration folder of `src` and the HF folder that gives its config and processor (`base`, else the `hf/`
    folder of a vlmctl export). Raises UsageError when neither is there."""
    src = Path(src)
    iteration = ckpt.iteration_folder(src)
    ref = base
    if ref is None:
        for cand in (src / HF_DIR, iteration.parent / HF_DIR):
            if (cand / "config.json").is_file():
                ref = str(cand)
                break
    return MegatronSource(src, iteration, ref)


def _family(config):
    from vlmctl.families import detect_family, get_family

    family = get_family(detect_family(config))
    if family.megatron_layout is None:
        raise ModelError(f"vlmctl has no Megatron layout for the {family.name} family",
                         hint="Megatron interop covers LLaVA (Megatron-LM) and Qwen2.5-VL / Qwen3-VL (Megatron-Bridge)")
    return family


def _empty_model(config, dtype=None):
    """The transformers model of `config` with uninitialized weights (allocated, not randomly filled):
    `AutoModelForImageTextToText` for vision-language models, `AutoModelForMultimodalLM` for the others."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from vlmctl.models.quiet import quiet_transformers

    cls = (transformers.AutoModelForImageTextToText if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
           else transformers.AutoModelForMultimodalLM)
    with quiet_transformers(), no_init_weights():
        model = cls.from_config(config, dtype=dtype or torch.float32)
    model.tie_weights()  # skipped with the initialization
    return model


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _tied(model) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def model_layout(model, family) -> Layout:
    """The Megatron layout of a transformers `model` of `family`."""
    return layout_for(family.megatron_layout, model.config, family, _shapes(model), _tied(model))


# ---------------------------------------------------------------------------------------------------- import


def _drop_unused_vision(config, notes: list[str]) -> None:
    """A foreign LLaVA checkpoint has only the vision layers LLaVA reads: the config keeps those
    (`vision_feature_layer` -1 over them) and drops SigLIP's pooling head, which LLaVA does not run."""
    used = vision_layers_used(config)
    vision = config.vision_config
    if used != vision.num_hidden_layers:
        notes.append(f"the vision tower keeps the {used} layers LLaVA reads (vision_feature_layer -1 of {used}, "
                     f"was {config.vision_feature_layer} of {vision.num_hidden_layers})")
        vision.num_hidden_layers = used
        config.vision_feature_layer = -1
    if getattr(vision, "vision_use_head", False):
        vision.vision_use_head = False
        notes.append("SigLIP's pooling head is dropped (LLaVA does not run it; Megatron has none)")


def load_megatron(source: MegatronSource, progress: Progress | None = None):
    """The transformers model (eval mode, the checkpoint's dtype) and processor of a Megatron checkpoint.

    Raises UsageError without an HF folder for the config, ModelError for a checkpoint that does not fit the config
    (a missing tensor, one the layout has no place for, another shape), CheckpointError for damaged or refused files.
    """
    import torch
    import transformers

    from vlmctl.models.load import load_or_explain, load_processor

    say = progress or (lambda _m: None)
    if source.hf_ref is None:
        raise UsageError(f"the Megatron checkpoint {source.path} holds weights only; its config and processor come from an HF folder",
                         hint="pass --base with the Hugging Face model folder the Megatron run was converted from (config.json + processor files)")
    config = load_or_explain("model config", source.hf_ref, lambda: transformers.AutoConfig.from_pretrained(source.hf_ref))
    family = _family(config)
    extra_path = Path(source.hf_ref) / EXTRA_FILE
    extra: dict[str, torch.Tensor] = {}
    if extra_path.is_file():
        from safetensors.torch import load_file

        extra = load_file(str(extra_path))
    with torch.device("meta"):
        meta = _empty_model(config)
    layout = model_layout(meta, family)
    source.notes.extend(layout_notes(config, layout))
    if layout.extra and not set(layout.extra) <= set(extra) and layout.name == LLAVA:
        _drop_unused_vision(config, source.notes)
        with torch.device("meta"):
            meta = _empty_model(config)
        layout = model_layout(meta, family)
    shapes = _shapes(meta)
    del meta

    say(f"reading {ckpt.describe(source.iteration)} weights from {source.iteration}")
    gated = {r.mg for r in layout.rules if r.kind == "gate_up"}
    tensors = ckpt.read(source.iteration, lambda name: name in gated)
    state: dict[str, torch.Tensor] = {}
    missing = [r.mg for r in layout.rules if r.mg not in tensors]
    if missing:
        raise ModelError(f"the Megatron checkpoint {source.iteration} lacks {len(missing)} tensors of the {layout.name} layout (e.g. {missing[0]})",
                         hint="pass --base with the model the checkpoint was trained from (its config sets the layers, biases and norms)")
    for rule in layout.rules:
        for name, tensor in zip(rule.hf, to_hf(rule, tensors.pop(rule.mg), shapes)):
            state[name] = tensor
    stray = sorted(k for k in tensors if k not in layout.optional)
    if stray:
        raise ModelError(f"the Megatron checkpoint {source.iteration} holds {len(stray)} tensors the {layout.name} layout has no place for (e.g. {stray[0]})",
                         hint="pass --base with the model the checkpoint was trained from (more layers or other parts than its config)")
    for name in layout.extra:
        if name in extra and tuple(extra[name].shape) == shapes[name]:
            state[name] = extra[name]
        elif name.endswith(("layernorm.weight", "layernorm.bias")):
            # CLIP's post layer norm: LLaVA reads the last layer's hidden state before it; identity keeps it inert
            state[name] = torch.ones(shapes[name]) if name.endswith("weight") else torch.zeros(shapes[name])
            source.notes.append(f"{name} is not in Megatron's tower and unused by LLaVA: set to the identity")
        else:
            raise ModelError(f"{name} has no place in a Megatron checkpoint and no {EXTRA_FILE} holds it",
                             hint="pass --base with the HF folder the checkpoint was converted from")
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    say(f"building {family.name} with the checkpoint's weights ({dtype})")
    model = _empty_model(config, dtype)
    result = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    sd = model.state_dict()
    loaded = {sd[k].data_ptr() for k in state if k in sd}
    left = [k for k in result.missing_keys if sd[k].data_ptr() not in loaded]
    if left or result.unexpected_keys:
        raise ModelError(f"the converted weights do not fill the model: missing {left[:3]}, unexpected {result.unexpected_keys[:3]}")
    processor = load_or_explain("processor", source.hf_ref, lambda: load_processor(source.hf_ref))
    return model.eval(), processor


# ---------------------------------------------------------------------------------------------------- export


def check_tensor_parallel(config, tensor_parallel: int, layout: Layout) -> None:
    """Raise UsageError unless `tensor_parallel` divides the heads, key/value groups, MLP width and vocabulary split
    of every tensor-parallel part (the language model; the vision tower of the Megatron vision layouts)."""
    if tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel {tensor_parallel} must be at least 1")
    text = config.get_text_config()
    sizes = {"attention heads": text.num_attention_heads,
             "key/value heads (num_key_value_heads)": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
             "MLP width (intermediate_size)": text.intermediate_size}
    if layout.name in VISION_SPLIT:
        vision = config.vision_config
        sizes["vision attention heads"] = getattr(vision, "num_attention_heads", None) or vision.num_heads
    for what, n in sizes.items():
        if n % tensor_parallel:
            raise UsageError(f"--tensor-parallel {tensor_parallel} does not divide the model's {n} {what}",
                             hint="choose a tensor-parallel size that divides it")


def megatron_args(config, layout: Layout, tensor_parallel: int, vocab_rows: int, tied: bool) -> dict[str, Any]:
    """The Megatron-LM arguments of the language model (`megatron/training/arguments.py` names)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    groups = getattr(text, "num_key_value_heads", None) or heads
    rope = getattr(text, "rope_parameters", None) or {}
    args = {
        "num_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
        "ffn_hidden_size": text.intermediate_size, "num_attention_heads": heads,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "kv_channels": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "normalization": "RMSNorm", "norm_epsilon": text.rms_norm_eps, "swiglu": True, "disable_bias_linear": True,
        "add_qkv_bias": any(r.mg.endswith("linear_qkv.bias") and r.mg.startswith("language_model") for r in layout.rules),
        "qk_layernorm": any(r.mg.endswith("q_layernorm.weight") for r in layout.rules),
        "position_embedding_type": "mrope" if "mrope_section" in rope else "rope",
        "rotary_base": rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
        "untie_embeddings_and_output_weights": not tied, "max_position_embeddings": text.max_position_embeddings,
        "tensor_model_parallel_size": tensor_parallel, "make_vocab_size_divisible_by": 128,
        "padded_vocab_size": vocab_rows, "ckpt_format": "torch_dist",
    }
    if "mrope_section" in rope:
        args["mrope_section"] = list(rope["mrope_section"])
    return args


def layout_notes(config, layout: Layout) -> list[str]:
    """What differs between the two frameworks' forward passes of a layout (said on import and export)."""
    vision = getattr(config, "vision_config", None)
    if layout.name == LLAVA and vision is not None and vision.model_type == "siglip_vision_model":
        return ["Megatron-LM's SigLIP ViT applies its final layer norm (ln_post, transformers' post_layernorm) to the "
                "image features; transformers' LLaVA reads the last layer's hidden state before it, so image features "
                "differ between the two unless the projector was trained for one of them"]
    return []


def write_megatron(model, processor, out: Path, *, tensor_parallel: int = 1, progress: Progress | None = None) -> dict[str, Any]:
    """Write `model` (a transformers model of a family with a Megatron layout) and `processor` as a Megatron save
    directory at the new folder `out` (see the module docstring). Returns the `megatron.json` record.

    Raises ModelError for a family without a layout or a model it does not fit, UsageError for a tensor-parallel
    size that does not divide the model."""
    from safetensors.torch import save_file

    say = progress or (lambda _m: None)
    family = _family(model.config)
    layout = model_layout(model, family)
    check_tensor_parallel(model.config, tensor_parallel, layout)
    sd = model.state_dict()
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = padded_vocab(vocab, tensor_parallel)
    tensors = {r.mg: to_megatron(r, [sd[k] for k in r.hf], rows) for r in layout.rules}
    say(f"writing torch_dist ({len(tensors)} tensors, vocabulary {vocab} padded to {rows})")
    ckpt.write(out, tensors)
    hf = out / HF_DIR
    hf.mkdir()
    model.config.save_pretrained(str(hf))
    processor.save_pretrained(str(hf))
    if layout.extra:
        save_file({k: sd[k].contiguous() for k in layout.extra}, str(hf / EXTRA_FILE))
    record = {"layout": layout.name, "family": family.name, "tensor_parallel": tensor_parallel,
              "vocab_size": vocab, "padded_vocab_size": rows,
              "megatron_args": megatron_args(model.config, layout, tensor_parallel, rows, _tied(model)),
              "notes": layout_notes(model.config, layout)}
    (hf / ARGS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def hf_state(model) -> dict[str, "torch.Tensor"]:
    """The model's state dict (for bit-exact comparisons of a round trip)."""
    return {k: v.detach() for k, v in model.state_dict().items()}
