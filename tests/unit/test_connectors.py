"""Compose-mode connectors: `model.projector=pixel_shuffle` builds Idefics3 and `model.projector=perceiver` builds Idefics2
from a SigLIP encoder and any LLM; each loads in vanilla transformers, counts visual tokens like its processor, and stage
`align` trains exactly the connector."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError, ModelError

TEXTS = ["What color is the circle? Answer with one word.", "blue", "How many squares are there?", "2"] * 10


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from vlmctl.models import build_model

    out = tmp_path_factory.mktemp("ps") / "model"
    result = build_model(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle",
                                      output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    return result


def test_pixel_shuffle_builds_idefics3_that_vanilla_transformers_loads_and_generates(built):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.families import get_family

    assert built.family == "idefics3" and built.info["model_class"] == "Idefics3ForConditionalGeneration"
    model = AutoModelForImageTextToText.from_pretrained(built.output_dir).eval()
    processor = AutoProcessor.from_pretrained(built.output_dir)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and model.config.scale_factor == 2
    # tiny encoder: 64 px / patch 8 = 8 x 8 patches -> 4 x 4 tokens per view after pixel shuffle by 2
    assert processor.image_seq_len == 16 and built.info["built_from"]["pixel_shuffle_scale"] == 2
    spec = get_family(built.family)
    assert built.visual_tokens_per_image == spec.num_visual_tokens(64, 64, processor)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color?"}]}],
                                         add_generation_prompt=True)
    for w, h in [(64, 64), (100, 60), (37, 211)]:
        batch = processor(images=[Image.new("RGB", (w, h), (10, 200, 30))], text=[text], return_tensors="pt")
        assert int((batch["input_ids"] == model.config.image_token_id).sum()) == spec.num_visual_tokens(w, h, processor)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3


def test_align_trains_exactly_the_pixel_shuffle_connector(built):
    from vlmctl.models import load_model
    from vlmctl.train import setup

    model, _, family = load_model(built.output_dir)
    parts = setup.model_parts(model, family)
    counts = setup.apply_stage(model, parts, setup.trainable_parts("align", None))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["model.connector.modality_projection.proj.weight"]
    assert counts["vision"] == counts["llm"] == 0 and counts["projector"] == built.parameters["projector"]
    # 64-wide SigLIP features x 2**2 -> the LLM's 128 dims
    assert built.parameters["projector"] == 64 * 4 * 128


def test_pixel_shuffle_settings_are_checked_before_weights(tmp_path):
    from transformers import CLIPVisionConfig

    from vlmctl.models.build import plan_build

    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=8).save_pretrained(tmp_path / "clip")
    with pytest.raises(ModelError, match="clip_vision_model.*SigLIP"):
        plan_build(ModelSection(vision=str(tmp_path / "clip"), llm="tiny", init="random", projector="pixel_shuffle"))
    with pytest.raises(ConfigError, match="does not divide the encoder's 8 x 8 patch grid"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", pixel_shuffle_scale=3))
    with pytest.raises(ConfigError, match="vision_feature_layer does not apply"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", vision_feature_layer=-1))
    with pytest.raises(ValueError, match="pixel_shuffle_scale applies to model.projector=pixel_shuffle only"):
        ModelSection(vision="tiny", llm="tiny", init="random", pixel_shuffle_scale=4)
    plan = plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", pixel_shuffle_scale=4))
    assert plan.family.name == "idefics3" and plan.projector.config == {"scale_factor": 4}
    assert plan_build(ModelSection(vision="tiny", llm="tiny", init="random")).family.name == "llava"


# ---- model.projector=perceiver: Idefics2 (SigLIP + perceiver resampler + any LLM)


@pytest.fixture(scope="module")
def perceiver(tmp_path_factory):
    from vlmctl.models import build_model

    out = tmp_path_factory.mktemp("perceiver") / "model"
    return build_model(ModelSection(vision="tiny", llm="tiny", init="random", projector="perceiver", perceiver_queries=12,
                                    perceiver_depth=2, perceiver_heads=4, output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)


def test_perceiver_builds_idefics2_that_vanilla_transformers_loads_and_generates(perceiver):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.families import get_family

    assert perceiver.family == "idefics2" and perceiver.info["model_class"] == "Idefics2ForConditionalGeneration"
    model = AutoModelForImageTextToText.from_pretrained(perceiver.output_dir).eval()
    processor = AutoProcessor.from_pretrained(perceiver.output_dir)
    assert type(model).__name__ == "Idefics2ForConditionalGeneration" and type(processor).__name__ == "Idefics2Processor"
    pc = model.config.perceiver_config
    assert (pc.resampler_n_latents, pc.resampler_depth, pc.resampler_n_heads, pc.resampler_head_dim) == (12, 2, 4, 32)
    assert pc.hidden_size == model.config.text_config.hidden_size == 128
    # 12 queries = 12 visual tokens per image, whatever its size
    assert processor.image_seq_len == 12 and perceiver.visual_tokens_per_image == 12
    assert perceiver.info["built_from"]["perceiver_queries"] == 12
    spec = get_family(perceiver.family)
    assert spec.num_visual_tokens(64, 64, model.config) == 12
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color?"}]}],
                                         add_generation_prompt=True)
    for w, h in [(64, 64), (100, 60), (37, 211)]:
        batch = processor(images=[Image.new("RGB", (w, h), (10, 200, 30))], text=[text], return_tensors="pt")
        assert int((batch["input_ids"] == model.config.image_token_id).sum()) == spec.num_visual_tokens(w, h, processor) == 12
        assert batch["pixel_values"].shape == (1, 1, 3, 64, 64)  # resized to the encoder's square size
    with torch.no_grad():
        feats = model.model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"])
        feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
        feats = feats[0] if isinstance(feats, (tuple, list)) else feats
        # random latents (not transformers' all-ones) make the 12 visual tokens differ from one another
        assert feats.reshape(-1, 12, 128).std(dim=1).min() > 0
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3


def test_region_cells_give_every_query_its_own_part_of_the_patch_grid():
    import torch

    from vlmctl.models.connectors import region_cells

    assert torch.equal(region_cells(16, 4), torch.eye(16, dtype=torch.bool))  # one query per patch, raster order
    blocks = region_cells(4, 4)  # 2 x 2 cells of 2 x 2 patches
    assert blocks.sum(1).tolist() == [4, 4, 4, 4] and blocks.sum(0).tolist() == [1] * 16
    assert blocks[0].nonzero().flatten().tolist() == [0, 1, 4, 5] and blocks[3].nonzero().flatten().tolist() == [10, 11, 14, 15]
    many = region_cells(64, 4)  # more queries than patches: each query the patch under its cell's centre
    assert many.sum(1).tolist() == [1] * 64 and many.sum(0).tolist() == [4] * 16
    odd = region_cells(12, 8)  # 3 x 4 cells over 8 x 8 patches
    assert bool(odd.any(1).all()) and bool(odd.any(0).all())


def test_region_seeded_perceiver_gives_each_visual_token_its_own_cell(perceiver):
    """`model.perceiver_init: region` (the default): visual token i reads cell i of a raster grid, so where an
    object sits decides which visual token carries it; the random encoder's position table is SigLIP-scaled."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.models.connectors import region_cells

    assert perceiver.info["built_from"]["perceiver_init"] == "region"
    shares = perceiver.info["resampler_own_cell_attention"]
    assert len(shares) == 2 and min(shares) > 0.5  # uniform attention would put 6 / 76 on a query's cell
    model = AutoModelForImageTextToText.from_pretrained(perceiver.output_dir).eval()
    processor = AutoProcessor.from_pretrained(perceiver.output_dir)
    table = model.model.vision_model.embeddings.position_embedding.weight
    assert float(table.detach().std()) == pytest.approx(64 ** -0.5, rel=0.1)  # SigLIP's N(0, 1 / width), not 0.02
    resampler = model.model.connector.perceiver_resampler
    with torch.no_grad():  # the latents' own keys are zero: no query attends to the latents
        keys = resampler.layers[0].self_attn.k_proj(resampler.layers[0].input_latents_norm(resampler.latents))
    assert float(keys.abs().max()) < 1e-4

    def tokens(picture):
        batch = processor(images=[picture], text=["<image>"], return_tensors="pt")
        with torch.no_grad():
            feats = model.model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"])
        feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
        return (feats[0] if isinstance(feats, (tuple, list)) else feats).reshape(12, -1)

    grey = Image.new("RGB", (64, 64), (120, 120, 120))
    base = tokens(grey)
    cells = region_cells(12, 8)  # 3 x 4 cells over the 8 x 8 patches
    for cell in (0, 6, 11):
        picture = grey.copy()
        for patch in cells[cell].nonzero().flatten().tolist():
            row, col = divmod(patch, 8)
            picture.paste((250, 30, 30), (col * 8, row * 8, col * 8 + 8, row * 8 + 8))
        change = (tokens(picture) - base).norm(dim=-1)  # [12]: how much each visual token moved
        assert int(change.argmax()) == cell


def test_region_seeding_needs_an_encoder_that_knows_where_a_patch_is(perceiver):
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmctl.models.connectors import seed_perceiver_regions

    model = AutoModelForImageTextToText.from_pretrained(perceiver.output_dir).eval()
    before = model.model.connector.perceiver_resampler.latents.detach().clone()
    with torch.no_grad():
        model.model.vision_model.embeddings.position_embedding.weight.zero_()
    assert seed_perceiver_regions(model, "model.vision_model", "model.connector") == []
    assert torch.equal(model.model.connector.perceiver_resampler.latents, before)
    # a later block that cannot be seeded (keys not square) leaves the first one unseeded too: checked before any write
    model = AutoModelForImageTextToText.from_pretrained(perceiver.output_dir).eval()
    resampler = model.model.connector.perceiver_resampler
    resampler.layers[1].self_attn.k_proj = torch.nn.Linear(128, 64, bias=False)
    state = {k: v.clone() for k, v in resampler.state_dict().items()}
    assert seed_perceiver_regions(model, "model.vision_model", "model.connector") == []
    assert all(torch.equal(v, state[k]) for k, v in resampler.state_dict().items())


def test_align_trains_exactly_the_perceiver_connector(perceiver):
    from vlmctl.models import load_model
    from vlmctl.train import setup

    model, _, family = load_model(perceiver.output_dir)
    parts = setup.model_parts(model, family)
    counts = setup.apply_stage(model, parts, setup.trainable_parts("align", None))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.startswith("model.connector.")}
    assert any(".modality_projection." in n for n in trainable) and "model.connector.perceiver_resampler.latents" in trainable
    assert counts["vision"] == counts["llm"] == 0 and counts["projector"] == perceiver.parameters["projector"]


def test_perceiver_settings_are_checked_before_weights(tmp_path):
    from transformers import CLIPVisionConfig

    from vlmctl.models.build import plan_build

    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=8).save_pretrained(tmp_path / "clip")
    with pytest.raises(ConfigError, match="model.vision=.*clip_vision_model.*SigLIP") as err:
        plan_build(ModelSection(vision=str(tmp_path / "clip"), llm="tiny", init="random", projector="perceiver"))
    assert "model.projector=mlp2x_gelu" in err.value.hint
    with pytest.raises(ConfigError, match="perceiver_heads=3 does not divide the LLM's hidden size 128"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="perceiver", perceiver_heads=3))
    with pytest.raises(ConfigError, match="vision_feature_layer does not apply"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="perceiver", vision_feature_layer=-1))
    for key in ("perceiver_queries", "perceiver_depth", "perceiver_heads"):
        with pytest.raises(ValueError, match=f"{key} applies to model.projector=perceiver only"):
            ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", **{key: 8})
    # the defaults, as a resolved config.yaml spells them out, are no error with another projector
    ModelSection(vision="tiny", llm="tiny", init="random", perceiver_queries=64, perceiver_depth=3, perceiver_heads=16)
    plan = plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="perceiver"))
    assert plan.family.name == "idefics2" and plan.projector.config == {
        "resampler_n_latents": 64, "resampler_depth": 3, "resampler_n_heads": 16}


def test_perceiver_composes_pretrained_siglip_and_llm(tmp_path):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig,
        SiglipVisionModel,
    )

    from vlmctl.models import build_model

    torch.manual_seed(0)
    SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         image_size=32, patch_size=8)).save_pretrained(tmp_path / "siglip")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    chat = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}<image>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    result = build_model(ModelSection(vision=str(tmp_path / "siglip"), llm=str(tmp_path / "qwen2"), projector="perceiver",
                                      perceiver_queries=8, perceiver_heads=4, output_dir=tmp_path / "out", dtype="fp32"))
    assert result.family == "idefics2" and result.visual_tokens_per_image == 8
    model = AutoModelForImageTextToText.from_pretrained(result.output_dir).eval()
    src = SiglipVisionModel.from_pretrained(tmp_path / "siglip").state_dict()
    mine = model.model.vision_model.state_dict()
    for name in ("encoder.layers.1.mlp.fc1.weight", "post_layernorm.weight", "embeddings.patch_embedding.weight"):
        assert torch.equal(mine[name], next(t for k, t in src.items() if k.endswith(name)))
    llm = Qwen2ForCausalLM.from_pretrained(tmp_path / "qwen2")
    assert torch.equal(model.model.text_model.layers[1].mlp.down_proj.weight, llm.model.layers[1].mlp.down_proj.weight)
    # the fresh connector is initialized, not left as uninitialized memory: norm gains one, finite weights
    resampler = model.model.connector.perceiver_resampler
    assert torch.equal(resampler.norm.weight, torch.ones(48)) and torch.equal(resampler.layers[0].input_latents_norm.weight, torch.ones(48))
    assert all(torch.isfinite(p).all() for p in model.model.connector.parameters())
