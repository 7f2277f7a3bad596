"""Token counts without transformers, and before `model build`.

- a model folder is counted from its files (tokenizers + jinja2 + the family's rule): the same counts as the loaded
  processor for every family, and `data validate` imports neither torch nor transformers;
- `data prepare` of a fresh tiny project, before `model build`, records the counts that it records after the build
  (the tokenizer it trains is the one the build trains) and drops a too-long sample;
- a missing source is reported before any processor loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmctl.config.data import DataSection, DataSource
from vlmctl.config.model import ModelSection
from vlmctl.data.prepare import prepare_data
from vlmctl.data.sample import Sample
from vlmctl.data.chat_template import compile_chat_template
from vlmctl.data.tokens import TokenCounter
from vlmctl.errors import DataError
from vlmctl.families import FAMILIES
from cli_runner import run_cli as run
from real_data import REAL

TEXTS = ["What color is the square? Red.", "How many circles are there? 3", "Describe the image in detail."] * 20
SPECS = list({id(s): s for s in FAMILIES.values() if s.tiny_preset and "image" in s.modalities}.values())  # audio: test_audio_qwen2.py


def samples() -> list[tuple[Sample, list[tuple[int, int]]]]:
    """One image; a system turn, two images of other sizes and a second exchange; text only."""
    def msg(role, *parts):
        return {"role": role, "content": [{"type": "image", "index": p} if isinstance(p, int) else {"type": "text", "text": p} for p in parts]}

    return [
        (Sample(id="a", messages=[msg("user", 0, "What is this?"), msg("assistant", "A cat sitting on a mat.")]), [(640, 480)]),
        (Sample(id="b", messages=[msg("system", "You are helpful."), msg("user", "Compare", 0, 1), msg("assistant", "Left is bigger."),
                                  msg("user", "Why?"), msg("assistant", 'Because {"json": 1} <tags> & ünïcode')]), [(32, 32), (1200, 300)]),
        (Sample(id="c", messages=[msg("user", "No image here."), msg("assistant", "ok")]), []),
    ]


def saved_processor(spec, folder: Path):
    """The processor `model build` makes for the family's tiny preset, saved as a build saves it (no weights)."""
    from vlmctl.models.build import make_processor, plan_build

    processor = make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), tokenizer_texts=TEXTS)
    processor.save_pretrained(str(folder))
    (folder / "vlmctl_model.json").write_text(json.dumps({"family": spec.name}))
    return processor


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_counts_read_from_the_files_equal_the_loaded_processors(spec, tmp_path):
    processor = saved_processor(spec, tmp_path)
    light = TokenCounter.from_files(tmp_path)
    full = TokenCounter(processor, spec.name, tmp_path)
    from tokenizers import Tokenizer

    assert light is not None and isinstance(TokenCounter.load(tmp_path).tokenizer, Tokenizer)  # load reads the files
    for sample, sizes in samples():
        assert light.render(sample) == full.render(sample)
        assert light.count(sample, sizes) == full.count(sample, sizes)


def _png(width: int, height: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_counts_equal_the_collated_length(spec, tmp_path):
    """The counted tokens are the tokens the trainer's collator makes from the same sample: marker tokens and text a
    processor writes around the visual tokens (InternVL's <img>, Idefics' tile markers, Gemma 3's blank lines)
    included, for one image, two images of other sizes in one turn, and text only."""
    from vlmctl.data.collate import Collator

    processor = saved_processor(spec, tmp_path)
    collator = Collator(processor, spec, max_length=100_000, dummy_image=False)
    counter = TokenCounter.from_files(tmp_path)
    for sample, sizes in samples():
        with_images = Sample(id=sample.id, messages=sample.messages, images=[_png(w, h) for w, h in sizes])
        assert counter.count(sample, sizes) == collator([with_images])["input_ids"].shape[1], sample.id


def test_the_template_sandbox_renders_as_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% set ns = namespace(images=0) %}{{ bos_token }}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}{% set ns.images = ns.images + 1 %}"
        "Picture {{ ns.images }}: <|vision_start|><|image_pad|><|vision_end|>"
        "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{% endif %}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ '<|im_end|>' }}{% endgeneration %}{% else %}<|im_end|>{% endif %}\n"
        "    {% if message.meta is defined %}{{ message.meta | tojson }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% elif messages | length == 0 %}"
        "{{ raise_exception('empty') }}{% endif %}"
    )
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for sample, _ in samples():
        messages = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]}
                                                   for p in m["content"]]} for m in sample.messages]
        messages[0]["meta"] = {"note": "ünï <b>", "n": [1, 2]}
        ours = compile_chat_template(template).render(messages=messages, tools=None, documents=None, add_generation_prompt=False, **specials)
        assert ours == render_jinja_template([messages], chat_template=template, **specials)[0][0]


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory) -> Path:
    """The tiny preset's processor saved as a build saves it, next to weights that cannot be read."""
    folder = tmp_path_factory.mktemp("model")
    saved_processor(FAMILIES["llava"], folder)
    (folder / "model.safetensors").write_bytes(b"not weights: a command that only counts tokens never opens this file")
    return folder


def test_validate_with_a_built_model_imports_neither_torch_nor_transformers(llava_folder, tmp_path):
    (tmp_path / "vlmctl.yaml").write_text(f"model:\n  output_dir: {llava_folder}\n  preset: tiny\n  init: random\ndata:\n  max_length: 60\n")
    script = (
        "import sys\nfrom vlmctl.cli.app import main\n"
        f"try:\n    main(['data', 'validate', {str(REAL / 'llava_examples' / 'llava_format.json')!r}, '--json'])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    assert proc.stdout.strip().endswith("[]"), proc.stderr  # neither module was imported
    assert report["tokens_checked"] and report["counts"].get("too_long", 0) >= 1  # and the counts were made


def test_a_missing_source_fails_before_any_processor_loads(tmp_path):
    from vlmctl.models.build import configured_processor

    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{broken")
    (broken / "vlmctl_model.json").write_text(json.dumps({"family": "llava"}))
    data = DataSection(sources=[DataSource(path=str(tmp_path / "gone.json"), format="llava")], prepared_dir=tmp_path / "prepared")
    with pytest.raises(DataError, match="gone.json does not exist"):
        prepare_data(data, num_proc=1, processor_dir=broken, model=ModelSection(preset="tiny", init="random"), progress=False,
                     processors=configured_processor)


def _long_record(raw: Path) -> str:
    """Append a sample whose answer is hundreds of distinct words (far over max_length 512) to the generated set."""
    path = raw / "shapes_vqa.json"
    records = json.loads(path.read_text())
    words = " ".join(f"word{i} colour{i * 7 % 101}" for i in range(400))
    records.append({"id": "long-1", "image": records[0]["image"],
                    "conversations": [{"from": "human", "value": "<image>\nDescribe everything."}, {"from": "gpt", "value": words}]})
    path.write_text(json.dumps(records, indent=1))
    return "long-1"


def _prepared(capsys) -> tuple[dict, dict[str, int], list[dict]]:
    import pyarrow.parquet as pq

    code, out, err = run(["data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, err + out
    result = json.loads(out)
    counts = {}
    for split in ("train", "val"):
        for shard in sorted(Path(f"data/prepared/{split}").glob("*.parquet")):
            table = pq.read_table(shard, columns=["id", "num_tokens"])
            counts.update(zip(table.column("id").to_pylist(), table.column("num_tokens").to_pylist()))
    rejected = [json.loads(line) for line in Path("data/prepared/rejected.jsonl").read_text().splitlines()]
    return result, counts, rejected


def test_prepare_before_build_counts_as_after_and_drops_too_long(tmp_path, capsys, monkeypatch):
    from vlmctl.project import init_project

    init_project(tmp_path / "p", "tiny", num_samples=120)
    long_id = _long_record(tmp_path / "p" / "data" / "raw")
    monkeypatch.chdir(tmp_path / "p")

    before, counts_before, rejected_before = _prepared(capsys)
    tokens = before["tokens"]
    assert tokens is not None and tokens["count"] == len(counts_before) == 120 and None not in counts_before.values()
    assert tokens["family"] == "llava" and "trained" in tokens["processor"]
    # the long answer took part in the first tokenizer, was dropped, and the tokenizer was trained again without it
    assert tokens["tokenizer"] == {"rounds": 2, "converged": True}
    assert [(r["id"], r["reason"]) for r in rejected_before] == [(long_id, "too_long")]

    code, out, err = run(["model", "build"], capsys)
    assert code == 0, err + out
    after, counts_after, rejected_after = _prepared(capsys)
    assert counts_after == counts_before  # the build trained the same tokenizer on the shards
    assert after["tokens"]["processor"] == str(tmp_path / "p" / "outputs" / "model")
    assert {k: v for k, v in after["tokens"].items() if k not in ("processor", "tokenizer")} == \
        {k: v for k, v in tokens.items() if k not in ("processor", "tokenizer")}
    assert rejected_after == rejected_before


def test_prepare_without_a_model_says_why_there_are_no_counts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text(f"data:\n  sources:\n    - path: {REAL / 'llava_examples' / 'llava_format.json'}\n")
    code, out, err = run(["data", "prepare", "--num-proc", "1"], capsys)
    assert code == 0, err
    assert "No token counts (no model in the model section): too_long was not checked." in " ".join((out + err).split())


def test_prepared_shards_keep_each_media_items_tokens_and_training_reads_them(tmp_path):
    """Prepare with a built Qwen2.5-VL processor (tokens follow each image's size) stores every image's
    placeholder tokens (the `media_tokens` column, read back into `Sample.media_tokens`); the training-side counts
    (`ShardDataset.count_estimates`) take their sums instead of estimating, and shards without the column still
    give estimates."""
    import io

    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    from vlmctl.data.loader import ShardDataset

    spec = FAMILIES["qwen2_5_vl"]
    folder = tmp_path / "model"
    folder.mkdir()
    processor = saved_processor(spec, folder)
    data = DataSection(sources=[DataSource(path=str(REAL / "llava_examples" / "llava_format.json"))],
                       prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    prepare_data(data, num_proc=1, processor_dir=folder, progress=False)
    shards = sorted((tmp_path / "prepared" / "train").glob("*.parquet"))
    dataset = ShardDataset(shards)
    rows = pq.read_table(shards[0], columns=["images", "media_tokens", "num_tokens"]).to_pylist()
    with_images = [r for r in rows if r["images"]]
    assert with_images
    for row in rows:
        sizes = [Image.open(io.BytesIO(im["bytes"])).size for im in row["images"]]
        assert row["media_tokens"] == [spec.num_visual_tokens(w, h, processor) for w, h in sizes]
    assert all(n > 0 for r in with_images for n in r["media_tokens"])
    assert dataset[0].media_tokens["image"] == rows[0]["media_tokens"]
    estimates = dataset.count_estimates(dataset.lengths)
    assert estimates["visual_tokens"].tolist() == [sum(r["media_tokens"]) for r in rows]
    # the same shards without the column: estimated, not all equal to the recorded sums
    old = tmp_path / "old.parquet"
    pq.write_table(pq.read_table(shards[0]).drop(["media_tokens"]), old)
    guessed = ShardDataset([old]).count_estimates(dataset.lengths)["visual_tokens"]
    assert guessed.shape == estimates["visual_tokens"].shape and not np.array_equal(guessed, estimates["visual_tokens"])
