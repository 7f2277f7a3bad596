"""`vlmctl chat`: input parsing, the chat session (images, history, streaming), and the command with a scripted
stdin on the tiny template's model, trained for a few seconds on the demo's color questions (generated shapes
pictures), answering them on pictures it has not seen."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from cli_runner import run_cli as run
from vlmctl.errors import DataError, UsageError
from vlmctl.inference import ChatInput, ChatSession, generate, load_for_generation, parse_input, render_prompt

COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
QUESTION = "What color is the picture?"


def png(rgb, size=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


class Question(NamedTuple):
    image: Path
    text: str
    answer: str


@pytest.fixture(scope="module")
def demo_colors(tmp_path_factory) -> tuple[Path, list[Question]]:
    """The demo's generated shapes VQA set (`vlmctl init --template tiny`), 32 px pictures: its file, and the last
    8 color questions, held out from training."""
    from vlmctl.data.synthetic import generate_shapes_vqa

    raw = generate_shapes_vqa(tmp_path_factory.mktemp("shapes") / "raw", num_samples=160, seed=0, image_size=32)
    records = [r for r in json.loads(raw.read_text()) if r["id"].startswith("color-")]
    held_out = [Question(raw.parent / r["image"], r["conversations"][0]["value"].removeprefix("<image>\n"),
                         r["conversations"][1]["value"]) for r in records[-8:]]
    return raw, held_out


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory, demo_colors) -> Path:
    """The tiny template's model (tiny preset, first vision layer, linear projector, 32 px images) trained in this
    process on the demo's color questions until it answers the 8 held-out ones (about 40 steps of 8 samples)."""
    import random

    import torch

    from vlmctl.config import DataSource, ModelSection
    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.data.formats import read_source
    from vlmctl.data.sample import Sample
    from vlmctl.inference import GenerationRequest
    from vlmctl.models.build import build_model

    raw, held_out = demo_colors
    samples = [s for s in read_source(DataSource(path=str(raw))) if isinstance(s, Sample) and s.id.startswith("color-")]
    samples = samples[: -len(held_out)]
    folder = tmp_path_factory.mktemp("chat") / "model"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, vision_feature_layer=1, projector="linear",
                             image_size=32), tokenizer_texts=[t for s in samples for t in s.text_parts()])
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    requests = [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": q.text}]}],
                                  images=[q.image.read_bytes()]) for q in held_out]
    torch.manual_seed(0)
    rng = random.Random(0)
    collate = Collator(processor, dummy_image=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    answers: list[str] = []
    for step in range(1, 201):
        model.train()
        batch = collate(rng.sample(samples, 8))
        model(**model_inputs(batch), labels=batch["labels"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            model.eval()
            answers = [g.text for g in generate(model, processor, requests, max_new_tokens=3)]
            if answers == [q.answer for q in held_out]:
                break
    assert answers == [q.answer for q in held_out], f"not learned in {step} steps: {answers}"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(trained_model):
    return load_for_generation(trained_model, device="cpu", dtype="fp32")


@pytest.fixture
def pictures(tmp_path) -> Path:
    from PIL import Image

    for name, rgb in COLORS.items():
        Image.new("RGB", (40, 40), rgb).save(tmp_path / f"{name}.png")
    Image.new("RGB", (40, 40), COLORS["blue"]).save(tmp_path / "blue picture.png")
    (tmp_path / "notes.png").write_text("not an image")
    return tmp_path


def test_parse_input_commands_and_image_paths(pictures):
    assert parse_input("  ").kind == "empty"
    assert parse_input("/exit").kind == "exit" and parse_input("/QUIT").kind == "exit"
    assert parse_input("/reset").kind == "reset" and parse_input("/help").kind == "help"
    unknown = parse_input("/frobnicate now")
    assert (unknown.kind, unknown.command) == ("unknown", "/frobnicate")

    cmd = parse_input('/image "blue picture.png" What color?', cwd=pictures)
    assert cmd.kind == "image" and cmd.images == (pictures / "blue picture.png",) and cmd.text == "What color?"
    assert parse_input("/image red.png", cwd=pictures).text == ""
    # paths written in a message: relative, absolute (not a command), quoted, followed by punctuation
    cmd = parse_input(f"compare red.png and {pictures / 'green.png'}, 'blue picture.png'? which is red", cwd=pictures)
    assert cmd.kind == "message"
    assert cmd.images == (pictures / "red.png", pictures / "green.png", pictures / "blue picture.png")
    assert cmd.text == "compare and , ? which is red"
    cmd = parse_input(f"{pictures / 'red.png'} What color?", cwd=pictures)
    assert (cmd.kind, cmd.text, len(cmd.images)) == ("message", "What color?", 1)
    # a file name that is no file here is text; a missing path with a folder is an error
    assert parse_input("what is a logo.png file?", cwd=pictures) == ChatInput("message", "what is a logo.png file?")
    with pytest.raises(DataError, match="sub/missing.png: no such image file"):
        parse_input("look at sub/missing.png", cwd=pictures)
    with pytest.raises(DataError, match="no such image file"):
        parse_input("/image missing.png", cwd=pictures)
    with pytest.raises(UsageError, match="needs a path"):
        parse_input("/image")


def test_streamed_reply_equals_greedy_generation_and_the_image_is_in_the_prompt(loaded, trained_model, demo_colors):
    from vlmctl.data.collate import image_token_ids
    from vlmctl.models import read_build_info

    model, processor = loaded
    q = demo_colors[1][0]
    session = ChatSession(model, processor, max_new_tokens=8)
    request = session.request(q.text, [q.image])
    text, images = render_prompt(request, processor)
    ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    visual = sum(i in image_token_ids(processor) for i in ids)
    assert visual == read_build_info(trained_model)["visual_tokens_per_image"] > 0

    pieces = list(session.stream(q.text, [q.image]))
    assert pieces and "".join(pieces).strip() == generate(model, processor, [request], max_new_tokens=8)[0].text == q.answer
    # a text-only question streams the same text as the batched greedy path, whatever the model says
    plain = ChatSession(model, processor, max_new_tokens=12)
    request = plain.request("Which color is nice?")
    assert plain.ask("Which color is nice?") == generate(model, processor, [request], max_new_tokens=12)[0].text


def test_history_grows_across_turns_and_reset_clears_it(loaded, demo_colors, pictures):
    model, processor = loaded
    q1, q2, q3 = demo_colors[1][:3]
    session = ChatSession(model, processor, system="Answer with one word.", max_new_tokens=4)
    session.attach(q1.image)
    assert len(session.pending) == 1 and session.turns == 0
    assert session.ask(q1.text) == q1.answer
    assert session.turns == 1 and session.pending == [] and len(session.images) == 1
    assert [m["role"] for m in session.history] == ["user", "assistant"]

    second = session.request("And now?", [q2.image])
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.messages[-1]["content"][0] == {"type": "image", "index": 1} and len(second.images) == 2
    prompt, images = render_prompt(second, processor)
    assert prompt.index("Answer with one word.") < prompt.index(q1.text) < prompt.index(q1.answer) < prompt.index("And now?")
    assert len(images) == 2
    session.ask("And now?", [q2.image])
    assert session.turns == 2 and len(session.history) == 4 and len(session.images) == 2

    # an unreadable image queues nothing; an interrupted reply is not kept
    with pytest.raises(DataError, match="notes.png"):
        session.attach(pictures / "notes.png")
    session.attach(q3.image)
    stream = session.stream(q3.text)
    assert next(stream).strip()  # a history of several pictures is beyond what this model learned: any first piece
    stream.close()
    assert session.turns == 2 and len(session.pending) == 1 and len(session.images) == 2

    session.reset()
    assert (session.history, session.images, session.pending, session.turns) == ([], [], [], 0)
    assert [m["role"] for m in session.request("Hi").messages] == ["system", "user"]
    assert session.ask(q3.text, [q3.image]) == q3.answer  # a fresh conversation after /reset
    with pytest.raises(UsageError, match="nothing to send"):
        next(ChatSession(model, processor).stream(""))
    with pytest.raises(UsageError, match="temperature"):
        ChatSession(model, processor, temperature=-1)


def test_cli_chat_answers_the_demo_questions_from_a_scripted_stdin(trained_model, demo_colors, pictures, tmp_path, capsys,
                                                                   monkeypatch):
    import os
    import shutil

    # Inside a project, MODEL defaults to the newest train.output_dir/*/final, as in `vlmctl eval`.
    project = tmp_path / "project"
    final = project / "outputs" / "runs" / "run1" / "final"
    shutil.copytree(trained_model, final)
    os.utime(final)
    (project / "vlmctl.yaml").write_text("project:\n  name: chat\n")
    q1, q2, q3 = demo_colors[1][3:6]
    shutil.copy(q1.image, project / "first.png")
    shutil.copy(q2.image, project / "second.png")
    shutil.copy(q3.image, project / "third picture.png")
    shutil.copy(pictures / "notes.png", project / "notes.png")
    monkeypatch.chdir(project)
    script = "\n".join([
        "/image first.png",
        q1.text,
        "/reset",
        f"second.png {q2.text}",
        "/reset",
        f'/image "third picture.png" {q3.text}',
        "/image notes.png",
        "/nope",
        "/help",
        "/exit",
        "never read",
    ]) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    code, out, err = run(["chat", "--max-new-tokens", "4", "--device", "cpu"], capsys)
    assert code == 0, err
    replies = [line.split("›", 1)[1].strip() for line in out.splitlines() if line.startswith("model ›")]
    assert replies == [q1.answer, q2.answer, q3.answer]
    assert str(final.resolve()) in out.replace("\n", "")
    assert "attached first.png" in out and "history cleared" in out and "unknown command /nope" in out
    assert "/image PATH [question]" in out and "never read" not in out
    assert "notes.png" in err and "Data error" in err  # a bad turn shows its error and the chat goes on

    # end of input ends the chat as /exit does; --system and sampling flags are accepted
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"first.png {q1.text}\n"))
    code, out, err = run(["chat", str(final), "--system", "Be brief.", "--temperature", "0.7", "--top-p", "0.9",
                          "--max-new-tokens", "2", "-c", str(project / "vlmctl.yaml")], capsys)
    assert code == 0, err
    assert sum(line.startswith("model ›") for line in out.splitlines()) == 1


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-idefics3"])
def test_every_family_keeps_its_images_across_turns(preset, tmp_path):
    """Random tiny models of the other families: a second turn's prompt carries the visual tokens of both turns'
    images, and the streamed reply is the batched greedy answer."""
    from vlmctl.config import ModelSection
    from vlmctl.data.collate import image_token_ids
    from vlmctl.models.build import build_model

    folder = tmp_path / preset
    build_model(ModelSection(preset=preset, init="random", output_dir=folder), tokenizer_texts=[QUESTION, *COLORS])
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")

    def visual_tokens(request) -> int:
        text, images = render_prompt(request, processor)
        ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        return sum(i in image_token_ids(processor) for i in ids)

    session = ChatSession(model, processor, max_new_tokens=4)
    one = visual_tokens(session.request(QUESTION, [png(COLORS["red"], 64)]))
    session.ask(QUESTION, [png(COLORS["red"], 64)])
    request = session.request("And this one?", [png(COLORS["blue"], 64)])
    assert one > 0 and visual_tokens(request) == 2 * one
    assert session.ask("And this one?", [png(COLORS["blue"], 64)]) == generate(model, processor, [request], max_new_tokens=4)[0].text
    assert session.turns == 2 and len(session.images) == 2


def test_cli_chat_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no project file here
    code, _, err = run(["chat"], capsys)
    assert code == 2 and "no MODEL given" in err and "vlmctl chat PATH" in err
    code, _, err = run(["chat", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no model folder" in err  # a wrong path: a usage error, as in eval, convert, push
    code, _, err = run(["chat", str(tmp_path), "--device", "cuda:7"], capsys)
    assert code == 1 and "config.json" in err  # the folder is checked first


def test_chat_and_generate_are_listed_with_examples_and_help_stays_light(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and " chat " in out and " generate " in out
    for cmd in ("chat", "generate"):
        code, out, _ = run([cmd, "--help"], capsys)
        assert code == 0 and f"Example: vlmctl {cmd}" in out
    code = (
        "import sys\nfrom vlmctl.cli.app import main\n"
        "for cmd in ('chat', 'generate'):\n"
        "    try:\n        main([cmd, '--help'])\n    except SystemExit:\n        pass\n"
        "print('HEAVY', [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_replies_cannot_drive_the_terminal():
    from vlmctl.cli.chat import _printable

    assert _printable("red\x1b[2J\x1b]0;title\x07 car\x9b\n\tok") == "red[2J]0;title car\n\tok"


def test_resolve_device_rejects_unknown_names():
    from vlmctl.inference import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")
    with pytest.raises(UsageError, match="unknown device"):
        resolve_device("gpu0")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="not available"):
            resolve_device("cuda")
