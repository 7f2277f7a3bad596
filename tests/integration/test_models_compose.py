"""Compose mode from local folders laid out like Hub checkpoints, base mode, and errors before weights load."""

from __future__ import annotations

import json

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError, ModelError

TEXTS = ["What color is the circle? Answer with one word.", "blue", "How many squares are there?", "2"] * 10
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string else m['content'] | map(attribute='text') | select('string') | join('') }}\n{% endfor %}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local folders as if downloaded from the Hub: full SigLIP/CLIP dual encoders + image processors, Qwen2/Llama
    causal LMs + tokenizers (the Llama one without a chat template and without <image>/<pad>)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPConfig, CLIPImageProcessor, CLIPModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
        Qwen2Config, Qwen2ForCausalLM, SiglipConfig, SiglipImageProcessor, SiglipModel,
    )

    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    tiny_text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=99)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8)
    SiglipModel(SiglipConfig(text_config=tiny_text, vision_config=vision)).save_pretrained(root / "siglip")
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "siglip")
    CLIPModel(CLIPConfig(text_config=tiny_text, vision_config=vision)).save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")

    def bpe(specials):
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        return t

    llm = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    qtok = PreTrainedTokenizerFast(tokenizer_object=bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT)
    Qwen2ForCausalLM(Qwen2Config(**llm, tie_word_embeddings=True, eos_token_id=qtok.eos_token_id)).save_pretrained(root / "qwen2")
    qtok.save_pretrained(root / "qwen2")
    ltok = PreTrainedTokenizerFast(tokenizer_object=bpe(["<s>", "</s>"]), bos_token="<s>", eos_token="</s>")
    LlamaForCausalLM(LlamaConfig(**{**llm, "vocab_size": 300}, bos_token_id=0, eos_token_id=1)).save_pretrained(root / "llama")
    ltok.save_pretrained(root / "llama")
    (root / "chat.jinja").write_text(CHAT)
    return root


def _roundtrip(out, family_text="Question: what color?"):
    """Reload with the Auto classes; return (model, processor, batch)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": family_text}]}], add_generation_prompt=True)
    if "<image>" not in text:  # a chat template that ignores image parts
        text = "<image>" + text
    batch = processor(images=[Image.new("RGB", (40, 30), (10, 200, 30))], text=[text], return_tensors="pt")
    return model, processor, batch


@pytest.mark.parametrize("vision,llm,strategy,tokens", [("siglip", "qwen2", "full", 16), ("clip", "llama", "default", 16)])
def test_compose_local_folders(hub, tmp_path, vision, llm, strategy, tokens):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from vlmctl.models import build_model, load_model

    extra = {"chat_template": str(hub / "chat.jinja")} if llm == "llama" else {}
    section = ModelSection(vision=str(hub / vision), llm=str(hub / llm), output_dir=tmp_path / "vlm", dtype="fp32", **extra)
    result = build_model(section)
    info = json.loads((result.output_dir / "vlmctl_model.json").read_text())
    assert info["mode"] == "compose" and info["built_from"]["vision_feature_select_strategy"] == strategy
    assert info["visual_tokens_per_image"] == tokens

    # The weights are the pretrained ones (vision tower and LLM copied, not re-initialized).
    model, processor, fam = load_model(result.output_dir)
    src_llm = AutoModelForCausalLM.from_pretrained(hub / llm)
    ours = dict(model.named_parameters())
    layer = ours["model.language_model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer, src_llm.model.layers[1].mlp.down_proj.weight)
    vsrc = AutoModel.from_pretrained(hub / vision)
    assert torch.equal(ours["model.vision_tower.encoder.layers.0.mlp.fc1.weight"], vsrc.vision_model.encoder.layers[0].mlp.fc1.weight)
    assert not any("head" in n and "vision_tower" in n for n in ours)  # SigLIP's pooling head is not carried
    # The image token (and <pad> for Llama) was added; embeddings are resized when the LLM's rows do not cover it.
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id
    assert model.get_input_embeddings().weight.shape[0] >= len(processor.tokenizer)
    if llm == "llama":
        assert len(processor.tokenizer) == 302 and model.get_input_embeddings().weight.shape[0] == 320
    assert processor.vision_feature_select_strategy == model.config.vision_feature_select_strategy == strategy

    # Logits of the in-memory model (before save) equal those of the Auto-class reload (after save).
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(section)
    in_memory = make_model(plan, make_processor(plan))
    reloaded, processor, batch = _roundtrip(result.output_dir)
    assert int((batch["input_ids"] == reloaded.config.image_token_id).sum()) == tokens
    with torch.no_grad():
        a = in_memory(**batch).logits
        b = reloaded(**batch).logits
    assert torch.equal(a, b)
    out = reloaded.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > batch["input_ids"].shape[1]


def test_linear_projector_starts_as_one_linear_map(hub, tmp_path):
    import torch

    from vlmctl.models import build_model, load_model

    section = ModelSection(vision=str(hub / "siglip"), llm=str(hub / "qwen2"), projector="linear", output_dir=tmp_path / "lin", dtype="fp32")
    build_model(section)
    model, _, _ = load_model(tmp_path / "lin")
    proj = model.model.multi_modal_projector
    assert model.config.projector_hidden_act == "linear"
    x = torch.randn(3, proj.linear_1.in_features)
    assert torch.allclose(proj(x), proj.linear_1(x), atol=1e-6)


def test_base_mode_records_family_and_copies_nothing(hub, tmp_path):
    from vlmctl.models import build_model, load_model

    build_model(ModelSection(vision=str(hub / "siglip"), llm=str(hub / "qwen2"), output_dir=tmp_path / "vlm", dtype="fp32"))
    result = build_model(ModelSection(base=str(tmp_path / "vlm"), output_dir=tmp_path / "ft"))
    from vlmctl.outputs import MARKER

    # no weights: the record of the base, and the marker every folder vlmctl writes carries
    assert sorted(p.name for p in (tmp_path / "ft").iterdir()) == sorted([MARKER, "vlmctl_model.json"])
    info = json.loads((tmp_path / "ft" / "vlmctl_model.json").read_text())
    assert info["family"] == result.family == "llava" and info["source"] == str((tmp_path / "vlm").resolve())
    model, processor, fam = load_model(tmp_path / "ft")
    assert fam.name == "llava" and type(model).__name__ == "LlavaForConditionalGeneration"
    assert info["parameters"]["total"] == sum(p.numel() for p in model.parameters())


def test_bad_input_is_caught_before_weights(hub, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from vlmctl.models import build_model, load_model

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the input was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    out = tmp_path / "x"
    with pytest.raises(ModelError, match="no chat template"):
        build_model(ModelSection(vision=str(hub / "clip"), llm=str(hub / "llama"), output_dir=out))
    with pytest.raises(ModelError, match="Hub is unreachable"):
        build_model(ModelSection(vision="nobody/no-such-encoder", llm=str(hub / "qwen2"), output_dir=out))
    with pytest.raises(ModelError, match="does not exist"):
        build_model(ModelSection(vision="./missing-folder", llm=str(hub / "qwen2"), output_dir=out))
    with pytest.raises(ModelError, match="not a vision encoder|not a ViT"):
        build_model(ModelSection(vision=str(hub / "qwen2"), llm=str(hub / "qwen2"), output_dir=out))
    with pytest.raises(ModelError, match="not a supported VLM family"):
        build_model(ModelSection(base=str(hub / "qwen2"), output_dir=out))
    with pytest.raises(ConfigError, match="has none"):
        build_model(ModelSection(vision=str(hub / "siglip"), llm=str(hub / "qwen2"), vision_feature_select_strategy="default", output_dir=out))
    with pytest.raises(ConfigError, match="outside the vision encoder"):
        build_model(ModelSection(vision=str(hub / "siglip"), llm=str(hub / "qwen2"), vision_feature_layer=-9, output_dir=out))
    with pytest.raises(ModelError, match="Hub is unreachable"):
        load_model("nobody/no-such-vlm")
    assert not out.exists()


def test_pixel_shuffle_composes_pretrained_siglip_and_llama_into_idefics3(hub, tmp_path):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from vlmctl.models import build_model

    section = ModelSection(vision=str(hub / "siglip"), llm=str(hub / "llama"), projector="pixel_shuffle",
                           chat_template=str(hub / "chat.jinja"), output_dir=tmp_path / "ps", dtype="fp32")
    result = build_model(section)
    assert result.family == "idefics3" and result.info["model_class"] == "Idefics3ForConditionalGeneration"
    model, processor, batch = _roundtrip(result.output_dir)
    # The pretrained weights are carried: SigLIP's vision model (without its `vision_model.` prefix) and the LLM.
    vsrc = AutoModel.from_pretrained(hub / "siglip").vision_model
    assert torch.equal(model.model.vision_model.encoder.layers[0].mlp.fc1.weight, vsrc.encoder.layers[0].mlp.fc1.weight)
    assert torch.equal(model.model.vision_model.post_layernorm.weight, vsrc.post_layernorm.weight)
    src_llm = AutoModelForCausalLM.from_pretrained(hub / "llama")
    assert torch.equal(model.model.text_model.layers[1].mlp.down_proj.weight, src_llm.model.layers[1].mlp.down_proj.weight)
    # 32 px / patch 8 = 4 x 4 patches -> 2 x 2 tokens per view; the (40 x 30) image is split into tiles + a global view.
    assert processor.image_seq_len == 4
    from vlmctl.families import get_family

    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == get_family(result.family).num_visual_tokens(40, 30, processor)
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > batch["input_ids"].shape[1]


def test_pixel_shuffle_refuses_a_clip_encoder_before_weights(hub, tmp_path):
    from vlmctl.models import build_model

    with pytest.raises(ModelError, match="SigLIP"):
        build_model(ModelSection(vision=str(hub / "clip"), llm=str(hub / "qwen2"), projector="pixel_shuffle", output_dir=tmp_path / "x"))
    assert not (tmp_path / "x").exists()
