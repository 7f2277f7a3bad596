"""Speech-recognition scoring (`--task asr`): word and character error rates through jiwer on normalized
transcripts, per-sample word accuracy, several references, and `vlmctl eval --predictions` on a transcripts file;
the teacher-forced loss of an audio model writes its audio parts as training does."""

from __future__ import annotations

import json

import pytest

jiwer = pytest.importorskip("jiwer")

from vlmctl.evaluation.metrics import ScoredRecord, error_rates, normalize_transcript, score_records  # noqa: E402
from vlmctl.errors import UsageError  # noqa: E402


def test_transcripts_are_compared_lowercased_without_punctuation():
    assert normalize_transcript("  Hello, World!  Don't STOP -- 'quoted' text.\n") == "hello world don't stop quoted text"
    assert normalize_transcript("¿Qué tal? «Bien».") == "qué tal bien"


def test_error_rates_count_substitutions_deletions_and_insertions_over_the_corpus():
    metrics, per_sample = error_rates(
        ["the cat sat on a mat", "hello there", "", "one two three four"],
        [["The cat sat on the mat."], ["hello world", "Hello there!"], ["nothing here"], ["one two"]])
    # 1 substitution (a/the) of 6 words; 0 of 2 (the closer reference); 2 deletions of 2; 2 insertions over 2 words
    assert per_sample == pytest.approx([1 / 6, 0.0, 1.0, 1.0])
    assert metrics["wer"] == pytest.approx((1 + 0 + 2 + 2) / (6 + 2 + 2 + 2))
    assert metrics["word_accuracy"] == pytest.approx(1 - metrics["wer"])
    # the same through jiwer directly on the normalized text
    refs, hyps = ["the cat sat on the mat", "hello there", "nothing here", "one two"], ["the cat sat on a mat", "hello there", "", "one two three four"]
    assert metrics["wer"] == pytest.approx(jiwer.process_words(refs, hyps).wer)
    assert metrics["cer"] > 0 and metrics["cer"] == pytest.approx(jiwer.process_characters(refs, hyps).cer)


def test_score_records_for_asr_sets_word_accuracy_per_sample_and_refuses_empty_references():
    records = [ScoredRecord("a", "a tone at four forty", ["A tone at 440."]), ScoredRecord("b", "silence", ["Silence."])]
    metrics = score_records("asr", records)
    assert set(metrics) == {"wer", "cer", "word_accuracy"} and metrics["wer"] == pytest.approx(2 / 5)
    assert [r.score for r in records] == pytest.approx([0.5, 1.0])  # 1 - 2/4, 1 - 0
    with pytest.raises(UsageError, match="sample 'x' has only empty reference transcripts"):
        score_records("asr", [ScoredRecord("x", "hi", ["?!"])])


def test_eval_scores_a_transcripts_file(tmp_path, capsys, monkeypatch):
    from cli_runner import run_cli

    monkeypatch.chdir(tmp_path)
    rows = [{"id": "1", "prediction": "the quick brown fox", "references": ["The quick brown fox."]},
            {"id": "2", "prediction": "jumps over the dog", "references": ["jumps over the lazy dog"]}]
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli(["eval", "--predictions", str(tmp_path / "predictions.jsonl"), "--task", "asr", "-o", str(tmp_path / "out"), "--json"], capsys)
    assert code == 0, out + err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["task"] == "asr" and metrics["metrics"]["wer"] == pytest.approx(1 / 9)
    scored = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert [r["score"] for r in scored] == pytest.approx([1.0, 0.8])


def test_the_loss_of_an_audio_model_writes_its_audio_parts_as_training_does():
    pytest.importorskip("soundfile")
    import torch

    from audio_data import wav

    from vlmctl.config.model import ModelSection
    from vlmctl.data.collate import Collator
    from vlmctl.data.modalities.audio import normalize_audio
    from vlmctl.data.sample import Sample
    from vlmctl.evaluation.loss import family_of, teacher_forced_loss
    from vlmctl.models.build import make_model, make_processor, plan_build
    from vlmctl.train.objectives import loss_sum

    plan = plan_build(ModelSection(preset="tiny-qwen2-audio", init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=["What is it? A tone."] * 20)
    model = make_model(plan, processor)
    assert family_of(model) is plan.family
    sample = Sample("s", [{"role": "user", "content": [{"type": "audio", "index": 0}, {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A tone."}]}], audios=[normalize_audio(wav(0.5)).data])
    [(nats, tokens)] = teacher_forced_loss(model, processor, [sample], batch_size=1)
    with torch.no_grad():
        trained = float(loss_sum(model, Collator(processor, plan.family, dummy_image=False)([sample])))
    assert tokens > 0 and nats == pytest.approx(trained, rel=1e-5)
