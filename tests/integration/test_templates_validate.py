"""Every shipped template that brings its own data passes its own `vlmctl data validate` (exit 0), so the README's
`vlmctl data validate && vlmctl data prepare` goes through on a fresh project; a duplicate names the sample it repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmctl.config import load_config
from vlmctl.project import available_templates, init_project
from cli_runner import run_cli as run


def _ships_data(folder: Path) -> bool:
    """True when the project's data.sources exist right after `vlmctl init`."""
    sources = load_config(folder / "vlmctl.yaml").data.sources
    return bool(sources) and all(s.format == "hf" or Path(s.path).exists() for s in sources)


@pytest.mark.parametrize("template", available_templates())
def test_template_data_passes_validate(template, tmp_path, capsys, monkeypatch):
    init_project(tmp_path / "p", template)  # as shipped: the full generated set
    if not _ships_data(tmp_path / "p"):
        pytest.skip(f"the {template} template brings no data (the user adds theirs)")
    monkeypatch.chdir(tmp_path / "p")
    code, out, err = run(["data", "validate", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["counts"] == {}, report["counts"]
    assert report["total"] == report["kept"] > 0


def test_some_template_ships_data(tmp_path):
    shipped = []
    for template in available_templates():
        init_project(tmp_path / template, template, num_samples=8)
        if _ships_data(tmp_path / template):
            shipped.append(template)
    assert "tiny" in shipped


def test_a_duplicate_names_the_first_occurrence(tmp_path, capsys, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (40, 40), (10, 200, 10)).save(tmp_path / "green.png")
    rec = {"image": "green.png", "conversations": [{"from": "human", "value": "<image>\nColor?"}, {"from": "gpt", "value": "green"}]}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": f"a{i}", **rec}) if i == 2 else json.dumps(
        {"id": f"a{i}", "conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": "A"}]}) for i in range(4)) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "b0", **rec}) + "\n")
    code, out, _ = run(["data", "validate", "a.jsonl", "b.jsonl"], capsys)
    assert code == 1 and "duplicate" in out
    assert "b.jsonl:1: same normalized text and image bytes as an earlier sample (a.jsonl:3)" in " ".join(out.split())
