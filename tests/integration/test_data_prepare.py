"""`data prepare` / `data validate` end to end: real data merged, determinism, atomic output, energon, tokens, CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.prepare import prepare_data
from vlmctl.data.sample import Sample, arrow_schema
from vlmctl.data.validate import validate_data
from vlmctl.errors import DataError
from cli_runner import run_cli as run
from real_data import REAL, tree_digest, write_real_project





def real_project(tmp_path: Path, extra: str = "") -> Path:
    """A project whose data.sources are the three real formats."""
    root = tmp_path / "proj"
    write_real_project(root, extra)
    return root


def test_real_formats_merged_prepare_and_load_with_datasets(tmp_path, capsys):
    import datasets
    import pyarrow.parquet as pq

    proj = real_project(tmp_path, "  dedup: false\n")
    before = tree_digest(REAL)
    code, out, err = run(["-c", str(proj / "vlmctl.yaml"), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    prepared = proj / "data" / "prepared"
    assert {s["format"]: s["kept"] for s in result["sources"]} == {"llava": 3, "sharegpt": 6, "messages": 24}
    assert result["splits"]["train"]["samples"] + result["splits"]["val"]["samples"] == 33
    # llava: 2 images; ShareGPT: 6 records, two of them with the same picture twice (8); messages: 4 x the same (32)
    assert result["tokens"] is None and result["images"]["count"] == 2 + 8 + 32
    for f in (prepared / "train").glob("*.parquet"):
        assert pq.read_schema(f).equals(arrow_schema(), check_metadata=True)
    dd = datasets.load_dataset("parquet", data_dir=str(prepared))
    assert dd["train"].num_rows + dd["validation"].num_rows == 33
    split = "train" if "extreme_ironing" in dd["train"]["id"] else "validation"
    row = dd[split][dd[split]["id"].index("extreme_ironing")]  # indexing decodes features (to_list would not)
    assert row["images"][0].size == (570, 380) and row["messages"][0]["content"][1]["text"] == "What is unusual about this image?"
    assert (prepared / "length_histogram.png").read_bytes()[:4] == b"\x89PNG"
    assert tree_digest(REAL) == before  # inputs never modified
    assert not list(prepared.parent.glob(".prepared.tmp-*"))

    # with dedup (the default) the messages file repeats the ShareGPT demo exactly: format-independent duplicates
    code, out, _ = run(["-c", str(proj / "vlmctl.yaml"), "data", "prepare", "--num-proc", "1", "--json", "data.dedup=true"], capsys)
    result = json.loads(out)
    assert result["totals"]["kept"] == 9 and result["totals"]["rejected"] == {"duplicate": 24}
    # the prepared folder validates clean and reads back through the parquet reader
    code, out, _ = run(["data", "validate", str(prepared), "--json"], capsys)
    assert code == 0 and json.loads(out)["kept"] == 9


def test_same_inputs_give_byte_identical_shards_across_num_proc(tmp_path):
    sources = [
        DataSource(path=str(REAL / "llava_examples" / "llava_format.json")),
        DataSource(path=str(REAL / "llamafactory_mllm_demo" / "mllm_demo.json")),
    ]
    digests = []
    for i, procs in enumerate((1, 2)):
        data = DataSection(sources=sources, prepared_dir=tmp_path / f"out{i}", val_ratio=0.3)
        prepare_data(data, num_proc=procs, progress=False)
        digests.append({k: v for k, v in tree_digest(tmp_path / f"out{i}").items() if not k.endswith(".png")})
    assert digests[0] == digests[1] and any(k.startswith("val/") for k in digests[0])


def test_failed_prepare_keeps_previous_output(tmp_path):
    good = DataSource(path=str(REAL / "llava_examples" / "llava_format.json"))
    data = DataSection(sources=[good], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    prepare_data(data, num_proc=1, progress=False)
    before = tree_digest(tmp_path / "prepared")
    bad = DataSection(sources=[good, DataSource(path=str(tmp_path / "nope.json"), format="llava")], prepared_dir=tmp_path / "prepared")
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(bad, num_proc=1, progress=False)
    assert tree_digest(tmp_path / "prepared") == before
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]  # no temporary folder left behind


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_energon_export_loads_back_with_energon(tmp_path):
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    from vlmctl.data.energon import ConversationSample, cook_conversation

    data = DataSection(sources=[DataSource(path=str(REAL / "llava_examples" / "llava_format.json"))], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    result = prepare_data(data, num_proc=1, progress=False, export="energon", export_dir=tmp_path / "energon")
    assert result.manifest["export"]["samples"] == {"train": 3, "val": 0}
    assert (tmp_path / "energon" / ".nv-meta" / "dataset.yaml").is_file()

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

        def batch(self, samples):
            return samples

    ds = get_train_dataset(
        tmp_path / "energon", split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False,
    )
    got = {}
    for sample in get_loader(ds):
        assert isinstance(sample, ConversationSample)
        got[sample.id] = sample
        if len(got) == 3:
            break
    assert set(got) == {"extreme_ironing", "waterview", "text_only_turn"}
    w, h = Image.open(REAL / "llava_examples" / "waterview.jpg").size
    assert tuple(got["waterview"].images[0].shape) == (3, h, w) and got["text_only_turn"].images == []
    assert got["waterview"].messages[0]["content"][1] == {"type": "image", "index": 0}
    # the export also reads back through vlmctl's webdataset reader
    back = validate_data(DataSection(), paths=[tmp_path / "energon"], num_proc=1, progress=False)
    assert back.ok and back.kept == 3


def tiny_processor(folder: Path) -> None:
    """A LLaVA processor without downloads: local BPE tokenizer with a chat template + 32 px SigLIP processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast, SiglipImageProcessor

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<image>"]
    tok.train_from_iterator(["What is unusual about this image? A man ironing on a taxi."] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer, patch_size=8,
        vision_feature_select_strategy="full", chat_template=template, num_additional_image_tokens=0,
    )
    processor.save_pretrained(str(folder))
    (folder / "vlmctl_model.json").write_text(json.dumps({"family": "llava"}))


def test_token_counts_match_the_processor_and_too_long(tmp_path):
    import pyarrow.parquet as pq
    from transformers import AutoProcessor

    tiny_processor(tmp_path / "model")
    src = DataSource(path=str(REAL / "llava_examples" / "llava_format.json"))
    data = DataSection(sources=[src], prepared_dir=tmp_path / "prepared", val_ratio=0.0, max_length=100_000)
    result = prepare_data(data, num_proc=1, processor_dir=tmp_path / "model", progress=False)
    processor = AutoProcessor.from_pretrained(str(tmp_path / "model"))
    rows = [Sample.from_row(r) for r in pq.read_table(tmp_path / "prepared" / "train" / "train-00000.parquet").to_pylist()]
    counts = {}
    for s in rows:
        conv = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in m["content"]]} for m in s.messages]
        text = processor.apply_chat_template(conv, tokenize=False)
        images = [Image.open(io.BytesIO(b)) for b in s.images] or None
        counts[s.id] = len(processor(text=text, images=images)["input_ids"][0])  # the processor expands <image>
        assert s.num_tokens == counts[s.id]
    assert len(counts) == 3 and len(set(counts.values())) == 3
    tokens = result.manifest["tokens"]
    assert tokens["count"] == 3 and tokens["max"] == max(counts.values()) and tokens["p50"] == sorted(counts.values())[1]
    assert tokens["suggested_max_length"] % 64 == 0 and tokens["suggested_max_length"] >= tokens["max"]

    # max_length at the median count: exactly the longest sample is dropped as too_long
    data.max_length = sorted(counts.values())[1]
    prepare_data(data, num_proc=1, processor_dir=tmp_path / "model", progress=False)
    rejected = [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]
    longest = max(counts, key=counts.get)
    assert [(r["id"], r["reason"]) for r in rejected] == [(longest, "too_long")]
    assert f"{counts[longest]} tokens" in rejected[0]["detail"]


def test_validate_cli_table_json_and_exit_codes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"conversations": [{"from": "human", "value": "<image> x"}, {"from": "gpt", "value": "y"}], "image": "gone.jpg"}) + "\n"
        "{oops\n"
    )
    code, out, _ = run(["data", "validate", "bad.jsonl"], capsys)
    assert code == 1
    assert "missing_image" in out and "parse_error" in out and "bad.jsonl:2" in out
    code, out, _ = run(["data", "validate", "bad.jsonl", "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and report["counts"] == {"parse_error": 1, "missing_image": 1}
    assert report["examples"]["missing_image"][0]["location"] == "bad.jsonl:1"
    code, out, _ = run(["data", "validate", str(REAL / "llava_examples" / "llava_format.json"), "data.min_image_side=400"], capsys)
    assert code == 1 and "image_too_small" in out  # overrides apply without a project file
    code, out, _ = run(["data", "validate", str(REAL / "llava_examples" / "llava_format.json")], capsys)
    assert code == 0 and "OK" in out
    assert not list(tmp_path.glob("data"))  # validate writes nothing


def test_row_budget_rejects_a_sample_over_one_gpu_or_splits_it_over_sequence_parallel(tmp_path, capsys, monkeypatch):
    """A sample over train.tokens_per_batch but within data.max_length: too_long with sequence_parallel 1 (the detail
    names the fix), kept on 2 GPUs with sequence_parallel 2; auto (or no packing) keeps today's limit. The CLI builds
    the row budget from the train section, for prepare and validate."""
    tiny_processor(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text(
        f"data:\n  sources:\n    - path: {REAL / 'llava_examples' / 'llava_format.json'}\n  val_ratio: 0.0\n  max_length: 100000\n"
        "model:\n  output_dir: model\n"
    )

    def prepare(*overrides: str) -> tuple[dict, list[dict]]:
        code, out, err = run(["data", "prepare", "--num-proc", "1", "--json", *overrides], capsys)
        assert code == 0, err + out
        rejected = [json.loads(line) for line in Path("data/prepared/rejected.jsonl").read_text().splitlines()]
        return json.loads(out), rejected

    auto, rejected = prepare()
    tokens = auto["tokens"]
    assert auto["totals"]["kept"] == 3 and rejected == []
    assert (tokens["row_budget_tokens"], tokens["tokens_per_batch"], tokens["sequence_parallel"]) == (None, None, None)
    assert (tokens["gpus_needed"], tokens["gpus_needed_at"]) == (1, 8192)
    longest = tokens["max"]
    per_gpu = max(tokens["p50"], -(-longest // 2))  # the two shorter samples fit one GPU, the longest needs two
    assert per_gpu < longest

    one, rejected = prepare(f"train.tokens_per_batch={per_gpu}")
    assert one["totals"]["rejected"] == {"too_long": 1} and [r["reason"] for r in rejected] == ["too_long"]
    assert rejected[0]["detail"] == (
        f"{longest:,} tokens (text + visual) > {per_gpu:,} tokens per packed row (train.tokens_per_batch={per_gpu} x "
        "train.sequence_parallel=1); it needs 2 GPUs: set train.sequence_parallel=2 (or raise train.tokens_per_batch)")
    assert one["tokens"]["row_budget_tokens"] == per_gpu and one["tokens"]["gpus_needed"] == 1

    two, rejected = prepare(f"train.tokens_per_batch={per_gpu}", "train.sequence_parallel=2")
    assert two["totals"]["kept"] == 3 and rejected == []
    keys = ("row_budget_tokens", "tokens_per_batch", "sequence_parallel", "gpus_needed", "gpus_needed_at")
    assert [two["tokens"][k] for k in keys] == [2 * per_gpu, per_gpu, 2, 2, per_gpu]

    padded, rejected = prepare(f"train.tokens_per_batch={per_gpu}", "train.packing=false")  # no packed row to fit
    assert padded["totals"]["kept"] == 3 and padded["tokens"]["row_budget_tokens"] is None

    code, out, err = run(["data", "prepare", "--num-proc", "1", f"train.tokens_per_batch={per_gpu}", "train.sequence_parallel=2"], capsys)
    assert code == 0, err
    assert (f"Longest sample: {longest:,} tokens, 2 GPUs at train.tokens_per_batch={per_gpu} (train.sequence_parallel=2 holds it)"
            in " ".join((out + err).split()))

    code, out, _ = run(["data", "validate", "--json", f"train.tokens_per_batch={per_gpu}"], capsys)
    report = json.loads(out)
    assert code == 1 and report["counts"] == {"too_long": 1}
    assert "set train.sequence_parallel=2" in report["examples"]["too_long"][0]["detail"]
    code, out, _ = run(["data", "validate", "--json", f"train.tokens_per_batch={per_gpu}", "train.sequence_parallel=2"], capsys)
    assert code == 0 and json.loads(out)["kept"] == 3


def test_row_budget_applies_to_the_tokenizer_trained_at_prepare_time(tmp_path):
    """Before the build of a random-init preset, the tokenizer's rounds drop samples over the row budget too."""
    from vlmctl.config.model import ModelSection
    from vlmctl.data.pipeline import RowBudget
    from vlmctl.models.build import configured_processor

    src = DataSource(path=str(REAL / "llava_examples" / "llava_format.json"))
    model = ModelSection(preset="tiny", init="random")

    def prepare(budget: RowBudget | None) -> tuple[dict, list[dict]]:
        data = DataSection(sources=[src], prepared_dir=tmp_path / "prepared", val_ratio=0.0, max_length=100_000)
        tokens = prepare_data(data, num_proc=1, model=model, processors=configured_processor, row_budget=budget,
                              progress=False).manifest["tokens"]
        return tokens, [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]

    tokens, rejected = prepare(None)
    assert tokens["tokenizer"]["rounds"] == 1 and rejected == [] and tokens["count"] == 3
    # between the two longest: a tokenizer trained on fewer texts counts the others a little longer
    longest, per_gpu = tokens["max"], (tokens["p50"] + tokens["max"]) // 2
    assert tokens["p50"] < per_gpu < longest <= 2 * per_gpu
    # over the row: dropped, and the tokenizer trained again without it (the build trains on what the shards hold)
    tokens, rejected = prepare(RowBudget(per_gpu))
    assert [r["reason"] for r in rejected] == ["too_long"] and "set train.sequence_parallel=2" in rejected[0]["detail"]
    assert tokens["count"] == 2 and tokens["tokenizer"] == {"rounds": 2, "converged": True} and tokens["max"] <= per_gpu
    tokens, rejected = prepare(RowBudget(per_gpu, 2))
    assert rejected == [] and tokens["max"] == longest and tokens["gpus_needed"] == 2 and tokens["tokenizer"]["rounds"] == 1
