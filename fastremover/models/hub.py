"""`--model`: the one place a model string becomes something to load, including Hugging Face Hub ids.

    classic | random            keywords (the weightless fill; a preset with random weights)
    PATH                        a local checkpoint folder (transformer/ vae/ scheduler/, diffusers layout)
    ORG/NAME[@REVISION]         a model repository on the Hugging Face Hub, e.g. zibojia/minimax-remover (the released
                                checkpoint); REVISION is a branch, a tag or a commit (default: main)
    hf:ORG/NAME[@REVISION]      the same, explicitly: never a local folder

A local folder that exists wins over a Hub id spelled the same ("org/name" next to the current directory); write
`hf:org/name` to mean the Hub then. `resolve_model` turns any of them into a `ResolvedModel` (kind, folder, repo id,
commit). A Hub id is read from the local Hugging Face cache (huggingface_hub's layout: `$HF_HOME/hub/
models--ORG--NAME/{refs,snapshots,blobs}`) when the revision is there; otherwise it is downloaded into that cache with a
progress bar, unless `HF_HUB_OFFLINE=1` (then a missing model is an error) or the caller forbids downloads. Only the
files the loader reads are fetched (`ALLOW_PATTERNS`). A cached revision is used as it is, without asking the Hub
whether a branch moved: `fastremover download ORG/NAME` updates it. Every snapshot is checked before use: the
folders, every weight file the index names, each safetensors header; a partial download (huggingface_hub writes a
snapshot's file only once its blob is complete) is reported, never loaded.

huggingface_hub is optional (the `hub` extra): without it a Hub id is one clear error naming the extra.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fastremover.errors import FastRemoverError

HUB_EXTRA = "pip install 'fastremover[hub]'"
KEYWORDS = ("classic", "random")
HUB_PREFIX = "hf:"
#: The files of a checkpoint repository the loader reads (fastremover.models.loading.load_checkpoint): all a download
#: fetches.
ALLOW_PATTERNS = ["transformer/*.json", "transformer/*.safetensors", "vae/*.json", "vae/*.safetensors",
                  "scheduler/*.json"]
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# The shape of a Hub repo id (huggingface_hub's validate_repo_id has the last word when installed): ORG/NAME of
# letters, digits, '-', '_', '.', no '--' or '..', at most 96 characters.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_REVISION = re.compile(r"[\w.][\w./-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")


class NotCached(FastRemoverError):
    """A Hub model that is not in the local cache, or only partly: a download can fix it."""


@dataclass(frozen=True)
class ModelRef:
    """A parsed --model string (`parse_model`); nothing is read yet."""

    kind: str  # "classic" | "random" | "folder" | "hub"
    text: str  # as given
    path: Path | None = None  # folder
    repo_id: str | None = None  # hub
    revision: str | None = None  # hub: as asked (None: the default branch)
    explicit: bool = False  # hub: named as one (hf: prefix, `fastremover download`), never a folder


@dataclass(frozen=True)
class ResolvedModel:
    """What `resolve_model` found: for "folder" and "hub" a checkpoint folder to load; for "hub" also the repo id and
    the commit (40 hex digits) whose snapshot the folder is."""

    kind: str  # "classic" | "random" | "folder" | "hub"
    path: Path | None
    repo_id: str | None = None
    revision: str | None = None

    @property
    def source(self) -> str:
        """How a run records the model: "ORG/NAME@<commit>" for a Hub model, else the folder or the keyword."""
        if self.kind == "hub":
            return f"{self.repo_id}@{self.revision}"
        return str(self.path) if self.path is not None else self.kind


def parse_model(model: str) -> ModelRef:
    """Classify a --model string (no file is read but the folder's existence, no network); FastRemoverError for a
    malformed Hub id."""
    if not isinstance(model, str) or not model.strip():
        raise FastRemoverError(f"--model {model!r}: give classic, random, a checkpoint folder or ORG/NAME")
    if model in KEYWORDS:
        return ModelRef(model, model)
    explicit = model.startswith(HUB_PREFIX)
    if not explicit and Path(model).expanduser().exists():
        return ModelRef("folder", model, path=Path(model).expanduser())
    text = model[len(HUB_PREFIX):] if explicit else model
    repo_id, _, revision = text.partition("@")
    looks_like_id = _REPO_ID.fullmatch(repo_id) is not None
    if not explicit and not looks_like_id:
        return ModelRef("folder", model, path=Path(model).expanduser())  # a folder that does not exist: said on use
    if not looks_like_id or "--" in repo_id or ".." in repo_id or len(repo_id) > 96:
        raise FastRemoverError(f"--model {model}: {repo_id!r} is not a Hugging Face Hub id (ORG/NAME, e.g. "
                               "zibojia/minimax-remover)")
    if "@" in text and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise FastRemoverError(f"--model {model}: {revision!r} is not a revision (a branch, a tag or a commit)")
    return ModelRef("hub", model, repo_id=repo_id, revision=revision or None, explicit=explicit)


def resolve_model(model: str, *, download: bool = True, progress: bool = True) -> ResolvedModel:
    """The checkpoint `model` names (see the module docstring). A Hub id comes from the local cache, else (when
    `download` and not HF_HUB_OFFLINE) from the Hub into the cache; the snapshot is verified (`verify_snapshot`).
    NotCached when it is absent or partial and may not be downloaded; FastRemoverError for everything else."""
    ref = parse_model(model)
    if ref.kind in KEYWORDS:
        return ResolvedModel(ref.kind, None)
    if ref.kind == "folder":
        if not ref.path.is_dir():
            what = "does not exist" if not ref.path.exists() else "is not a folder"
            raise FastRemoverError(f"--model {model}: {what}; not 'classic', 'random' or an existing checkpoint "
                                   "folder (with transformer/ vae/ scheduler/), nor a Hugging Face Hub id ORG/NAME")
        return ResolvedModel("folder", ref.path)
    hub = _hub(model)
    try:
        cached = _cached_snapshot(hub, ref)
        if cached is not None:
            verify_snapshot(cached, ref)
            return _resolved(ref, cached)
    except NotCached:
        if not download or _offline(hub):
            raise
    if not download or _offline(hub):
        raise NotCached(_not_cached_message(hub, ref))
    return _download(hub, ref, progress=progress, force=False)


def check_model(model: str) -> ResolvedModel | None:
    """Everything checkable about --model before a run, without the network: the keyword, the folder's existence, or
    a Hub id's cached snapshot (verified). None for a Hub model that is not cached (or partly) but may be downloaded
    when the model loads."""
    try:
        return resolve_model(model, download=False)
    except NotCached:
        if _offline(_hub(model)):
            raise
        return None


def download_model(model: str, *, progress: bool = True, force: bool = False) -> ResolvedModel:
    """`fastremover download`: ask the Hub for the revision's commit and fetch what the cache lacks of it (all of
    it with `force`). With HF_HUB_OFFLINE=1 a complete cached snapshot is returned as it is."""
    try:
        ref = parse_model(model if model.startswith(HUB_PREFIX) else HUB_PREFIX + model)
    except FastRemoverError:
        raise FastRemoverError(f"download {model}: not a Hugging Face Hub id; give ORG/NAME[@REVISION], e.g. "
                               "zibojia/minimax-remover") from None
    ref = ModelRef("hub", model, repo_id=ref.repo_id, revision=ref.revision, explicit=True)
    hub = _hub(HUB_PREFIX + model)
    if _offline(hub):
        cached = _cached_snapshot(hub, ref)
        if cached is None:
            raise NotCached(_not_cached_message(hub, ref))
        verify_snapshot(cached, ref)
        return _resolved(ref, cached)
    return _download(hub, ref, progress=progress, force=force)


def verify_snapshot(folder: Path, ref: ModelRef) -> None:
    """A snapshot folder holds a loadable checkpoint: transformer/ and vae/ with config.json and their weights (one
    file, or every shard the index json names), each safetensors header readable. NotCached for missing files (a
    partial download, or a repo without the expected folders), FastRemoverError for a corrupt file."""
    label = f"--model {ref.text}"
    again = f"run `fastremover download {ref.repo_id}{'@' + ref.revision if ref.revision else ''}` to complete it"
    for link in sorted(folder.rglob("*")):
        if link.is_symlink() and not link.exists():  # its blob was never finished (or was deleted)
            raise NotCached(f"{label}: {link.relative_to(folder)} is missing from the cached snapshot {folder} (an "
                            f"interrupted download); {again}")
    listed = _listed_files(folder, ref)
    if listed is not None:
        absent = [p for p in sorted(listed) if _wanted(p) and not (folder / p).is_file()]
        if absent:
            raise NotCached(f"{label}: {absent[0]} is missing from the cached snapshot {folder} (an interrupted "
                            f"download); {again}")
    for sub in ("transformer", "vae"):
        config = folder / sub / "config.json"
        if not config.is_file():
            if listed is not None and f"{sub}/config.json" not in listed:
                raise FastRemoverError(
                    f"{label}: the repository has no {sub}/config.json: not a MiniMax-Remover checkpoint in diffusers "
                    "layout (transformer/, vae/, scheduler/)")
            raise NotCached(f"{label}: the cached snapshot {folder} lacks {sub}/config.json: an interrupted download, "
                            f"or not a MiniMax-Remover checkpoint (transformer/, vae/, scheduler/); {again}")
        for weights in _weight_files(folder / sub, label):
            if not weights.is_file():
                raise NotCached(f"{label}: {sub}/{weights.name} is missing from the cached snapshot {folder} (an "
                                f"interrupted download); {again}")
            check_safetensors_header(weights, label, ref)


def check_safetensors_header(path: Path, label: str, ref: ModelRef | None = None) -> None:
    """FastRemoverError unless `path` has a valid safetensors header covering the whole file (safetensors' own
    check, reading the header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        again = (f"; fetch it again with `fastremover download {ref.repo_id} --force`" if ref is not None and
                 ref.kind == "hub" else "")
        raise FastRemoverError(f"{label}: {path} is not a readable safetensors file ({_first_line(e)}){again}") \
            from None


def cache_dir() -> Path | None:
    """The Hugging Face cache folder huggingface_hub uses ($HF_HUB_CACHE, or $HF_HOME/hub); None without it."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)


def cached_models() -> list[dict] | None:
    """The cached Hub snapshots that look like checkpoints (transformer/ and vae/ configs): id, commit, refs, bytes,
    folder and whether they verify (`problem`: None or why not). None without huggingface_hub."""
    try:
        import huggingface_hub as hub
    except ImportError:
        return None
    try:
        info = hub.scan_cache_dir(cache_dir())
    except hub.CacheNotFound:
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: (not r.refs, r.commit_hash)):  # named revisions first
            folder = Path(rev.snapshot_path)
            if not ((folder / "transformer").is_dir() or (folder / "vae").is_dir()):
                continue
            ref = ModelRef("hub", f"{repo.repo_id}@{rev.commit_hash}", repo_id=repo.repo_id,
                           revision=rev.commit_hash)
            try:
                verify_snapshot(folder, ref)
                problem = None
            except FastRemoverError as e:
                problem = str(e).split(": ", 1)[-1]
            rows.append({"id": repo.repo_id, "revision": rev.commit_hash, "refs": sorted(rev.refs),
                         "bytes": rev.size_on_disk, "path": str(folder), "problem": problem})
    return rows


def cache_lines() -> list[str]:
    """`fastremover info`'s lines on the Hugging Face cache."""
    rows = cached_models()
    if rows is None:
        return [f"huggingface_hub not installed: --model ORG/NAME needs it ({HUB_EXTRA})"]
    import huggingface_hub as hub

    lines = [f"folder {cache_dir()}" + ("  (HF_HUB_OFFLINE=1: no downloads)" if _offline(hub) else "")]
    for row in rows:
        refs = f" ({', '.join(row['refs'])})" if row["refs"] else ""
        state = "" if row["problem"] is None else f"  NOT USABLE: {row['problem']}"
        lines.append(f"{row['id']}@{row['revision'][:12]}{refs} {row['bytes'] / 1e9:.2f} GB: {row['path']}{state}")
    if not rows:
        lines.append("no cached checkpoints (fetch one with `fastremover download zibojia/minimax-remover`)")
    return lines


# ----------------------------------------------------------------------------------------------------------------------
# huggingface_hub calls


def _hub(model: str):
    try:
        import huggingface_hub
    except ImportError:
        folder = "" if model.startswith(HUB_PREFIX) else "no such folder here; "
        raise FastRemoverError(f"--model {model}: {folder}as a Hugging Face Hub id it needs huggingface_hub: "
                               f"{HUB_EXTRA}") from None
    return huggingface_hub


def _offline(hub) -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _not_cached_message(hub, ref: ModelRef) -> str:
    name = ref.repo_id + (f"@{ref.revision}" if ref.revision else "")
    why = "HF_HUB_OFFLINE=1 forbids downloading it" if _offline(hub) else "downloads are off here"
    folder = "" if ref.explicit else " (nor a folder here)"
    return (f"--model {ref.text}: not in the local Hugging Face cache ({cache_dir()}){folder} and {why}; run "
            f"`fastremover download {name}` where the Hub can be reached (or point HF_HOME at a cache that holds it)")


def _storage(ref: ModelRef) -> Path:
    return cache_dir() / ("models--" + ref.repo_id.replace("/", "--"))


def _cached_snapshot(hub, ref: ModelRef) -> Path | None:
    """The cached snapshot folder of ref's revision (huggingface_hub's own cache-only lookup), or None. NotCached
    when huggingface_hub's cached file listing shows files missing."""
    from huggingface_hub import errors

    revision = ref.revision
    if revision and _SHORT_COMMIT.fullmatch(revision) and not (_storage(ref) / "refs" / revision).exists():
        snapshots = _storage(ref) / "snapshots"
        matches = sorted(p.name for p in snapshots.glob(revision + "*")) if snapshots.is_dir() else []
        if len(matches) == 1:
            revision = matches[0]
    incomplete = getattr(errors, "IncompleteSnapshotError", None)
    try:
        path = hub.snapshot_download(ref.repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                     cache_dir=cache_dir(), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (huggingface_hub's errors vary between releases)
        if incomplete is not None and isinstance(e, incomplete):
            raise NotCached(f"--model {ref.text}: the cached snapshot is incomplete ({_first_line(e)[:160]}); run "
                            f"`fastremover download {ref.repo_id}` to complete it") from None
        return None
    return Path(path)


def _listed_files(folder: Path, ref: ModelRef) -> set[str] | None:
    """The repository's files at the snapshot's commit as huggingface_hub cached their listing when downloading
    (`trees/<commit>.json`), or None where it did not (older releases, a hand-made cache)."""
    tree = _storage(ref) / "trees" / f"{folder.name}.json"
    try:
        data = json.loads(tree.read_text())
    except (OSError, ValueError):
        return None
    entries = data.get("entries", data) if isinstance(data, dict) else data
    if isinstance(entries, dict):
        return set(entries)
    if isinstance(entries, list):
        return {e["path"] for e in entries if isinstance(e, dict) and "path" in e}
    return None


def _wanted(path: str) -> bool:
    """Whether a repository file is one the loader reads (ALLOW_PATTERNS)."""
    import fnmatch

    return any(fnmatch.fnmatch(path, pattern) for pattern in ALLOW_PATTERNS)


def _weight_files(folder: Path, label: str) -> list[Path]:
    """The weight files a model folder must hold: every shard its index names, else the one weights file."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise FastRemoverError(f"{label}: cannot read {index} ({_first_line(e)})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FastRemoverError(f"{label}: {index} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    found = sorted(folder.glob("*.safetensors"))
    return found if len(found) == 1 else [folder / WEIGHTS_NAME]


def _resolved(ref: ModelRef, folder: Path) -> ResolvedModel:
    return ResolvedModel("hub", folder, repo_id=ref.repo_id, revision=folder.name)


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled and not was_disabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def _download(hub, ref: ModelRef, *, progress: bool, force: bool) -> ResolvedModel:
    """Ask the Hub for the revision's files, check the repository is a checkpoint and the disk has room, fetch the
    files the cache lacks (huggingface_hub's snapshot_download: blobs written as .incomplete, then renamed), verify."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    label = f"--model {ref.text}"
    api = HfApi()
    try:
        commit = api.repo_info(ref.repo_id, revision=ref.revision).sha
        files = [f for f in api.list_repo_tree(ref.repo_id, revision=commit, recursive=True)
                 if getattr(f, "size", None) is not None]
    except Exception as e:  # noqa: BLE001
        raise _hub_error(hub, ref, e) from None
    sizes = {f.path: f.size for f in files}
    wanted = list(filter_repo_objects(sizes, allow_patterns=ALLOW_PATTERNS))
    missing_folders = [sub + "/" for sub in ("transformer", "vae") if f"{sub}/config.json" not in wanted]
    if missing_folders:
        raise FastRemoverError(f"{label}: the repository has no {' or '.join(missing_folders)} with a config.json at "
                               f"{commit[:12]}: not a MiniMax-Remover checkpoint in diffusers layout (transformer/, "
                               "vae/, scheduler/)")
    snapshot = _storage(ref) / "snapshots" / commit
    needed = sum(sizes[p] for p in wanted if force or not (snapshot / p).is_file())
    where = cache_dir()
    probe = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise FastRemoverError(f"{label}: downloading needs {needed / 1e9:.2f} GB in {where}, only {free / 1e9:.2f} GB "
                               "are free; free some space or point HF_HOME at a larger disk")
    if needed:
        from fastremover.log import logger

        logger.warning(f"{ref.repo_id}@{commit[:12]}: downloading {needed / 1e9:.2f} GB from {_endpoint()} "
                       f"into {where}")
    try:
        with _progress_bars(progress):
            path = hub.snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ALLOW_PATTERNS,
                                         cache_dir=where, force_download=force)
    except OSError as e:
        if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", 122)):
            raise FastRemoverError(f"{label}: the disk holding {where} filled up while downloading; free some space "
                                   "and run the same command again (finished files are kept)") from None
        raise _hub_error(hub, ref, e) from None
    except Exception as e:  # noqa: BLE001
        raise _hub_error(hub, ref, e) from None
    folder = Path(path)
    verify_snapshot(folder, ref)
    return _resolved(ref, folder)


def _hub_error(hub, ref: ModelRef, e: BaseException) -> FastRemoverError:
    """One line for an error huggingface_hub raised."""
    from huggingface_hub import utils

    label = f"--model {ref.text}"
    if isinstance(e, (utils.RepositoryNotFoundError, utils.GatedRepoError)):
        folder = "" if ref.explicit else "no such folder here, and "
        return FastRemoverError(f"{label}: {folder}no model {ref.repo_id} on the Hub ({_endpoint()}), or "
                                "it is private or gated (log in with `hf auth login`)")
    if isinstance(e, utils.RevisionNotFoundError):
        return FastRemoverError(f"{label}: {ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(e, utils.OfflineModeIsEnabled):
        return NotCached(_not_cached_message(hub, ref))
    return FastRemoverError(f"{label}: cannot download from {_endpoint()} ({type(e).__name__}: "
                            f"{_first_line(e)[:200]})")


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
