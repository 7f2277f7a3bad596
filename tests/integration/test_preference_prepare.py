"""`vlmctl data prepare` and `data validate` on preference pairs in each upstream layout: shards with a `rejected`
column that read back as pairs, reason codes in rejected.jsonl, the manifest's kind."""

from __future__ import annotations

import json

import pytest

from vlmctl.data.sample import Sample
from cli_runner import run_cli as run
from preference_data import LLAMAFACTORY, SWIFT, TRL, answers, write


@pytest.mark.parametrize("layout, records, good", [
    ("llamafactory", LLAMAFACTORY, [("Red.", "Blue."), ("Hi again.", "No.")]),
    ("trl", TRL, [("Green.", "Red."), (" blue.", " green."), ("4", "5")]),
    ("swift", SWIFT, [("Blue.", "Green."), ("Red.", "Pink.")]),
])
def test_data_prepare_reads_each_preference_layout(tmp_path, capsys, layout, records, good):
    import pyarrow.parquet as pq

    bad = {"llamafactory": {"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"}},
           "trl": {"prompt": "Q", "chosen": "A", "rejected": "A"},
           "swift": {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "rejected_response": " "}}[layout]
    write(tmp_path / "proj" / "data" / "pairs.jsonl", [*records, bad], jsonl=True)
    (tmp_path / "proj" / "vlmctl.yaml").write_text(
        "data:\n  sources:\n    - path: data/pairs.jsonl\n  val_ratio: 0.0\n  min_kept_fraction: 0\n")
    config = str(tmp_path / "proj" / "vlmctl.yaml")
    code, out, err = run(["-c", config, "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["kind"] == "preference" and result["sources"][0]["format"] == "preference"
    expected = {"trl": "same_response"}.get(layout, "missing_response")
    assert result["totals"]["kept"] == len(records) and result["totals"]["rejected"] == {expected: 1}
    prepared = tmp_path / "proj" / "data" / "prepared"
    rows = pq.read_table(prepared / "train" / "train-00000.parquet").to_pylist()
    assert [answers(Sample.from_row(r)) for r in rows] == good
    [line] = (prepared / "rejected.jsonl").read_text().splitlines()
    assert json.loads(line)["reason"] == expected and json.loads(line)["location"].endswith(f"pairs.jsonl:{len(records) + 1}")
    code, out, _ = run(["data", "validate", str(prepared), "--json"], capsys)
    assert code == 0 and json.loads(out)["kept"] == len(records)


def test_energon_export_refuses_pairs_and_leaves_nothing(tmp_path, capsys):
    write(tmp_path / "proj" / "data" / "pairs.jsonl", LLAMAFACTORY, jsonl=True)
    (tmp_path / "proj" / "vlmctl.yaml").write_text("data:\n  sources:\n    - path: data/pairs.jsonl\n  val_ratio: 0.0\n")
    code, _, err = run(["-c", str(tmp_path / "proj" / "vlmctl.yaml"), "data", "prepare", "--num-proc", "1", "--export", "energon"], capsys)
    assert code != 0 and "preference pairs cannot be exported to energon" in err
    assert not (tmp_path / "proj" / "data" / "prepared").exists()
