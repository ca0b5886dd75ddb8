"""--model ORG/NAME[@REVISION]: models in the Hugging Face cache (huggingface_hub's own layout, made here with random
tiny weights) and downloads from a local server that answers the way the Hub does. Nothing leaves 127.0.0.1."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
import torch

from fastremover import media
from fastremover.cli import main
from fastremover.errors import FastRemoverError
from fastremover.models import hub
from fastremover.models.loading import load_models, random_models, save_checkpoint

huggingface_hub = pytest.importorskip("huggingface_hub", reason="the hub extra (huggingface_hub) is not installed")
from huggingface_hub import constants as hf_constants  # noqa: E402

REPO = "org/name"
COMMIT_A = hashlib.sha1(b"revision a").hexdigest()
COMMIT_B = hashlib.sha1(b"revision b").hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# A cache in huggingface_hub's layout:
# models--org--name/{refs/<branch>, snapshots/<commit>/<file> -> ../../blobs/<hash>}


def storage(cache: Path, repo_id: str = REPO) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def populate(cache: Path, checkpoint: Path, commit: str, repo_id: str = REPO, refs=("main",)) -> Path:
    """Put the files of `checkpoint` into the cache as snapshot `commit` (blobs named by their sha256, as LFS files
    are; snapshot files as relative symlinks to them), with refs/<ref> naming the commit."""
    store = storage(cache, repo_id)
    for f in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = store / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = store / "snapshots" / commit / f.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (store / "refs").mkdir(parents=True, exist_ok=True)
        (store / "refs" / ref).write_text(commit)
    return store / "snapshots" / commit


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny random checkpoints (different weights): the contents of revisions A and B."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {COMMIT_A: save_checkpoint(random_models("tiny", seed=1), root / "a"),
            COMMIT_B: save_checkpoint(random_models("tiny", seed=2), root / "b")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder that huggingface_hub (and so fastremover) uses, offline."""
    folder = tmp_path / "hf" / "hub"
    folder.mkdir(parents=True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    use_endpoint(monkeypatch, "http://127.0.0.1:9")  # a stray request would stay on this machine (and be refused)
    return folder


def use_endpoint(monkeypatch, url: str) -> None:
    """HF_ENDPOINT for this process: huggingface_hub reads it once, at import, into these constants."""
    monkeypatch.setattr(hf_constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    import huggingface_hub.file_download as file_download  # releases before 1.0 hold their own copy

    monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template, raising=False)


def go_online(monkeypatch) -> None:
    """HF_HUB_OFFLINE=0 for this process (releases before 1.0 keep an offline HTTP session made earlier: dropped)."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    getattr(huggingface_hub.utils, "reset_sessions", lambda: None)()


@pytest.fixture
def cached(cache, checkpoints):
    """The cache holding revision A (main) and revision B (no ref)."""
    populate(cache, checkpoints[COMMIT_A], COMMIT_A)
    populate(cache, checkpoints[COMMIT_B], COMMIT_B, refs=())
    return cache


def write_clip(folder: Path, frames=5, h=32, w=32):
    video, mask = media.synthetic_clip(frames, h, w, seed=0)
    v, m = folder / "clip.mp4", folder / "m.mp4"
    media.write_video(v, video.frames, 24)
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    return v, m


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("fastremover: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# Parsing


def test_parse_model(tmp_path, monkeypatch):
    assert hub.parse_model("classic").kind == "classic" and hub.parse_model("random").kind == "random"
    ref = hub.parse_model("zibojia/minimax-remover")
    assert (ref.kind, ref.repo_id, ref.revision) == ("hub", "zibojia/minimax-remover", None)
    ref = hub.parse_model(f"org/name@{COMMIT_A}")
    assert (ref.repo_id, ref.revision) == ("org/name", COMMIT_A)
    assert hub.parse_model("hf:org/name@v1.0").revision == "v1.0"
    for path in ("./org/name", "/no/such/ckpt", "ckpt", "a/b/c"):
        assert hub.parse_model(path).kind == "folder", path
    # A folder that exists wins over the Hub id spelled the same; hf: means the Hub anyway.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse_model("org/name").kind == "folder"
    assert hub.parse_model("hf:org/name").kind == "hub"
    for bad, words in (("hf:org", "not a Hugging Face Hub id"), ("hf:org/na--me", "not a Hugging Face Hub id"),
                       ("org/name@", "not a revision"), ("org/name@a..b", "not a revision"), ("", "give classic")):
        with pytest.raises(FastRemoverError, match=words):
            hub.parse_model(bad)


# ---------------------------------------------------------------------------------------------------------------------
# The cache, offline


def test_remove_runs_offline_from_the_cache(cached, tmp_path, capsys):
    v, m = write_clip(tmp_path)
    out = tmp_path / "out.mp4"
    code, stdout, err = run_cli(["remove", v, "--mask", m, "--model", REPO, "-o", out, "--steps", "1", "--quiet"],
                                capsys)
    assert code == 0, err
    assert media.read_video(out).frames.shape == (5, 32, 32, 3)
    assert f"{REPO}@{COMMIT_A}" in stdout  # the run's record names the commit that ran


def test_the_record_and_the_bench_json_name_the_commit(cached, tmp_path):
    from fastremover.options import RunOptions
    from fastremover.pipeline import RemovalPipeline
    from fastremover.config import EngineConfig, ModelSource
    from fastremover.worker import Job, RemovalWorker

    models = load_models(REPO)
    assert (models.repo_id, models.revision, models.source) == (REPO, COMMIT_A, f"{REPO}@{COMMIT_A}")
    pipe = RemovalPipeline(models, EngineConfig(device="cpu", precision="fp32"))
    assert pipe.config.describe()["model"] == f"{REPO}@{COMMIT_A}"  # the bench JSON's "model"
    v, m = write_clip(tmp_path)
    job = Job(str(v), str(m), str(tmp_path / "o.mp4"), RunOptions(steps=1))
    worker = RemovalWorker(ModelSource(REPO), pipeline=pipe)
    assert worker.run(job).describe["model"] == f"{REPO}@{COMMIT_A}"  # the JobResult
    assert worker._identity(job, pipe)["engine"]["model"] == f"{REPO}@{COMMIT_A}"  # what a resumed run must match


def test_revision_pins(cached, checkpoints):
    a = hub.resolve_model(REPO)
    assert (a.kind, a.revision, a.path.name) == ("hub", COMMIT_A, COMMIT_A)
    for spelling in (f"{REPO}@{COMMIT_B}", f"{REPO}@{COMMIT_B[:10]}", f"hf:{REPO}@{COMMIT_B}"):
        assert hub.resolve_model(spelling).revision == COMMIT_B, spelling
    assert hub.resolve_model(f"{REPO}@main").revision == COMMIT_A
    weights_a = load_models(REPO).transformer.state_dict()["proj_out.weight"]
    weights_b = load_models(f"{REPO}@{COMMIT_B}").transformer.state_dict()["proj_out.weight"]
    expected_b = random_models("tiny", seed=2).transformer.state_dict()["proj_out.weight"]
    assert torch.equal(weights_b, expected_b) and not torch.equal(weights_a, weights_b)
    with pytest.raises(hub.NotCached, match="HF_HUB_OFFLINE=1"):
        hub.resolve_model(f"{REPO}@v2")  # a branch that is not cached


def test_info_lists_cached_models(cached, cache):
    rows = hub.cached_models()
    assert [(r["id"], r["revision"], r["refs"], r["problem"]) for r in rows] == [
        (REPO, COMMIT_A, ["main"], None), (REPO, COMMIT_B, [], None)]
    text = "\n".join(hub.cache_lines())
    assert str(cache) in text and f"{REPO}@{COMMIT_A[:12]} (main)" in text


def failing_remove(model, tmp_path, capsys, *needles, env_offline=True):
    v, m = write_clip(tmp_path)
    out = tmp_path / "out.mp4"
    code, _, err = run_cli(["remove", v, "--mask", m, "--model", model, "-o", out, "--steps", "1", "--quiet"], capsys)
    assert_one_line_error(code, err, *needles)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left either


def test_not_cached_and_offline(cache, tmp_path, capsys):
    failing_remove(REPO, tmp_path, capsys, "not in the local Hugging Face cache", "HF_HUB_OFFLINE=1",
                   f"fastremover download {REPO}")


def test_a_missing_file_is_a_partial_download(cached, cache, tmp_path, capsys):
    (storage(cache) / "snapshots" / COMMIT_A / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    failing_remove(REPO, tmp_path, capsys, "vae/diffusion_pytorch_model.safetensors is missing", "interrupted")
    # A blob huggingface_hub is still writing (.incomplete) is never used: the snapshot file does not exist yet.
    for name in ("scheduler/scheduler_config.json", "vae/config.json"):
        blob = (storage(cache) / "snapshots" / COMMIT_B / name).resolve()
        blob.rename(blob.with_name(blob.name + ".incomplete"))
        with pytest.raises(hub.NotCached, match=f"{name} is missing"):
            hub.resolve_model(f"{REPO}@{COMMIT_B}")
        blob.with_name(blob.name + ".incomplete").rename(blob)


def test_a_missing_shard_the_index_names(cached, cache, tmp_path, capsys):
    folder = storage(cache) / "snapshots" / COMMIT_A / "transformer"
    index = {"metadata": {}, "weight_map": {"proj_out.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
                                            "proj_out.bias": "diffusion_pytorch_model-00002-of-00002.safetensors"}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    failing_remove(REPO, tmp_path, capsys, "diffusion_pytorch_model-00001-of-00002.safetensors is missing")


def test_a_corrupt_safetensors_header(cached, cache, tmp_path, capsys):
    link = storage(cache) / "snapshots" / COMMIT_A / "transformer" / "diffusion_pytorch_model.safetensors"
    blob = link.resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[:8] + b"{not json" + data[17:])
    failing_remove(REPO, tmp_path, capsys, "not a readable safetensors file", "download org/name --force")
    blob.write_bytes(data[: len(data) // 2])  # truncated: the header names more bytes than the file has
    failing_remove(REPO, tmp_path, capsys, "not a readable safetensors file")


def test_a_repo_without_the_expected_folders(cache, checkpoints, tmp_path, capsys):
    populate(cache, checkpoints[COMMIT_A] / "scheduler", COMMIT_A)
    failing_remove(REPO, tmp_path, capsys, "lacks transformer/config.json")


def test_without_huggingface_hub_one_line_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    failing_remove(REPO, tmp_path, capsys, "needs huggingface_hub", "fastremover[hub]")
    assert hub.cache_lines()[0].startswith("huggingface_hub not installed")


def test_a_folder_that_does_not_exist(tmp_path, capsys):
    failing_remove(str(tmp_path / "no-checkpoint"), tmp_path, capsys, "does not exist")


def test_model_source_takes_hub_ids(cached, cache, tmp_path, capsys):
    """The engine's ModelSource (what every command and the worker pass on) accepts ORG/NAME[@REV] and hf: ids,
    checks them as --model does, and loads them through pipeline.load_source."""
    from fastremover.cli import build_parser
    from fastremover.config import ModelSource
    from fastremover.pipeline import load_source

    for name, label in ((REPO, REPO), (f"{REPO}@{COMMIT_B}", f"{REPO}@{COMMIT_B}"), (f"hf:{REPO}", REPO)):
        source = ModelSource(name)
        source.validate()
        assert (source.kind, source.label) == ("hub", label), name
    assert ModelSource(str(tmp_path)).kind == "folder"
    args = build_parser().parse_args(["serve", "--model", f"{REPO}@{COMMIT_B}"])
    assert ModelSource.from_args(args) == ModelSource(f"{REPO}@{COMMIT_B}")
    models = load_source(ModelSource(f"{REPO}@{COMMIT_B}"))
    assert models.source == f"{REPO}@{COMMIT_B}"
    with pytest.raises(hub.NotCached, match="HF_HUB_OFFLINE=1"):
        ModelSource("org/other").validate()  # not cached, offline: refused before anything loads
    with pytest.raises(FastRemoverError, match="not a Hugging Face Hub id"):
        ModelSource("hf:not-an-id").validate()
    # serve checks it before it starts (one line, exit 2)
    code, _, err = run_cli(["serve", "--model", "org/other", "--data-dir", tmp_path / "data"], capsys)
    assert_one_line_error(code, err, "not in the local Hugging Face cache")


# ---------------------------------------------------------------------------------------------------------------------
# Downloads from a local server that answers as the Hub does


class FakeHub:
    """Serves repositories the way the Hub's API does for snapshot_download: the model info
    (/api/models/{id}[/revision/{rev}]), the file tree (/api/models/{id}/tree/{commit}) and the files
    (/{id}/resolve/{rev}/{path}, with X-Repo-Commit, ETag and size headers; HEAD and GET), on 127.0.0.1."""

    def __init__(self, repos: dict[str, dict[str, bytes]], commit: str):
        self.repos, self.commit, self.requests = repos, commit, []
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def send(self, status, data=b"", headers=None, body=True):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def answer(self, body):
                path = unquote(urlparse(self.path).path)
                hub_.requests.append((self.command, path))
                parts = path.strip("/").split("/")
                missing = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
                if parts[:2] == ["api", "models"]:
                    repo_id = "/".join(parts[2:4])
                    kind, rev = (parts[4], parts[5]) if len(parts) > 5 else ("revision", "main")
                    files = hub_.repos.get(repo_id)
                    if files is None:
                        return self.send(404, b'{"error": "Repository not found"}', missing, body)
                    if rev not in ("main", hub_.commit):
                        return self.send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"},
                                         body)
                    if kind == "revision":
                        info = {"id": repo_id, "modelId": repo_id, "sha": hub_.commit, "private": False,
                                "siblings": [{"rfilename": p} for p in sorted(files)]}
                    else:
                        info = [{"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                for p, d in sorted(files.items())]
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                files = hub_.repos.get(repo_id)
                if files is None:
                    return self.send(404, b"", missing, body)
                if name not in files:
                    return self.send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                data = files[name]
                self.send(200, data, {"X-Repo-Commit": hub_.commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                      "Content-Type": "application/octet-stream"}, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def repo_files(checkpoint: Path, extra: dict | None = None) -> dict[str, bytes]:
    files = {str(p.relative_to(checkpoint)): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    return {**files, "README.md": b"# a model card the loader does not need\n", **(extra or {})}


def test_download_from_a_server_that_answers_as_the_hub(checkpoints, tmp_path):
    files = repo_files(checkpoints[COMMIT_A])
    other = {"scheduler/scheduler_config.json": files["scheduler/scheduler_config.json"], "README.md": b"x"}
    with FakeHub({REPO: files, "org/not-a-remover": other}, COMMIT_A) as server:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HOME": str(tmp_path / "hf"),
               "HF_ENDPOINT": server.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("HF_HUB_CACHE", None)

        def fastremover(*args):
            return subprocess.run([sys.executable, "-m", "fastremover", *args], env=env, capture_output=True,
                                  text=True, timeout=240)

        done = fastremover("download", REPO)
        assert done.returncode == 0, done.stderr
        snapshot = storage(tmp_path / "hf" / "hub") / "snapshots" / COMMIT_A
        assert COMMIT_A in done.stdout and str(snapshot) in done.stdout
        fetched = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
        assert fetched == sorted(p for p in files if p != "README.md")  # only what the loader reads
        assert all((snapshot / p).read_bytes() == files[p] for p in fetched)
        assert (storage(tmp_path / "hf" / "hub") / "refs" / "main").read_text() == COMMIT_A
        assert ("GET", f"/{REPO}/resolve/{COMMIT_A}/README.md") not in server.requests

        # Failures: one line, exit 2, nothing new in the cache.
        for args, words in ((["download", "org/missing"], "no model org/missing on the Hub"),
                            (["download", "org/not-a-remover"], "has no transformer/ or vae/"),
                            (["download", f"{REPO}@v9"], "has no revision 'v9'")):
            failed = fastremover(*args)
            lines = [x for x in failed.stderr.splitlines() if x.startswith("fastremover: error:")]
            assert failed.returncode == 2 and len(lines) == 1 and words in lines[0], failed.stderr
            assert "Traceback" not in failed.stderr
        assert not storage(tmp_path / "hf" / "hub", "org/not-a-remover").joinpath("blobs").exists()

        # The downloaded snapshot then serves runs with the network off.
        offline = fastremover("info")
        assert f"{REPO}@{COMMIT_A[:12]} (main)" in offline.stdout, offline.stderr


def test_download_refuses_when_the_disk_is_too_small(checkpoints, cache, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    go_online(monkeypatch)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with FakeHub({REPO: repo_files(checkpoints[COMMIT_A])}, COMMIT_A) as server:
        use_endpoint(monkeypatch, server.url)
        with pytest.raises(FastRemoverError, match="only 0.00 GB are free"):
            hub.download_model(REPO, progress=False)
    assert not (storage(cache) / "blobs").exists()


def test_an_uncached_model_is_downloaded_when_allowed(checkpoints, cache, tmp_path, monkeypatch):
    # remove / load_models: the cache first; a missing model is fetched (not offline), a partial one completed.
    go_online(monkeypatch)
    with FakeHub({REPO: repo_files(checkpoints[COMMIT_A])}, COMMIT_A) as server:
        use_endpoint(monkeypatch, server.url)
        assert hub.check_model(REPO) is None  # not cached, but may be downloaded when the model loads
        models = load_models(REPO, progress=False)
        assert models.revision == COMMIT_A
        served = len(server.requests)
        assert load_models(REPO).revision == COMMIT_A and len(server.requests) == served  # cached: no request
        (storage(cache) / "snapshots" / COMMIT_A / "vae" / "config.json").unlink()
        assert hub.resolve_model(REPO, progress=False).revision == COMMIT_A  # completed
        assert (storage(cache) / "snapshots" / COMMIT_A / "vae" / "config.json").is_file()
