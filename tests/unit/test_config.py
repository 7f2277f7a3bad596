"""The project file: schema errors, overrides, discovery, relative paths, generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmctl.config import apply_overrides, dump_config, find_config, load_config, parse_override
from vlmctl.errors import ConfigError


def test_defaults_fill_every_section(write_config):
    cfg = load_config(write_config("project:\n  name: p\n"))
    assert cfg.project.name == "p"
    assert cfg.train.strategy == "auto" and cfg.train.learning_rate == 2e-5
    assert cfg.eval.task == "auto" and cfg.hub.repo_id is None


def test_unknown_key_names_path_and_suggestion(write_config):
    path = write_config("train:\n  learnig_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "train.learnig_rate" in exc.value.message
    assert "did you mean train.learning_rate?" in exc.value.message
    assert exc.value.exit_code == 2


def test_unknown_key_in_list_item_and_nested_section(write_config):
    path = write_config("data:\n  sources:\n    - path: a.json\n      formt: llava\ntrain:\n  lora:\n    rank: 8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "data.sources[0].formt: did you mean data.sources[0].format?" in exc.value.message
    assert "unknown key train.lora.rank" in exc.value.message


def test_unknown_section_suggests_section(write_config):
    with pytest.raises(ConfigError) as exc:
        load_config(write_config("trian:\n  max_steps: 3\n"))
    assert "did you mean train?" in exc.value.message


def test_wrong_type_and_range_name_key_and_value(write_config):
    path = write_config("train:\n  micro_batch_size: many\n  learning_rate: -1\n  strategy: fsdp3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = exc.value.message
    assert "train.micro_batch_size = 'many'" in msg
    assert "train.learning_rate = -1" in msg
    assert "train.strategy = 'fsdp3'" in msg


def test_compose_and_base_are_exclusive(write_config):
    with pytest.raises(ConfigError, match="either model.base"):
        load_config(write_config("model:\n  base: org/vlm\n  llm: org/llm\n"))


def test_paths_are_relative_to_the_file(tmp_path, write_config):
    folder = tmp_path / "proj"
    path = write_config("data:\n  sources:\n    - path: raw/a.json\n      image_root: raw/img\n    - path: org/ds\n      format: hf\n", folder)
    cfg = load_config(path)
    assert Path(cfg.data.sources[0].path) == folder / "raw/a.json"
    assert cfg.data.sources[0].image_root == folder / "raw/img"
    assert cfg.data.sources[1].path == "org/ds"  # Hub ids are not paths
    assert cfg.data.prepared_dir == folder / "data/prepared"
    assert cfg.train.output_dir == folder / "outputs/runs"
    assert cfg.root == folder.resolve()


def test_model_refs_keep_hub_ids_and_resolve_local_paths(tmp_path, write_config):
    (tmp_path / "llm").mkdir()
    cfg = load_config(write_config("model:\n  vision: google/siglip-base-patch16-224\n  llm: ./llm\n"))
    assert cfg.model.vision == "google/siglip-base-patch16-224"
    assert cfg.model.llm == str((tmp_path / "llm").resolve())


def test_overrides_are_yaml_and_validated(write_config):
    path = write_config("train:\n  learning_rate: 1.0e-3\n")
    cfg = load_config(path, ["train.learning_rate=1e-4", "train.max_steps=50", "train.report_to=[tensorboard]", "train.lora.r=8"])
    assert cfg.train.learning_rate == 1e-4 and cfg.train.max_steps == 50
    assert cfg.train.report_to == ["tensorboard"]
    assert cfg.train.lora is not None and cfg.train.lora.r == 8
    with pytest.raises(ConfigError, match="train.max_stepz"):
        load_config(path, ["train.max_stepz=3"])
    with pytest.raises(ConfigError, match="train.max_steps = 'abc'"):
        load_config(path, ["train.max_steps=abc"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("max_steps=3")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("train.max_steps")
    assert apply_overrides({"data": {"sources": [{"path": "a"}]}}, ["data.sources.0.path=b"]) == {"data": {"sources": [{"path": "b"}]}}
    with pytest.raises(ConfigError, match="list index"):
        apply_overrides({"data": {"sources": []}}, ["data.sources.3.path=b"])


def test_discovery_walks_up_like_git(tmp_path, write_config, monkeypatch):
    path = write_config("project:\n  name: found\n", tmp_path / "proj")
    deep = tmp_path / "proj" / "a" / "b"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert find_config() == path.resolve()
    assert load_config().project.name == "found"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert find_config() is None
    with pytest.raises(ConfigError, match="no vlmctl.yaml"):
        load_config()


def test_missing_file_and_bad_yaml(tmp_path, write_config):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_config("train: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(write_config("- a\n- b\n"))


def test_dump_round_trips(write_config):
    import yaml

    cfg = load_config(write_config("train:\n  max_steps: 7\n"))
    again = yaml.safe_load(dump_config(cfg))
    assert again["train"]["max_steps"] == 7
    assert set(again) == {"project", "data", "model", "train", "eval", "hub"}


def test_every_field_has_a_description():
    from pydantic import BaseModel

    from vlmctl.config import VlmctlConfig
    from vlmctl.config.docs import _submodel

    seen, queue = [], [VlmctlConfig]
    while queue:
        model = queue.pop()
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            seen.append(name)
            sub = _submodel(field.annotation)
            if sub is not None and issubclass(sub, BaseModel):
                queue.append(sub)
    assert "learning_rate" in seen


def test_docs_config_md_is_generated_from_the_models():
    from vlmctl.config.docs import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text().strip() == render().strip(), "docs/config.md is stale: run `python -m vlmctl.config.docs > docs/config.md`"


def test_shipped_templates_validate(tmp_path):
    from vlmctl.project import available_templates, templates_dir

    names = available_templates()
    assert {"tiny", "llava", "qwen2.5-vl-lora"} <= set(names)
    for name in names:
        text = (templates_dir() / name / "vlmctl.yaml").read_text()
        path = tmp_path / name / "vlmctl.yaml"
        path.parent.mkdir()
        path.write_text(text)
        load_config(path)


def test_a_bad_override_is_blamed_on_the_command_line_not_the_file(write_config):
    from vlmctl.config import load_config
    from vlmctl.errors import ConfigError

    path = write_config("project: {name: p}\ntrain: {max_steps: 5}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["train.max_stepz=5"])
    assert "command line" in exc.value.message and "'train.max_stepz=5'" in exc.value.message
    assert f"{path} is invalid" not in exc.value.message
    # an error in the file itself is still the file's, beside an override's
    bad = write_config("project: {name: p}\ntrain: {max_stepz: 5}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(bad, ["data.val_ratio=2"])
    assert f"{bad} is invalid" in exc.value.message and "(command-line override 'data.val_ratio=2')" in exc.value.message
    assert "unknown key train.max_stepz: did you mean train.max_steps?\n" in exc.value.message + "\n"


def test_bare_on_and_off_in_yaml_or_overrides_mean_the_words(write_config):
    from vlmctl.config import load_config

    cfg = load_config(write_config("project: {name: p}\ntrain: {liger: on, compile_vision: off}\n"))
    assert (cfg.train.liger, cfg.train.compile_vision) == ("on", "off")
    cfg = load_config(write_config("project: {name: p}\n"), ["train.liger=off", "train.compile_vision=on"])
    assert (cfg.train.liger, cfg.train.compile_vision) == ("off", "kernels")  # the older word for the kernels


def test_a_dumped_config_loads_back_unchanged(write_config, tmp_path):
    """A run folder's config.yaml spells out every default; loading it back must give the same config."""
    from vlmctl.config import dump_config

    for text in ("project:\n  name: p\n", "project:\n  name: p\nmodel: {vision: tiny, llm: tiny, init: random, projector: pixel_shuffle, pixel_shuffle_scale: 4}\n"):
        cfg = load_config(write_config(text))
        again = tmp_path / "dumped.yaml"
        again.write_text(dump_config(cfg))
        assert load_config(again).model_dump() == cfg.model_dump()
