"""Answer-scoring metrics for VQA, document VQA, charts, multiple choice, captions and speech recognition.

Every function takes plain strings; none loads a model. Values are fractions in [0, 1] except CIDEr, which keeps
its published scale (the mean over images of 10 x the averaged n-gram cosine similarity; 1.0 here is "100" in
papers that print it x100).

| task      | metrics (first = primary, used as the per-sample `score`) | source                                   |
|-----------|------------------------------------------------------------|------------------------------------------|
| `vqa`     | `vqa_accuracy`, `exact_match`                              | VQAv2 official evaluation (`vqaEval.py`) |
| `docvqa`  | `anls`, `exact_match`                                      | ST-VQA / DocVQA                           |
| `chartqa` | `relaxed_accuracy`, `exact_match`                          | ChartQA, pix2struct `relaxed_correctness` |
| `mcq`     | `mcq_accuracy`, `mcq_unparsed`                             | MMBench-style option extraction           |
| `caption` | `cider`, `bleu4`                                           | CIDEr (pycocoevalcap), BLEU (sacrebleu)   |
| `asr`     | `wer`, `cer`, `word_accuracy`                              | word / character error rate (jiwer)       |

Lower is better for `wer` and `cer` (errors per reference word / character, corpus-level; above 1 when the
predictions insert more words than the references hold); the per-sample `score` of `asr` is that sample's word
accuracy, max(0, 1 - WER), so that higher is better for every task's per-sample score.

Use `score_records(task, records)` to score a list of `ScoredRecord`s in place and get the corpus metrics.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from vlmctl.errors import UsageError, VlmctlError

TASKS = ("vqa", "docvqa", "chartqa", "mcq", "caption", "asr")

# ---------------------------------------------------------------------------------------------------------------
# VQAv2 answer normalization. Tables and rules from the official evaluation script `vqaEval.py`
# (github.com/GT-Vision-Lab/VQA, PythonEvaluationTools/vqaEvaluation/vqaEval.py, Agrawal et al.), described at
# https://visualqa.org/evaluation.html.
# ---------------------------------------------------------------------------------------------------------------

_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}
_ARTICLES = {"a", "an", "the"}
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
# The official pattern, quirk included: "(?!<=\d)" is a negative lookahead (not a lookbehind), so a period is
# removed unless a digit follows it ("3.5" keeps its period, "yes." loses it).
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")


def _process_punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:
        # A mark next to a space, or any text with a digit-comma-digit, loses the mark; otherwise it becomes a space.
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out)


def _process_digit_article(text: str) -> str:
    words = [_NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in _ARTICLES]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words)


def normalize_vqa_answer(text: str) -> str:
    """The VQAv2 answer normalization of the official `vqaEval.py`.

    Newlines and tabs become spaces; punctuation in `;/[]"{}()=+\\_->< @`,?!` is removed (next to a space, or when
    the text has a digit-comma-digit such as "100,978") or replaced by a space; periods not followed by a digit are
    removed; then the text is lowercased, number words zero..ten (and "none") become digits, the articles a/an/the
    are dropped and missing contraction apostrophes are added ("dont" -> "don't").

    One deliberate difference: the official script passes `re.UNICODE` (32) as the *count* of the period
    substitution, so it stops after 32 periods; all periods are handled here.
    """
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _process_digit_article(_process_punctuation(text))


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """VQA accuracy of one answer (Antol et al. 2015, "VQA: Visual Question Answering"; VQAv2 `vqaEval.py`).

    With several references (VQAv2 has 10 per question), acc = mean over the leave-one-out subsets of the
    references of min(#references in the subset equal to the answer / 3, 1): an answer given by 3 of 10
    annotators scores 0.9, by 2 scores 0.6, by 1 scores 0.3. With a single reference this is exact match.
    Prediction and references are compared after `normalize_vqa_answer`.

    The official script normalizes only when the references disagree (VQAv2's references are stored normalized);
    normalizing always, as lmms-eval does, gives the same result on VQAv2 and is robust on other data.

    Raises ValueError when `references` is empty.
    """
    if not references:
        raise ValueError("vqa_accuracy needs at least one reference")
    pred = normalize_vqa_answer(prediction)
    refs = [normalize_vqa_answer(r) for r in references]
    if len(refs) == 1:
        return float(pred == refs[0])
    matches = sum(r == pred for r in refs)
    # Leaving out a matching reference leaves matches-1 matches; leaving out any other leaves all of them.
    accs = [min(1.0, (matches - (r == pred)) / 3.0) for r in refs]
    return sum(accs) / len(accs)


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the answer equals one of the references after lowercasing and collapsing whitespace, else 0.0."""
    pred = " ".join(prediction.lower().split())
    return float(any(pred == " ".join(r.lower().split()) for r in references))


# ---------------------------------------------------------------------------------------------------------------
# ANLS
# ---------------------------------------------------------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1); O(len(a) * len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(prediction: str, references: Sequence[str], threshold: float = 0.5) -> float:
    """Average Normalized Levenshtein Similarity of one answer (Biten et al. 2019, "Scene Text Visual Question
    Answering", eq. 1; used by DocVQA, Mathew et al. 2021).

    s(ref, pred) = 1 - NL(ref, pred) when NL < `threshold` (0.5), else 0, where NL = Levenshtein distance /
    max(len(ref), len(pred)) on lowercased strings with surrounding and repeated whitespace removed (as the DocVQA
    evaluation does); the score is the maximum of s over the references. Two empty strings score 1.

    Raises ValueError when `references` is empty.
    """
    if not references:
        raise ValueError("anls needs at least one reference")
    pred = " ".join(prediction.lower().split())
    best = 0.0
    for ref in references:
        ref = " ".join(ref.lower().split())
        longest = max(len(ref), len(pred))
        nl = levenshtein(ref, pred) / longest if longest else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


# ---------------------------------------------------------------------------------------------------------------
# Relaxed accuracy (ChartQA)
# ---------------------------------------------------------------------------------------------------------------


def _to_float(text: str) -> float | None:
    text = text.strip()
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, references: Sequence[str], tolerance: float = 0.05) -> float:
    """ChartQA relaxed accuracy of one answer (Masry et al. 2022, "ChartQA", section 5.1, after Methani et al.
    2020, PlotQA): a numeric answer is correct within `tolerance` (5%) relative error of the reference; other
    answers need an exact (case-insensitive) match.

    Follows `relaxed_correctness` of google-research/pix2struct `pix2struct/metrics.py`: "12%" reads as 0.12, and a
    reference of 0 (no relative error defined) needs an exact match. The maximum over references is returned.

    Raises ValueError when `references` is empty.
    """
    if not references:
        raise ValueError("relaxed_accuracy needs at least one reference")
    pred = prediction.strip()
    pred_f = _to_float(pred)
    for ref in references:
        ref = ref.strip()
        ref_f = _to_float(ref)
        if pred_f is not None and ref_f:
            if abs(pred_f - ref_f) / abs(ref_f) <= tolerance:
                return 1.0
        elif pred.lower() == ref.lower():
            return 1.0
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------------------------------------------

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LETTER_PREFIX = re.compile(r"^\s*\(?([A-Z])\s*[.:)]\s+")
_STATEMENT = re.compile(
    r"\b(?:answer|option|choice)\b(?:\s+(?:is|would\s+be|should\s+be))?\s*(?:option\s+)?[:\-]?\s*[(\[]?([A-Za-z])[)\]]?(?!\w)",
    flags=re.IGNORECASE,
)


def option_map(options: Sequence[str] | dict[str, str]) -> dict[str, str]:
    """Options as {letter: text}. A list is lettered A, B, C...; a leading "A. " / "(A) " that repeats the
    option's own letter is removed from its text. Raises ValueError for more than 26 options."""
    if isinstance(options, dict):
        return {str(k).strip().upper(): str(v) for k, v in options.items()}
    if len(options) > len(LETTERS):
        raise ValueError(f"{len(options)} options: at most {len(LETTERS)} can be lettered")
    out = {}
    for letter, text in zip(LETTERS, options):
        text = str(text)
        m = _LETTER_PREFIX.match(text + " ")
        if m and m.group(1) == letter:
            text = text[m.end():] if m.end() <= len(text) else ""
        out[letter] = text.strip()
    return out


def _norm_text(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def extract_option(text: str, options: Sequence[str] | dict[str, str]) -> str | None:
    """The option letter a free-form answer chooses, or None when it cannot be told.

    Tried in order (after MMBench's heuristic choice extraction, Liu et al. 2023, and VLMEvalKit's
    `can_infer_option` / `can_infer_text`):
    1. the whole answer is one letter, bracketed or not: "B", "(b)", "B.", "[B]";
    2. an explicit statement: "The answer is B", "Answer: (C)", "correct option is d";
    3. a leading letter with a delimiter: "B. a cat", "(B) a cat", "B) a cat", "B: a cat";
    4. the option text: the answer equals one option's text, or contains exactly one option's text (longer
       options win over options they contain: "dark blue" over "blue");
    5. exactly one option letter appears as a capital word ("I think C is right"), not counting the article "A"
       or pronoun "I" before a lowercase word.
    """
    choices = option_map(options)
    letters = set(choices)
    stripped = text.strip()
    m = re.fullmatch(r"[\s(\[{\"'*]*([A-Za-z])[\s)\]}\"'.:,*]*", stripped)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    for m in _STATEMENT.finditer(stripped):
        letter, rest = m.group(1), stripped[m.end():]
        # "the answer is a cat": an article, not option A.
        if letter in "aAI" and re.match(r"\s+[a-z]", rest):
            continue
        if letter.upper() in letters:
            return letter.upper()
    m = re.match(r"^[(\[]?([A-Z])(?:[.:)\]]|\s*$)", stripped)
    if m and m.group(1) in letters:
        return m.group(1)
    norm = _norm_text(stripped)
    texts = {k: _norm_text(v) for k, v in choices.items() if _norm_text(v)}
    equal = [k for k, t in texts.items() if t == norm]
    if len(equal) == 1:
        return equal[0]
    contained = [k for k, t in texts.items() if re.search(rf"(?<!\w){re.escape(t)}(?!\w)", norm)]
    contained = [k for k in contained if not any(k != o and texts[k] in texts[o] for o in contained)]
    if len(contained) == 1:
        return contained[0]
    words = re.findall(r"[A-Za-z]+", stripped)
    found = set()
    for i, w in enumerate(words):
        if len(w) == 1 and w in letters:
            if w in "AI" and i + 1 < len(words) and words[i + 1][:1].islower() and words[i + 1] not in ("or", "and"):
                continue
            found.add(w)
    if len(found) == 1:
        return found.pop()
    return None


def mcq_reference_letter(reference: str, options: Sequence[str] | dict[str, str]) -> str | None:
    """The letter a reference answer names ("B", "(B) cat", or the option text "cat"); None if it names none."""
    return extract_option(reference, options)


def mcq_accuracy(prediction: str, references: Sequence[str], options: Sequence[str] | dict[str, str]) -> float:
    """1.0 when the option extracted from `prediction` (see `extract_option`) is the one a reference names.

    Raises ValueError when no reference names one of the options.
    """
    gold = {mcq_reference_letter(r, options) for r in references} - {None}
    if not gold:
        raise ValueError(f"no reference among {list(references)!r} names one of the options {option_map(options)!r}")
    return float(extract_option(prediction, options) in gold)


# ---------------------------------------------------------------------------------------------------------------
# Captions
# ---------------------------------------------------------------------------------------------------------------

# Tokens the COCO caption evaluation removes after PTB tokenization (pycocoevalcap/tokenizer/ptbtokenizer.py).
_PTB_PUNCT = {"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"}


def caption_tokenize(text: str) -> str:
    """Lowercase and split into words as the COCO caption evaluation does, without its Java PTB tokenizer.

    Splits off punctuation and the clitics `'s 'nt 're 've 'll 'd 'm` (PTB style: "don't" -> "do n't"), drops the
    punctuation tokens the COCO evaluation removes, drops brackets, and joins with single spaces.
    """
    text = text.lower().replace("\n", " ")
    text = re.sub(r"n't\b", " n't", text)
    text = re.sub(r"'(s|re|ve|ll|d|m)\b", r" '\1", text)
    tokens = re.findall(r"n't|'\w+|\w+(?:[.,]\d+)*|\.\.\.|--|[^\w\s]", text)
    return " ".join(t for t in tokens if t not in _PTB_PUNCT and t not in "()[]{}")


TASK_PACKAGES = {"caption": (("sacrebleu", "sacrebleu", "caption metrics", "eval"),
                             ("pycocoevalcap", "pycocoevalcap", "caption metrics", "eval")),
                 "asr": (("jiwer", "jiwer", "speech-recognition metrics", "audio"),)}
"""The packages a task's metrics import: (module, pip package, what needs it, vlmctl extra)."""


def check_task_packages(task: str) -> None:
    """Raise UsageError when a package the metrics of `task` need is not installed (looked up with
    `importlib.util.find_spec`, nothing imported): checked before a model is loaded or a sample generated."""
    for module, package, what, extra in TASK_PACKAGES.get(task, ()):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"--task {task}: {what} need the `{package}` package, which is not installed",
                             hint=f"pip install {package}   (or: pip install 'vlmctl[{extra}]')")


def _require(module: str, package: str, *, what: str = "caption metrics", extra: str = "eval"):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise VlmctlError(
            f"{what} need the `{package}` package, which is not installed",
            hint=f"pip install {package}   (or: pip install 'vlmctl[{extra}]')",
        ) from exc


def bleu4(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002) through sacrebleu (Post 2018), as a fraction in [0, 1].

    Uniform weights over 1..4-gram clipped precisions, brevity penalty on the corpus; lowercased, sacrebleu's
    `13a` tokenization, no smoothing. Samples may have different numbers of references.
    Raises VlmctlError when sacrebleu is missing, ValueError when the lengths differ.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    sacrebleu = _require("sacrebleu", "sacrebleu")
    width = max((len(r) for r in references), default=0)
    streams = [[refs[i] if i < len(refs) else "" for refs in references] for i in range(width)]
    return sacrebleu.corpus_bleu(list(predictions), streams, lowercase=True, tokenize="13a").score / 100.0


def cider(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[float, list[float]]:
    """CIDEr (Vedantam et al. 2015) through pycocoevalcap's `CiderScorer` (n = 4, sigma = 6): the corpus score and
    one score per sample.

    Text is tokenized with `caption_tokenize` (no Java needed). CIDEr's IDF weights come from the corpus's own
    references, so it is meaningful over many images only (a single image scores 0).
    Raises VlmctlError when pycocoevalcap is missing, ValueError when the lengths differ.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        return 0.0, []
    scorer_mod = _require("pycocoevalcap.cider.cider_scorer", "pycocoevalcap")
    scorer = scorer_mod.CiderScorer(n=4, sigma=6.0)
    for pred, refs in zip(predictions, references):
        scorer += (caption_tokenize(pred), [caption_tokenize(r) for r in refs])
    score, scores = scorer.compute_score()
    return float(score), [float(s) for s in scores]


# ---------------------------------------------------------------------------------------------------------------
# Speech recognition: word and character error rates through jiwer (https://github.com/jitsi/jiwer)
# ---------------------------------------------------------------------------------------------------------------


def normalize_transcript(text: str) -> str:
    """A transcript as WER compares it: lowercased, punctuation removed (Unicode category P, apostrophes kept inside
    words: "don't" stays one word), whitespace collapsed. Whisper-style spelling normalizers (numbers, British
    spellings) are not applied."""
    text = re.sub(r"(?<!\w)'|'(?!\w)", " ", text.lower())
    text = "".join(" " if unicodedata.category(c).startswith("P") and c != "'" else c for c in text)
    return " ".join(text.split())


def error_rates(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[dict[str, float], list[float]]:
    """Corpus WER and CER (jiwer's `process_words` / `process_characters`: (substitutions + deletions + insertions) /
    reference words or characters, summed over the corpus) on `normalize_transcript`ed text, and each sample's
    WER. Of several references, a sample is scored against the one it has the fewest word errors with.

    Returns ({"wer", "cer", "word_accuracy"}, [WER per sample]). Raises VlmctlError when jiwer is missing,
    ValueError when the lengths differ or a sample's references are all empty after normalization.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        return {"wer": math.nan, "cer": math.nan, "word_accuracy": math.nan}, []
    jiwer = _require("jiwer", "jiwer", what="speech-recognition metrics", extra="audio")
    hyps, refs, per_sample = [], [], []
    for i, (pred, options) in enumerate(zip(predictions, references)):
        hyp = normalize_transcript(pred)
        candidates = [r for r in (normalize_transcript(o) for o in options) if r]
        if not candidates:
            raise ValueError(f"sample {i}: every reference transcript is empty")
        scored = [(jiwer.wer(r, hyp) if hyp else 1.0, r) for r in candidates]
        best, ref = min(scored, key=lambda x: x[0])
        per_sample.append(float(best))
        hyps.append(hyp)
        refs.append(ref)
    words = jiwer.process_words(refs, hyps)
    chars = jiwer.process_characters(refs, hyps)
    wer, cer = float(words.wer), float(chars.cer)
    return {"wer": wer, "cer": cer, "word_accuracy": max(0.0, 1.0 - wer)}, per_sample


# ---------------------------------------------------------------------------------------------------------------
# Records and corpus scoring
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ScoredRecord:
    """One evaluated sample: what was asked, what the model said, what was expected, and its score."""

    id: str
    prediction: str
    references: list[str]
    options: list[str] | dict[str, str] | None = None
    prompt: str = ""
    score: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id, "prompt": self.prompt, "prediction": self.prediction,
            "references": self.references, "score": self.score,
        }
        if self.options is not None:
            row["options"] = self.options
        return row


def infer_task(records: Iterable[ScoredRecord]) -> str:
    """The task for `--task auto`: the samples' common `meta["task"]` when they carry one, `mcq` when every sample
    has options, else `vqa`."""
    records = list(records)
    declared = {r.meta.get("task") for r in records}
    if len(declared) == 1 and (task := declared.pop()) in TASKS:
        return task
    if records and all(r.options for r in records):
        return "mcq"
    return "vqa"


PRIMARY = {"vqa": "vqa_accuracy", "docvqa": "anls", "chartqa": "relaxed_accuracy", "mcq": "mcq_accuracy", "caption": "cider",
           "asr": "wer"}


def score_records(task: str, records: list[ScoredRecord]) -> dict[str, float]:
    """Score `records` for `task` (one of TASKS): sets each record's `score` (the task's primary metric, see the
    module table) and returns the corpus metrics {name: value} (means over samples; BLEU-4/CIDEr corpus-level).

    Raises UsageError for an unknown task, or a record with no reference (or, for mcq, no options), naming its id.
    """
    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}", hint=f"choose one of: {', '.join(TASKS)}, loss, auto")
    for r in records:
        if not r.references:
            raise UsageError(f"sample {r.id!r} has no reference answer", hint="give each sample an assistant answer, `answer` or `answers`")
        if task == "mcq" and not r.options:
            raise UsageError(f"sample {r.id!r} has no options for --task mcq", hint="add `options` to the sample, or choose another --task")
    n = len(records)
    if task == "asr":
        for r in records:
            if not any(normalize_transcript(ref) for ref in r.references):
                raise UsageError(f"sample {r.id!r} has only empty reference transcripts (after removing punctuation)",
                                 hint="give each sample its transcript as the assistant answer, `answer` or `answers`")
        metrics, per_sample = error_rates([r.prediction for r in records], [r.references for r in records])
        for r, wer in zip(records, per_sample):
            r.score = max(0.0, 1.0 - wer)
        return metrics
    if task == "caption":
        preds = [r.prediction for r in records]
        refs = [r.references for r in records]
        corpus, per_sample = cider(preds, refs)
        for r, s in zip(records, per_sample):
            r.score = s
        return {"cider": corpus, "bleu4": bleu4(preds, refs)}
    metrics: dict[str, float] = {}
    if task == "mcq":
        unparsed = 0
        for r in records:
            try:
                r.score = mcq_accuracy(r.prediction, r.references, r.options)  # type: ignore[arg-type]
            except ValueError as exc:
                raise UsageError(f"sample {r.id!r}: {exc}", hint="the reference must be an option letter or an option's text") from exc
            unparsed += extract_option(r.prediction, r.options) is None  # type: ignore[arg-type]
        metrics["mcq_accuracy"] = _mean(r.score for r in records)
        metrics["mcq_unparsed"] = unparsed / n if n else math.nan
        return metrics
    fn = {"vqa": vqa_accuracy, "docvqa": anls, "chartqa": relaxed_accuracy}[task]
    for r in records:
        r.score = fn(r.prediction, r.references)
    metrics[PRIMARY[task]] = _mean(r.score for r in records)
    metrics["exact_match"] = _mean(exact_match(r.prediction, r.references) for r in records)
    return metrics


def _mean(values: Iterable[float | None]) -> float:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else math.nan
