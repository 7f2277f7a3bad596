"""`vlmctl push`: model card content, --dry-run output, and uploads to a local HTTP stand-in for the Hub.

The stand-in implements the endpoints huggingface_hub's upload path calls (whoami-v2, repos/create, validate-yaml,
preupload, the LFS batch API + PUT, commit NDJSON, branch) and keeps the received bytes, so the tests can compare
them with the files on disk.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from vlmctl.config import HubSection
from cli_runner import run_cli as run_cli

TOKEN = "hf_testtoken_write_0123456789"
READ_TOKEN = "hf_testtoken_read_0123456789"
SCOPED_TOKEN = "hf_testtoken_scoped_0123456789"  # a fine-grained token the server refuses to commit with


class FakeHub:
    """In-memory Hub: users, repos ({branch: {path: bytes}}), LFS objects, request log."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict] = []
        self.tokens = {TOKEN: "write", READ_TOKEN: "read", SCOPED_TOKEN: "fineGrained"}
        self.user, self.orgs = "alice", ["alice-lab"]


def _handler(hub: FakeHub, endpoint: list[str]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, payload=None):
            data = json.dumps(payload if payload is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                self.send_header("X-Error-Message", (payload or {}).get("error", ""))
            self.end_headers()
            self.wfile.write(data)

        def _role(self):
            auth = self.headers.get("Authorization", "")
            return hub.tokens.get(auth.removeprefix("Bearer ").strip())

        def _repo(self, parts):
            return f"{parts[0]}/{parts[1]}"

        def do_GET(self):
            hub.requests.append(("GET", self.path))
            if self.path.startswith("/api/whoami-v2"):
                role = self._role()
                if role is None:
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                orgs = [{"name": o, "type": "org"} for o in hub.orgs]
                return self._send(200, {"type": "user", "name": hub.user, "orgs": orgs, "auth": {"type": "access_token", "accessToken": {"role": role}}})
            self._send(404, {"error": "not found"})

        def do_PUT(self):
            hub.requests.append(("PUT", self.path))
            body = self._body()
            if self.path.startswith("/_lfs/"):
                oid = self.path.split("/")[-1]
                if hashlib.sha256(body).hexdigest() != oid:
                    return self._send(400, {"error": "sha256 mismatch"})
                hub.lfs[oid] = body
                return self._send(200, {})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            hub.requests.append(("POST", self.path))
            body = self._body()
            path = self.path.split("?")[0]
            role = self._role()
            if path == "/api/validate-yaml":
                content = json.loads(body)["content"]
                meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
                errors = [] if isinstance(meta, dict) else [{"message": "metadata is not a mapping"}]
                return self._send(200 if not errors else 400, {"errors": errors, "warnings": []})
            if role is None:
                return self._send(401, {"error": "Invalid credentials"})
            if path == "/api/repos/create":
                req = json.loads(body)
                ns = req.get("organization") or hub.user
                repo_id = f"{ns}/{req['name']}"
                if ns not in (hub.user, *hub.orgs):
                    return self._send(403, {"error": "You don't have the rights to create a model under this namespace"})
                if repo_id in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": f"{endpoint[0]}/{repo_id}"})
                hub.repos[repo_id] = {"visibility": req.get("visibility"), "branches": {"main": {}}}
                return self._send(200, {"url": f"{endpoint[0]}/{repo_id}", "name": repo_id})
            parts = path.strip("/").split("/")
            if parts[0] == "api" and parts[1] == "models":
                repo_id, action, rev = self._repo(parts[2:]), parts[4], "/".join(parts[5:])
                if repo_id not in hub.repos:
                    return self._send(404, {"error": "Repository not found"})
                repo = hub.repos[repo_id]
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") or f["size"] > 20_000 else "regular", "shouldIgnore": False, "oid": None} for f in files]
                    return self._send(200, {"files": modes, "commitOid": "0" * 40})
                if action == "branch":
                    if rev in repo["branches"]:
                        return self._send(409, {"error": "branch exists"})
                    repo["branches"][rev] = dict(repo["branches"]["main"])
                    return self._send(200, {})
                if action == "commit":
                    if role == "fineGrained":
                        return self._send(403, {"error": "This token has no write access to this repository"})
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    branch = repo["branches"].setdefault(rev, {})
                    for item in lines[1:]:
                        value = item["value"]
                        if item["key"] == "file":
                            branch[value["path"]] = base64.b64decode(value["content"])
                        elif item["key"] == "lfsFile":
                            if value["oid"] not in hub.lfs:
                                return self._send(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                            branch[value["path"]] = hub.lfs[value["oid"]]
                    hub.commits.append({"repo": repo_id, "revision": rev, "header": lines[0]["value"], "ops": [i["key"] for i in lines[1:]]})
                    oid = hashlib.sha1(body).hexdigest()
                    return self._send(200, {"commitUrl": f"{endpoint[0]}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})
            if path.endswith(".git/info/lfs/objects/batch"):
                req = json.loads(body)
                objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True, "actions": {"upload": {"href": f"{endpoint[0]}/_lfs/{o['oid']}"}}} for o in req["objects"]]
                return self._send(200, {"transfer": "basic", "objects": objects})
            self._send(404, {"error": f"no route {path}"})

    return Handler


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A running stand-in Hub on 127.0.0.1 with HF_ENDPOINT pointed at it and online mode on."""
    from huggingface_hub import constants

    hub = FakeHub()
    endpoint: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, endpoint))
    endpoint.append(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", endpoint[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks the LFS protocol, not Xet
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.endpoint = endpoint[0]
    yield hub
    server.shutdown()
    server.server_close()


@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A run folder as the trainer writes it, with a final export (a small HF-like folder) and an eval result."""
    from safetensors.numpy import save_file
    import numpy as np

    run = tmp_path / "proj" / "outputs" / "runs" / "tiny-finetune"
    final = run / "final"
    final.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((64, 200)).astype(np.float32), "b": np.arange(7, dtype=np.float32)}, str(final / "model.safetensors"))
    (final / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "vision_config": {"model_type": "siglip_vision_model"}, "text_config": {"model_type": "qwen2"}}))
    (final / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {chr(97 + i): i for i in range(26)}}}))
    (final / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (final / "sub").mkdir()
    (final / "sub" / "notes.txt").write_bytes(bytes(range(256)) * 3)
    cfg = {
        "project": {"name": "shapes"},
        "model": {"vision": "google/siglip-base-patch16-224", "llm": "Qwen/Qwen2.5-0.5B", "output_dir": str(tmp_path / "model")},
        "train": {"stage": "finetune", "strategy": "fsdp", "learning_rate": 1e-4},
        "data": {"sources": [{"path": "lmms-lab/shapes-vqa", "format": "hf"}, {"path": "local.json", "format": "llava"}]},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    ckpt = run / "checkpoints" / "checkpoint-40"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 40, "epoch": 1.0, "lora": None, "world_size": 2, "strategy": "fsdp", "family": "llava"}))
    rows = [{"step": s, "loss": 3.0 - s * 0.05, "lr": 1e-4, "tokens": 512 * s} for s in range(10, 41, 10)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    eval_dir = tmp_path / "proj" / "outputs" / "eval" / "tiny-finetune"
    eval_dir.mkdir(parents=True)
    (eval_dir / "metrics.json").write_text(json.dumps({"task": "vqa", "model": str(final), "data": "data/prepared/val", "n": 120, "metrics": {"accuracy": 0.4125, "exact_match": 0.375}}))
    other = tmp_path / "proj" / "outputs" / "eval" / "other-model"
    other.mkdir(parents=True)
    (other / "metrics.json").write_text(json.dumps({"task": "vqa", "model": str(tmp_path / "elsewhere"), "data": "val", "n": 5, "metrics": {"accuracy": 0.999}}))
    (tmp_path / "proj" / "vlmctl.yaml").write_text(yaml.safe_dump({"project": {"name": "shapes"}, "hub": {"repo_id": "alice/shapes-vlm", "tags": ["shapes"], "datasets": ["alice/shapes-extra"]}}))
    return run




def _check_hub_metadata(card_text: str) -> dict:
    """Parse a card with huggingface_hub and run its offline metadata checks; returns the metadata dict."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    parsed = ModelCard(card_text)  # raises on YAML that is not a mapping
    data = parsed.data.to_dict()
    again = ModelCardData(**data)  # round trip: model-index back into EvalResults, and out again
    assert again.to_dict() == data
    if "model-index" in data:
        name, results = model_index_to_eval_results(data["model-index"])
        assert name and results and all(r.dataset_type and r.metric_type for r in results)
    for key in ("base_model", "datasets"):
        for ref in ([data[key]] if isinstance(data.get(key), str) else data.get(key) or []):
            assert not Path(ref).is_absolute() and "/" in ref and not Path(ref).exists(), (key, ref)  # Hub ids only
    return data


def test_model_card_metadata_and_body(run_folder):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from vlmctl.hub import build_model_card

    final = run_folder / "final"
    hub = HubSection(license="mit", tags=["shapes"], datasets=["alice/shapes-extra"])
    card = build_model_card(final, hub=hub, repo_id="alice/shapes-vlm", eval_dir=run_folder.parents[1] / "eval")
    data = _check_hub_metadata(card.content)
    # composed from two Hub models (config.yaml model.vision + model.llm): both, the language model first
    assert data["base_model"] == ["Qwen/Qwen2.5-0.5B", "google/siglip-base-patch16-224"]
    assert data["base_model_relation"] == "finetune"
    assert data["datasets"] == ["alice/shapes-extra", "lmms-lab/shapes-vqa"]
    assert data["license"] == "mit" and data["pipeline_tag"] == "image-text-to-text" and data["library_name"] == "transformers"
    assert "shapes" in data["tags"] and "vlmctl" in data["tags"]
    _, results = model_index_to_eval_results(data["model-index"])
    # the eval ran on the prepared val split: the dataset is the project's Hub dataset, the split is separate
    assert {(r.dataset_type, r.dataset_split, r.task_type) for r in results} == {("alice/shapes-extra", "val", "visual-question-answering")}
    assert {r.metric_type: r.metric_value for r in results} == {"accuracy": 0.4125, "exact_match": 0.375}
    body = ModelCard(card.content).text
    assert "Composed by `vlmctl model build` from the vision encoder" in body and "Qwen/Qwen2.5-0.5B" in body
    assert "| stage | finetune |" in body and "| strategy | fsdp |" in body
    assert "| objective | sft (next-token cross-entropy on the assistant turns) |" in body  # a run without the key
    assert "| optimizer steps | 40 |" in body
    assert "| tokens seen | 20,480 |" in body  # last cumulative `tokens` of metrics.jsonl
    assert "| final training loss | 1.0000 |" in body
    assert "| hardware | 2 processes |" in body
    assert "| vqa | val | 120 | accuracy | 0.4125 |" in body
    assert "0.999" not in body  # another model's eval is not listed
    assert 'AutoProcessor.from_pretrained("alice/shapes-vlm")' in body
    assert "LlavaForConditionalGeneration" in body


def test_eval_results_without_a_dataset_id_stay_out_of_the_model_index(run_folder):
    from vlmctl.hub import build_model_card

    final = run_folder / "final"
    # no hub.datasets, and the run's data mixes a Hub dataset with a local file: the val split has no Hub id
    card = build_model_card(final, hub=HubSection(), repo_id="alice/shapes-vlm", eval_dir=run_folder.parents[1] / "eval")
    data = _check_hub_metadata(card.content)
    assert "model-index" not in data and data["datasets"] == ["lmms-lab/shapes-vqa"]
    assert "| vqa | val | 120 | accuracy | 0.4125 |" in card.text and "not in the card's `model-index`" in card.text

    # a run trained on one Hub dataset only: its val split is that dataset's
    cfg = yaml.safe_load((run_folder / "config.yaml").read_text())
    cfg["data"]["sources"] = [{"path": "lmms-lab/shapes-vqa", "format": "hf"}]
    (run_folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    card = build_model_card(final, hub=HubSection(), repo_id="alice/shapes-vlm", eval_dir=run_folder.parents[1] / "eval")
    index = _check_hub_metadata(card.content)["model-index"][0]["results"]
    assert {(r["dataset"]["type"], r["dataset"]["split"]) for r in index} == {("lmms-lab/shapes-vqa", "val")}


@pytest.mark.parametrize(
    "record, base_model, relation, text",
    [
        ({"mode": "base", "init": "pretrained", "built_from": {"base": "Qwen/Qwen2-VL-2B-Instruct"}, "source": "Qwen/Qwen2-VL-2B-Instruct"},
         ["Qwen/Qwen2-VL-2B-Instruct"], None, "Fine-tuned from [`Qwen/Qwen2-VL-2B-Instruct`]"),
        ({"mode": "base", "init": "pretrained", "built_from": {"base": "/data/models/my-vlm"}, "source": "/data/models/my-vlm"},
         None, None, "local model folder that is not on the Hub"),
        ({"mode": "compose", "init": "pretrained", "built_from": {"vision": "google/siglip2-base-patch16-224", "llm": "Qwen/Qwen3-0.6B", "projector": "mlp2x_gelu"}},
         ["Qwen/Qwen3-0.6B", "google/siglip2-base-patch16-224"], "finetune", "joined by a new `mlp2x_gelu` projector"),
        ({"mode": "compose", "init": "pretrained", "built_from": {"vision": "/data/siglip", "llm": "Qwen/Qwen3-0.6B"}},
         ["Qwen/Qwen3-0.6B"], None, "the vision encoder in a local folder (not on the Hub)"),
        ({"mode": "compose", "init": "random", "built_from": {"vision": "google/siglip2-base-patch16-224", "llm": "Qwen/Qwen3-0.6B"}},
         None, None, "randomly initialized weights"),
        ({"mode": "preset", "init": "random", "built_from": {"preset": "tiny"}}, None, None, "`tiny` preset"),
    ],
    ids=["base-hub", "base-local", "compose-hub", "compose-half-local", "compose-random", "preset"],
)
def test_base_model_names_hub_ids_only(tmp_path, record, base_model, relation, text):
    from vlmctl.hub import build_model_card

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}))
    (folder / "vlmctl_model.json").write_text(json.dumps(record))
    card = build_model_card(folder, hub=HubSection(), repo_id="alice/m")
    data = _check_hub_metadata(card.content)
    assert data.get("base_model") == base_model and data.get("base_model_relation") == relation
    assert text in card.text
    assert "/data/" not in card.content  # local paths never reach the card
    if base_model is None:
        assert "no base model on the Hub" in card.text or "names no `base_model`" in card.text


def test_model_card_without_run_says_so(tmp_path):
    from vlmctl.hub import build_model_card

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    card = build_model_card(folder, hub=HubSection(), repo_id="alice/m")
    assert "No training run was found" in card.text and "No `vlmctl eval` results" in card.text
    assert card.data.base_model is None and card.data.license == "apache-2.0"
    assert "the card names no `base_model`" in card.text.lower()
    _check_hub_metadata(card.content)


def test_dry_run_lists_files_and_card_and_uploads_nothing(run_folder, capsys, monkeypatch):
    monkeypatch.chdir(run_folder.parents[2])  # the project folder: hub.repo_id comes from vlmctl.yaml
    final = run_folder / "final"
    before = sorted(p.name for p in final.rglob("*"))
    code, out, err = run_cli(["push", "--dry-run"], capsys)  # DIR defaults to the latest run's final export
    assert code == 0, err
    assert "Would upload to alice/shapes-vlm" in out
    size_kb = (final / "model.safetensors").stat().st_size / 1024
    assert any("model.safetensors" in line and f"{size_kb:.1f} KB" in line for line in out.splitlines())
    assert "sub/notes.txt" in out and "README.md (generated)" in out
    assert "base_model:" in out and "pipeline_tag: image-text-to-text" in out and "| accuracy | 0.4125 |" in out
    assert "nothing was uploaded" in out
    assert sorted(p.name for p in final.rglob("*")) == before  # no README written


def test_dry_run_json(run_folder, capsys):
    code, out, _ = run_cli(["push", str(run_folder / "final"), "--repo-id", "org/x", "--dry-run", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    sizes = {f["path"]: f["size"] for f in data["files"]}
    assert sizes["model.safetensors"] == (run_folder / "final" / "model.safetensors").stat().st_size
    assert data["card_generated"] and data["total_bytes"] == sum(sizes.values())


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_upload_to_local_hub_receives_exact_files(run_folder, fake_hub, capsys):
    final = run_folder / "final"
    before = _snapshot(final)
    code, out, err = run_cli(["push", str(final), "--repo-id", "alice-lab/shapes-vlm", "--public", "--commit-message", "first"], capsys)
    assert code == 0, err
    assert TOKEN not in out + err
    repo = fake_hub.repos["alice-lab/shapes-vlm"]
    assert repo["visibility"] == "public"
    received = repo["branches"]["main"]
    assert _snapshot(final) == before  # nothing written into the model folder, not even the card
    on_disk = {rel: data for rel, (data, _) in before.items()}
    assert {k: v for k, v in received.items() if k != "README.md"} == on_disk
    card = received["README.md"].decode()
    assert _check_hub_metadata(card)["base_model"] == ["Qwen/Qwen2.5-0.5B", "google/siglip-base-patch16-224"]
    assert "# shapes-vlm" in card
    assert fake_hub.commits[-1]["header"]["summary"] == "first"
    assert "lfsFile" in fake_hub.commits[-1]["ops"] and "file" in fake_hub.commits[-1]["ops"]
    assert any(m == "PUT" and p.startswith("/_lfs/") for m, p in fake_hub.requests)

    # A second push to a branch of the existing repo sends the changed weights and the same card again.
    (final / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    code, _, err = run_cli(["push", str(final), "--repo-id", "alice-lab/shapes-vlm", "--revision", "v2"], capsys)
    assert code == 0, err
    assert repo["branches"]["v2"]["model.safetensors"] == (final / "model.safetensors").read_bytes()
    assert repo["branches"]["v2"]["README.md"] == received["README.md"]
    assert not (final / "README.md").exists()


def test_push_takes_dotted_overrides(run_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(run_folder.parents[2])  # the project folder (vlmctl.yaml: license unset, hub.datasets set)
    final = run_folder / "final"
    code, out, err = run_cli(["push", str(final), "--dry-run", "--json", "hub.license=mit", "hub.tags=[geometry]"], capsys)
    assert code == 0, err
    data = _check_hub_metadata(json.loads(out)["card"])
    assert data["license"] == "mit" and "geometry" in data["tags"]
    assert json.loads(out)["repo_id"] == "alice/shapes-vlm"  # the rest of the project file still applies

    monkeypatch.chdir(tmp_path)  # outside any project: the overrides apply to the defaults
    code, out, err = run_cli(["push", str(final), "--dry-run", "--json", "hub.repo_id=bob/m", "hub.license=mit"], capsys)
    assert code == 0, err
    assert json.loads(out)["repo_id"] == "bob/m" and "license: mit" in json.loads(out)["card"]

    code, _, err = run_cli(["push", str(final), "--dry-run", "hub.licence=mit"], capsys)
    assert code == 2 and "licence" in " ".join(err.split())
    code, _, err = run_cli(["push", str(final), str(final), "--dry-run"], capsys)
    assert code == 2 and "unexpected argument" in " ".join(err.split())


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory) -> Path:
    """A LoRA adapter saved by peft's own `save_pretrained` (with its placeholder README naming the local base
    path) on the tiny preset model, plus the processor files."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from convert_helpers import make_tiny_model

    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(str(tiny), dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(str(folder))
    AutoProcessor.from_pretrained(str(tiny)).save_pretrained(str(folder))
    return folder


def test_adapter_folder_gets_vlmctl_card_instead_of_peft_placeholder(peft_adapter, tmp_path, fake_hub, capsys):
    folder = tmp_path / "adapter"
    shutil.copytree(peft_adapter, folder)
    base_path = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    placeholder = (folder / "README.md").read_text()
    assert "Model Card for Model ID" in placeholder and base_path in placeholder  # what peft writes
    before = _snapshot(folder)

    code, out, err = run_cli(["push", str(folder), "--repo-id", "alice/shapes-lora", "--dry-run", "--json", "hub.datasets=[alice/shapes]"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["card_generated"] and "Model Card for Model ID" not in result["card"]
    data = _check_hub_metadata(result["card"])
    assert data["library_name"] == "peft" and data["license"] == "apache-2.0" and data["pipeline_tag"] == "image-text-to-text"
    assert data["datasets"] == ["alice/shapes"] and "lora" in data["tags"]
    assert "base_model" not in data  # the base is a local preset model: no Hub id to name
    assert base_path not in result["card"] and "base model that is not on the Hub" in result["card"]
    assert "`tiny` preset" in result["card"] and "PeftModel.from_pretrained" in result["card"]
    assert {f["path"]: f["size"] for f in result["files"]}["README.md"] == len(result["card"].encode())

    code, _, err = run_cli(["push", str(folder), "--repo-id", "alice/shapes-lora", "hub.datasets=[alice/shapes]"], capsys)
    assert code == 0, err
    received = fake_hub.repos["alice/shapes-lora"]["branches"]["main"]
    assert received["README.md"].decode() == result["card"]
    assert received["adapter_config.json"] == (folder / "adapter_config.json").read_bytes()
    assert _snapshot(folder) == before  # the placeholder stays in the user's folder; only the upload differs


def test_adapter_on_a_hub_model_names_it_as_base(peft_adapter, tmp_path, fake_hub, capsys):
    # `vlmctl model build` with model.base: the built folder records the Hub id it points at
    built = tmp_path / "built"
    built.mkdir()
    (built / "vlmctl_model.json").write_text(json.dumps({"family": "qwen2_vl", "mode": "base", "built_from": {"base": "Qwen/Qwen2-VL-2B-Instruct"},
                                                        "source": "Qwen/Qwen2-VL-2B-Instruct"}))
    folder = tmp_path / "adapter"
    shutil.copytree(peft_adapter, folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(built)}))
    before = _snapshot(folder)

    code, _, err = run_cli(["push", str(folder), "--repo-id", "alice/qwen-lora"], capsys)
    assert code == 0, err
    received = fake_hub.repos["alice/qwen-lora"]["branches"]["main"]
    card = received["README.md"].decode()
    data = _check_hub_metadata(card)
    assert data["base_model"] == ["Qwen/Qwen2-VL-2B-Instruct"] and data["library_name"] == "peft"
    assert str(built) not in card and 'AutoModelForImageTextToText.from_pretrained("alice/qwen-lora")' in card
    # the uploaded adapter names its base by Hub id, so that it loads anywhere; the local file keeps the path
    assert json.loads(received["adapter_config.json"])["base_model_name_or_path"] == "Qwen/Qwen2-VL-2B-Instruct"
    assert {k: v for k, v in json.loads(received["adapter_config.json"]).items() if k != "base_model_name_or_path"} == \
        {k: v for k, v in cfg.items() if k != "base_model_name_or_path"}
    assert _snapshot(folder) == before


def test_hand_written_card_is_kept(run_folder, capsys):
    final = run_folder / "final"
    (final / "README.md").write_text("---\nlicense: mit\n---\n\n# Shapes VLM\n\nOur own words.\n")
    code, out, err = run_cli(["push", str(final), "--repo-id", "alice/m", "--dry-run", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert not result["card_generated"] and result["card"] == (final / "README.md").read_text()


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("no_token", "not logged in"),
        ("bad_token", "rejected the token"),
        ("read_token", "read-only"),
        ("other_owner", "owned by 'bob'"),
        ("no_permission", "no write permission"),
        ("offline", "HF_HUB_OFFLINE"),
        ("unreachable", "cannot reach the Hub"),
    ],
)
def test_upload_errors_are_clear(case, fragment, run_folder, fake_hub, capsys, monkeypatch):
    from huggingface_hub import constants

    repo = "alice/m"
    if case == "no_token":
        monkeypatch.delenv("HF_TOKEN")
    elif case == "bad_token":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    elif case == "read_token":
        monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    elif case == "other_owner":
        repo = "bob/m"
    elif case == "no_permission":
        monkeypatch.setenv("HF_TOKEN", SCOPED_TOKEN)
    elif case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    elif case == "unreachable":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    code, out, err = run_cli(["push", str(run_folder / "final"), "--repo-id", repo], capsys)
    assert code == 1
    assert fragment in " ".join(err.split()), err
    assert "Traceback" not in err
    for token in (TOKEN, READ_TOKEN, SCOPED_TOKEN):
        assert token not in out + err
    assert not any(c["repo"] == repo for c in fake_hub.commits)
