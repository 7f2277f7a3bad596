"""Files read back from elsewhere (reference answers in data sets and predictions files, a DPO run's precomputed
reference log-probs, profiler traces) with values of unexpected types get a clear error naming the file or sample,
never a traceback or a silently wrong score; and every HTML report escapes data-set and model text."""

from __future__ import annotations

import gzip
import json
import math
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, VlmctlError
from vlmctl.evaluation.metrics import ScoredRecord, score_records, vqa_accuracy
from vlmctl.evaluation.runner import read_predictions, references_of, score_predictions_file


def sample(meta: dict, answer: str = "an answer") -> Sample:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Is it red?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    return Sample(id="s-1", messages=messages, meta=meta, location="val.jsonl:7")


# ---------------------------------------------------------------------------------------------- reference answers


@pytest.mark.parametrize("meta, expected", [
    ({"answers": "no"}, ["no"]),  # one answer, not the letters n and o
    ({"answer": "no"}, ["no"]),
    ({"answers": 3}, ["3"]), ({"answers": 2.5}, ["2.5"]),
    ({"answers": [{"answer": "no"}, "nope", 0]}, ["no", "nope", "0"]),
    ({"answers": {"answer": "no"}}, ["no"]),
    ({"answers": []}, ["an answer"]), ({}, ["an answer"]),
])
def test_reference_answers_of_any_usable_shape_are_read_whole(meta, expected):
    assert references_of(sample(meta)) == expected


def test_a_string_answer_scores_as_one_answer():
    refs = references_of(sample({"answers": "no"}))
    assert vqa_accuracy("no", refs) == 1.0 and vqa_accuracy("n", refs) == 0.0


@pytest.mark.parametrize("meta, words", [
    ({"answers": [True]}, "bool True"), ({"answers": False}, "bool False"),
    ({"answers": {"text": "no"}}, "dict"), ({"answers": [["no"]]}, "[0] is list"),
    ({"answers": [None]}, "NoneType"), ({"answers": [{"answer": ["no"]}]}, "dict"),
    ({"answer": {"value": 1}}, "dict"), ({"answers": [float("nan")]}, "float nan"),
])
def test_reference_answers_of_another_shape_are_a_clear_error(meta, words):
    with pytest.raises(DataError) as caught:
        references_of(sample(meta))
    assert "sample 's-1' (val.jsonl:7)" in caught.value.message and words in caught.value.message, caught.value.message


def test_options_given_as_one_string_are_refused_not_lettered():
    from vlmctl.evaluation.runner import _record_of

    with pytest.raises(DataError, match="options are str"):
        _record_of(sample({"answers": "A", "options": "red blue"}))
    record = _record_of(sample({"answers": "A", "options": {"A": "red", "B": 2}}))
    assert record.options == {"A": "red", "B": "2"}


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row, words", [
    ({"id": 1, "prediction": "x", "references": {"a": 1}}, "dict"),
    ({"id": 1, "prediction": "x", "references": [{"text": "x"}]}, "[0] is dict"),
    ({"id": 1, "prediction": "x", "answers": [["x"]]}, "[0] is list"),
    ({"id": 1, "prediction": ["x"], "answer": "x"}, "prediction is list"),
    ({"id": 1, "prediction": {"text": "x"}, "answer": "x"}, "prediction is dict"),
    ({"id": 1, "prediction": "x", "answer": True}, "bool True"),
    ({"id": [1], "prediction": "x", "answer": "x"}, "id is list"),
    ({"id": 1, "prediction": "x", "answer": "A", "options": "ABCD"}, "options are str"),
    ({"id": 1, "prediction": "x", "answer": "A", "options": [["a"], "b"]}, "options are list"),
])
def test_a_predictions_row_of_unexpected_types_names_its_line(tmp_path, row, words):
    path = write_lines(tmp_path / "p.jsonl", [{"id": 0, "prediction": "x", "answer": "x"}, row])
    with pytest.raises(DataError) as caught:
        read_predictions(path)
    assert f"{path}:2" in caught.value.message and words in caught.value.message, caught.value.message


def test_unreadable_predictions_lines_name_their_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": 0, "prediction": "x", "answer": "x"}\n{"prediction": "\xff", "answer": "x"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: not UTF-8"):
        read_predictions(path)
    path.write_text('{"id": 0, "prediction": "x", "answer": "x"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:2: (nested too deeply|not valid JSON)"):
        read_predictions(path)


def test_numbers_and_one_string_answer_are_scored_as_written(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"id": "a", "prediction": "no", "answer": "no"},
                                              {"id": "b", "prediction": 2, "references": 2},
                                              {"id": "c", "prediction": "yes", "answers": [{"answer": "yes"}, "yes", 1]}])
    result = score_predictions_file(path, task="vqa")
    assert [r.references for r in result.records] == [["no"], ["2"], ["yes", "yes", "1"]]
    assert [r.score for r in result.records][:2] == [1.0, 1.0] and result.records[2].score == pytest.approx(vqa_accuracy("yes", ["yes", "yes", "1"]))


# ---------------------------------------------------------------------------------------------- reference log-probs


@pytest.mark.parametrize("content, words", [
    ("[[-1.0, -2.0]]", "a JSON list"), ('"pairs"', "a JSON str"),
    ('{"p1": "ab"}', "'p1' holds \"ab\""), ('{"p1": [-1.0]}', "'p1' holds [-1.0]"),
    ('{"p1": [-1.0, -2.0, -3.0]}', "'p1' holds"), ('{"p1": [true, -2.0]}', "'p1' holds [true"),
    ('{"p1": [-1.0, NaN]}', "'p1' holds [-1.0, NaN]"), ('{"p1": [-1.0, "-2"]}', "'p1' holds"),
    ('{"p1": {"chosen": -1, "rejected": -2}}', "'p1' holds"), ("[" * 100_000, "nested too deeply"),
])
def test_precomputed_reference_logps_of_another_shape_are_refused(tmp_path, content, words):
    from vlmctl.train.reference import read_reference

    path = tmp_path / "reference_logps.json"
    path.write_text(content)
    objective = SimpleNamespace(precomputed=None)
    with pytest.raises(VlmctlError) as caught:
        read_reference(objective, path)
    assert str(path) in caught.value.message and words in caught.value.message, caught.value.message
    assert objective.precomputed is None and "train.dpo.reference" in caught.value.hint


def test_precomputed_reference_logps_are_read_as_floats(tmp_path):
    from vlmctl.train.reference import read_reference

    path = tmp_path / "reference_logps.json"
    path.write_text(json.dumps({"p1": [-1, -2.5], "p2": [0.0, -3e2]}))
    objective = SimpleNamespace(precomputed=None)
    assert read_reference(objective, path) == 2
    assert objective.precomputed == {"p1": (-1.0, -2.5), "p2": (0.0, -300.0)}
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(VlmctlError, match="cannot be read"):
        read_reference(objective, path)


# ---------------------------------------------------------------------------------------------- traces


def kernel(name, ts, dur, **extra):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 2, "args": {}, **extra}


@pytest.mark.parametrize("trace", ['"traceEvents"', '["traceEvents"]', '{"traceEvents": {"a": 1}}', '{"traceEvents": "x"}',
                                   "[" * 100_000])
def test_a_file_that_is_not_a_trace_is_a_value_error_and_exit_2(tmp_path, trace, capsys):
    from vlmctl.profiling import idle_report, main

    path = tmp_path / "trace.json"
    path.write_text(trace)
    with pytest.raises(ValueError):
        idle_report(path)
    assert main([str(path)]) == 2 and str(path) in capsys.readouterr().err


def test_a_truncated_gzip_trace_is_a_value_error(tmp_path):
    from vlmctl.profiling import idle_report

    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [kernel("a", 0, 10)] * 500}, f)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises((ValueError, OSError)):
        idle_report(path)


def test_events_of_unexpected_types_are_left_out_of_the_report():
    from vlmctl.profiling import idle_report

    real = [kernel("a", 0, 100), kernel("b", 1100, 100)]
    junk = [None, 7, "x", [1, 2], {"ph": "X"}, kernel(None, 0, 5), kernel("c", "10", 5), kernel("d", 10, True),
            kernel("e", 2000, 5, args=[1]), kernel("f", 3000, 5, args={"correlation": [1]}), kernel(["g"], 4000, 5)]
    trace = {"traceEvents": [*junk[:5], real[0], *junk[5:], real[1]]}
    report = idle_report(trace)
    assert report.gaps == 1 and report.idle_s == pytest.approx(1000 / 1e6)
    assert report.compute_s == pytest.approx(200 / 1e6)
    assert trace["traceEvents"][7] == kernel("c", "10", 5)  # the input is not modified


# ---------------------------------------------------------------------------------------------- HTML reports

HOSTILE = "\"'><script>alert(1)</script><img src=x onerror=alert(2)><a href='javascript:x'>&amp;</a>\u202e"


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attributes = set(), set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attributes.update(name for name, _ in attrs)


def parsed(page: str) -> Tags:
    tags = Tags()
    tags.feed(page)
    return tags


def test_the_eval_report_escapes_every_data_set_and_model_text():
    from vlmctl.evaluation.report import render_report
    from vlmctl.evaluation.results import EvalResult

    records = [ScoredRecord(id=HOSTILE, prediction=HOSTILE, references=[HOSTILE, "2"], options={HOSTILE: HOSTILE, "B": "2"},
                            prompt=HOSTILE, score=0.5),
               ScoredRecord(id="plain", prediction="x", references=["y"], options=[HOSTILE, "z"], prompt="p", score=None)]
    result = EvalResult(task="mcq", model=HOSTILE, data=HOSTILE, metrics={"mcq_accuracy": math.nan, HOSTILE: 1.0}, records=records,
                        skipped=[{"location": HOSTILE, "id": HOSTILE, "reason": HOSTILE, "detail": HOSTILE}])
    page = render_report(result, {HOSTILE: b"not an image"})
    tags = parsed(page)
    assert "script" not in tags.tags and "img" not in tags.tags and "a" not in tags.tags
    assert tags.attributes <= {"charset", "class", "id"}
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 10


def test_the_rollouts_page_escapes_every_data_set_and_model_text(tmp_path):
    from vlmctl.train.grpo import write_rollouts_html

    run = tmp_path / "run-1"
    run.mkdir()
    samples = [{"step": 3, "id": HOSTILE, "prompt": HOSTILE, "references": [HOSTILE, "b"], "completions": [HOSTILE, "</td></tr>"],
                "rewards": [1.0, 0.0], "advantages": [0.7, -0.7]}]
    write_rollouts_html(run / "rollouts.html", samples)
    page = (run / "rollouts.html").read_text()
    tags = parsed(page)
    assert "script" not in tags.tags and "img" not in tags.tags and "a" not in tags.tags
    assert tags.attributes <= {"charset", "class"}
    assert page.count("&lt;script&gt;") == 4 and "&lt;/td&gt;&lt;/tr&gt;" in page
    assert not list(run.glob(".*.tmp"))
