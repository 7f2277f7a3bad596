"""The family registry: every registered family has a tiny preset that builds, its spec's module paths resolve on
that model, the registry lists it, and `vlmctl model build --list` shows it."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from cli_runner import run_cli
from vlmctl.config.model import ModelSection
from vlmctl.errors import ModelError
from vlmctl.families import (
    FAMILIES,
    FamilySpec,
    compose_family,
    count_parameters,
    decoder_layer_classes,
    decoder_layers,
    detect_family,
    family_table,
    get_family,
    register,
    vision_layer_classes,
    vision_layers,
)

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_unknown_family_errors():
    with pytest.raises(ModelError, match="unknown model family"):
        get_family("blip9")
    with pytest.raises(ModelError, match="not a supported VLM family"):
        detect_family({"model_type": "qwen2"})
    assert get_family("qwen2.5-vl").name == "qwen2_5_vl"


def test_every_family_names_a_tiny_preset_of_itself():
    from vlmctl.models.build import load_preset

    for name, spec in FAMILIES.items():
        assert spec.name == name and isinstance(spec, FamilySpec)
        assert spec.tiny_preset, name
        assert load_preset(spec.tiny_preset)["family"] == name
        for model_type in spec.model_types:
            assert detect_family({"model_type": model_type}) == name
        # the prompt holds the image token, or (Gemma 3) a marker the processor expands into image tokens: checked
        # on the real processor in test_tiny_preset_builds_and_the_spec_resolves_its_paths (families without images:
        # their first modality's prompt)
        if "image" in spec.modalities:
            assert spec.image_token == spec.modalities["image"] and spec.image_prompt
        else:
            assert all(spec.modalities[m] in spec.prompt(m) for m in spec.modalities)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_preset_builds_and_the_spec_resolves_its_paths(name):
    from vlmctl.models.build import make_model, make_processor, plan_build

    spec = FAMILIES[name]
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", dtype="fp32"))
    assert plan.family is spec
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    model = make_model(plan, processor)
    assert type(model).__name__ == spec.model_class and type(processor).__name__ == spec.processor_class
    for path in (*(e.path for e in spec.encoders.values()), *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)  # raises AttributeError when the path is wrong
    # every encoder: its own blocks (the classes it names), a cost rule that reads the model, the modalities it
    # encodes among the family's (an image encoder may also take the family's videos)
    from vlmctl.families import encoder_layers

    for key, enc in spec.encoders.items():
        blocks = encoder_layers(model, spec)[key]
        assert blocks and (not enc.layer_classes or {type(b).__name__ for b in blocks} == set(enc.layer_classes)), key
        assert enc.shape(model) is not None and set(enc.modalities) & set(spec.modalities), key
    counts = count_parameters(model, spec)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    assert len(decoder_layers(model, spec)) == model.config.get_text_config().num_hidden_layers
    assert vision_layers(model, spec)
    for found, named in ((decoder_layer_classes(model, spec), spec.decoder_layer_classes),
                         (vision_layer_classes(model, spec), spec.vision_layer_classes)):
        assert found and (not named or {c.__name__ for c in found} == set(named))
    tok = processor.tokenizer
    for token in (*spec.modalities.values(), *spec.special_tokens):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    for key, token in spec.config_token_ids.items():
        assert getattr(model.config, key) == tok.convert_tokens_to_ids(token), key
    # what a chat template writes for one image (one second of audio) expands to the family's token rule's tokens
    if "image" not in spec.modalities:
        import numpy as np

        rate = processor.feature_extractor.sampling_rate
        out = processor(text=[spec.prompt("audio")], audio=[np.zeros(rate, np.float32)], sampling_rate=rate, return_tensors="pt")
        assert int((out["input_ids"] == tok.convert_tokens_to_ids(spec.modalities["audio"])).sum()) == spec.num_audio_tokens(rate, rate, processor) > 0
        return
    from PIL import Image

    out = processor(text=[spec.image_prompt], images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    assert int((out["input_ids"] == tok.convert_tokens_to_ids(spec.image_token)).sum()) == spec.num_visual_tokens(64, 64, processor)


def test_the_registry_lists_every_family():
    rows = family_table()
    assert [r["name"] for r in rows] == list(FAMILIES)
    json.dumps(rows)  # plain data
    for row in rows:
        spec = FAMILIES[row["name"]]
        assert row["model_class"] == spec.model_class and row["vision_tower"] == spec.vision_tower
        assert row["projector"] == list(spec.projector) and row["language_model"] == spec.language_model
        assert row["modalities"] == dict(spec.modalities) and row["liger_patch"] == spec.liger_patch
    assert sum(r["compose"] for r in rows) >= 1 and compose_family().compose


def test_model_build_list_shows_every_family(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no project file needed
    code, out, err = run_cli(["model", "build", "--list"], capsys)
    assert code == 0, err
    for spec in FAMILIES.values():
        assert spec.name in out and spec.model_class in out and spec.language_model in out
    code, out, err = run_cli(["model", "build", "--list", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == list(FAMILIES)
    assert all(r["vision_tower"] == FAMILIES[r["name"]].vision_tower for r in rows)


def test_register_refuses_a_taken_name_or_model_type():
    spec = next(iter(FAMILIES.values()))
    before = dict(FAMILIES)
    with pytest.raises(ModelError, match="registered twice"):
        register(spec)
    clash = dataclasses.replace(spec, name="another")
    with pytest.raises(ModelError, match="belongs to families"):
        register(clash)
    assert FAMILIES == before


def test_specs_pickle_and_answer_like_the_original():
    for spec in FAMILIES.values():
        copy = pickle.loads(pickle.dumps(spec))
        assert type(copy) is type(spec) and copy.name == spec.name and copy.projector == spec.projector
        config = {"vision_config": {"image_size": 224, "patch_size": 14}}
        if spec.mrope:
            assert copy.num_visual_tokens(448, 448, config) == spec.num_visual_tokens(448, 448, config)


def test_encoders_declare_what_was_read_off_the_model():
    # only the Qwen-VL towers that return merged tokens for all images split them over sequence-parallel ranks;
    # only Qwen-VL's take the patch-embedding GEMM and the compiled rotary kernels
    split = sorted(n for n, f in FAMILIES.items() if any(e.sequence_split for e in f.encoders.values()))
    assert split == ["qwen2_5_vl", "qwen2_vl"]
    gemm = {n for n, f in FAMILIES.items() if any("patch_embed_gemm" in e.kernels for e in f.encoders.values())}
    assert gemm == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni", "qwen3_omni"}
    audio = {n: [k for k, e in f.encoders.items() if "audio" in e.modalities] for n, f in FAMILIES.items() if "audio" in f.modalities}
    assert audio == {"qwen2_audio": ["audio"], "qwen2_5_omni": ["audio"], "qwen3_omni": ["audio"], "phi4_multimodal": ["audio"]}
    # the audio features are `input_features` (Whisper's extractor), Phi-4-multimodal's `audio_input_features`
    assert all(any(k.endswith("input_features") for k in e.data_keys) == ("audio" in e.modalities)
               for f in FAMILIES.values() for e in f.encoders.values())


def test_a_spec_refuses_modalities_it_does_not_accept():
    spec = compose_family()
    assert "video" not in spec.modalities
    with pytest.raises(ModelError, match="does not accept video"):
        spec.prompt("video")
    assert spec.sequence_parallel_plan is None  # nothing beyond the sequence
    assert spec.tensor_parallel_plan["self_attn.q_proj"] == "colwise"  # any Llama / Qwen-style language model
