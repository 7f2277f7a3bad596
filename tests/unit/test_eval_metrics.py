"""Metrics of `vlmctl eval` against worked examples of their definitions, plus property tests."""

from __future__ import annotations

import math
import random

import pytest

from vlmctl.errors import UsageError
from vlmctl.evaluation.metrics import (
    ScoredRecord,
    anls,
    bleu4,
    caption_tokenize,
    cider,
    exact_match,
    extract_option,
    infer_task,
    levenshtein,
    mcq_accuracy,
    normalize_vqa_answer,
    option_map,
    relaxed_accuracy,
    score_records,
    vqa_accuracy,
)

# --- VQA ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        # Rules listed on https://visualqa.org/evaluation.html and implemented in vqaEval.py:
        ("Two dogs.", "2 dogs"),  # lowercase, number words -> digits, period removed
        ("none", "0"),  # vqaEval.py maps "none" to "0"
        ("The dont", "don't"),  # article dropped, missing apostrophe added
        ("an apple", "apple"),
        ("100,978", "100978"),  # digit-comma-digit: punctuation removed without a space
        ("3.5", "3.5"),  # a period before a digit is kept
        ("black-and-white", "black and white"),  # a mark with no space next to it becomes a space
        ("yes !", "yes"),  # a mark next to a space is removed
        ("What\tis\nthis?", "what is this"),
        ("Im", "im"),  # vqaEval.py's table has "Im" capitalized but looks up lowercased words: kept as-is
    ],
)
def test_vqa_normalization_matches_official_rules(raw, expected):
    assert normalize_vqa_answer(raw) == expected


def test_vqa_normalization_is_idempotent():
    vocab = ["Two", "none", "the", "A", "an", "dont", "isnt", "cat's", "3.5", "100,978", "yes.", "no!", "black-and-white",
             "(red)", "a/b", "x_y", "ten", "1,000", "...", "-", "it's", "whats", "'ows'at", "somebody'd", "\t", "U.S.A."]
    rng = random.Random(0)
    for _ in range(500):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 6)))
        once = normalize_vqa_answer(text)
        assert normalize_vqa_answer(once) == once, text


@pytest.mark.parametrize("matching, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_ten_answers_leave_one_out(matching, expected):
    # Worked through the definition min(#humans/3, 1) averaged over the 10 choose 9 annotator subsets
    # (Antol et al. 2015; vqaEval.py): with k matching answers, k subsets see k-1 matches and 10-k see k.
    refs = ["two"] * matching + ["three"] * (10 - matching)
    assert vqa_accuracy("2", refs) == pytest.approx(expected)


def test_vqa_accuracy_single_reference_is_normalized_exact_match():
    assert vqa_accuracy("Two.", ["2"]) == 1.0
    assert vqa_accuracy("The cat", ["cat"]) == 1.0
    assert vqa_accuracy("cats", ["cat"]) == 0.0
    with pytest.raises(ValueError):
        vqa_accuracy("x", [])


def test_exact_match():
    assert exact_match(" Red  car ", ["red car"]) == 1.0
    assert exact_match("red", ["red car", "blue"]) == 0.0


# --- ANLS -----------------------------------------------------------------------------------------------------


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3  # the textbook example
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0


def test_anls_worked_examples():
    # Biten et al. 2019, eq. 1: s = 1 - NL if NL < 0.5 else 0; max over references.
    assert anls("the cats", ["The cat"]) == pytest.approx(1 - 1 / 8)  # one insertion over 8 characters
    assert anls("kitten", ["sitting"]) == pytest.approx(1 - 3 / 7)  # NL = 3/7 < 0.5
    assert anls("abcd", ["abxy"]) == 0.0  # NL = 0.5 is not below the threshold
    assert anls("abcd", ["abcx"]) == pytest.approx(0.75)
    assert anls("1990", ["in 1990", "1990"]) == 1.0  # best reference


def test_anls_properties():
    rng = random.Random(1)
    for _ in range(100):
        s = "".join(rng.choice("abcdefgh 12") for _ in range(rng.randint(1, 20))).strip() or "x"
        assert anls(s, [s]) == 1.0
        assert anls(s.upper() + "  ", [s]) == 1.0  # lowercased and stripped
        assert anls(s, ["zzzz qqqq"[: len(s)] or "z"]) == 0.0  # disjoint characters
        t = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 20)))
        assert 0.0 <= anls(s, [t]) <= 1.0


# --- ChartQA relaxed accuracy ---------------------------------------------------------------------------------


def test_relaxed_accuracy_worked_examples():
    # Masry et al. 2022 (ChartQA) / pix2struct relaxed_correctness: 5% relative tolerance for numbers.
    assert relaxed_accuracy("10.4", ["10"]) == 1.0
    assert relaxed_accuracy("10.5", ["10"]) == 1.0  # exactly 5%
    assert relaxed_accuracy("10.6", ["10"]) == 0.0
    assert relaxed_accuracy("-95", ["-100"]) == 1.0
    assert relaxed_accuracy("12%", ["0.12"]) == 1.0  # percentages read as fractions
    assert relaxed_accuracy("0.001", ["0"]) == 0.0  # no relative error around 0: exact match needed
    assert relaxed_accuracy("0", ["0"]) == 1.0
    assert relaxed_accuracy("Brazil", ["brazil"]) == 1.0
    assert relaxed_accuracy("Brazill", ["brazil"]) == 0.0


# --- Multiple choice ------------------------------------------------------------------------------------------


OPTIONS = ["a cat", "a dog", "dark blue", "blue"]


@pytest.mark.parametrize(
    "answer, letter",
    [
        ("B", "B"), ("(b)", "B"), ("B.", "B"), ("[C]", "C"), ("d", "D"),
        ("The answer is B", "B"), ("Answer: (C)", "C"), ("The correct option is d.", "D"),
        ("B. a dog", "B"), ("(B) a dog", "B"), ("C) dark blue", "C"),
        ("a dog", "B"), ("It is a dog.", "B"), ("The color is dark blue.", "C"), ("Blue", "D"),
        ("I think C is right", "C"),
        ("I don't know", None), ("A or B", None), ("", None),
    ],
)
def test_extract_option(answer, letter):
    assert extract_option(answer, OPTIONS) == letter


def test_extract_option_does_not_read_articles_as_letters():
    opts = ["red", "green"]  # letters A, B
    assert extract_option("A green square", opts) == "B"
    assert extract_option("The answer is a green one", opts) == "B"


def test_option_map_strips_repeated_letters():
    assert option_map(["A. cat", "(B) dog", "C) fish", "Don't know"]) == {"A": "cat", "B": "dog", "C": "fish", "D": "Don't know"}
    assert option_map({"a": "x", "b": "y"}) == {"A": "x", "B": "y"}


def test_mcq_accuracy_reference_by_letter_or_text():
    assert mcq_accuracy("The answer is (B).", ["B"], OPTIONS) == 1.0
    assert mcq_accuracy("B", ["a dog"], OPTIONS) == 1.0
    assert mcq_accuracy("A", ["a dog"], OPTIONS) == 0.0
    with pytest.raises(ValueError):
        mcq_accuracy("A", ["a horse"], OPTIONS)


# --- Captions -------------------------------------------------------------------------------------------------


def test_bleu4_worked_example():
    # Papineni et al. 2002 by hand: clipped precisions 5/6, 3/5, 2/4, 1/3, equal lengths (BP = 1)
    # -> (5/6 * 3/5 * 1/2 * 1/3) ** (1/4).
    expected = (5 / 6 * 3 / 5 * 1 / 2 * 1 / 3) ** 0.25
    assert bleu4(["the cat sat on the mat"], [["the cat sat on a mat"]]) == pytest.approx(expected, abs=1e-4)
    assert bleu4(["The cat sat on the mat."], [["the cat sat on the mat ."]]) == pytest.approx(1.0)
    # references of different counts per sample
    two = bleu4(["a b c d e", "f g h i j"], [["a b c d e", "x"], ["f g h i j"]])
    assert two == pytest.approx(1.0)


def test_cider_worked_example_and_per_sample_scores():
    # Vedantam et al. 2015 with two images of disjoint 5-word captions: every n-gram has document frequency 1, so
    # all tf-idf weights equal log(2); a candidate identical to its single reference has cosine 1 for n = 1..4
    # and no length penalty -> 10 x mean(1, 1, 1, 1) = 10.
    corpus, per = cider(["one two three four five", "six seven eight nine ten"],
                        [["one two three four five"], ["six seven eight nine ten"]])
    assert corpus == pytest.approx(10.0) and per == pytest.approx([10.0, 10.0])
    # A wrong caption scores 0; the corpus score is the mean.
    corpus, per = cider(["one two three four five", "eleven twelve"],
                        [["One two three four five."], ["six seven eight nine ten"]])
    assert per == pytest.approx([10.0, 0.0]) and corpus == pytest.approx(5.0)


def test_caption_tokenize_like_ptb():
    assert caption_tokenize("A man's dog doesn't run, (quickly)...") == "a man 's dog does n't run quickly"


# --- Corpus scoring -------------------------------------------------------------------------------------------


def test_score_records_sets_scores_and_metrics():
    recs = [ScoredRecord("1", "Two", ["2"]), ScoredRecord("2", "red", ["blue"])]
    metrics = score_records("vqa", recs)
    assert metrics == {"vqa_accuracy": 0.5, "exact_match": 0.0}
    assert [r.score for r in recs] == [1.0, 0.0]
    recs = [ScoredRecord("1", "B", ["a dog"], options=OPTIONS), ScoredRecord("2", "no idea", ["A"], options=OPTIONS)]
    assert score_records("mcq", recs) == {"mcq_accuracy": 0.5, "mcq_unparsed": 0.5}
    recs = [ScoredRecord("1", "invoice 12", ["Invoice 12"]), ScoredRecord("2", "x", ["yyy"])]
    assert score_records("docvqa", recs)["anls"] == pytest.approx(0.5)
    assert math.isnan(score_records("vqa", [])["vqa_accuracy"])


def test_score_records_rejects_bad_input():
    with pytest.raises(UsageError, match="'7' has no reference"):
        score_records("vqa", [ScoredRecord("7", "x", [])])
    with pytest.raises(UsageError, match="no options"):
        score_records("mcq", [ScoredRecord("8", "x", ["A"])])
    with pytest.raises(UsageError, match="unknown task"):
        score_records("nope", [])


def test_infer_task():
    assert infer_task([ScoredRecord("1", "", ["a"], options=["x", "y"])]) == "mcq"
    assert infer_task([ScoredRecord("1", "", ["a"], meta={"task": "docvqa"})]) == "docvqa"
    assert infer_task([ScoredRecord("1", "", ["a"]), ScoredRecord("2", "", ["b"], options=["x"])]) == "vqa"
