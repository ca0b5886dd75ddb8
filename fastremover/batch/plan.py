"""What a batch runs: the clips of an input folder or manifest, their masks, their outputs, and which are already done.

Inputs
* A folder: every video file under it is a clip, and so is every sub-folder that holds image files directly (a folder
  of numbered frames; its own sub-folders are not searched). A loose image file is a one-frame clip. The clip's name is
  its path relative to the folder without the ending (``street/take1``).
* A manifest (``.csv`` with a header row, or ``.jsonl`` with one object per line): column ``video`` (required), ``mask``
  and ``output`` (optional) and per-clip options (``steps seed dilate size window overlap crop schedule composite
  mask_threshold``; an empty CSV cell keeps the batch's value). Relative paths are relative to the manifest's folder;
  ``output`` is relative to the output folder and must stay inside it.

Masks are matched by name in the masks folder: the clip ``street/take1`` takes ``street/take1`` with any video or image
ending, the frame folder ``street/take1/``, or the same with a ``_mask``, ``-mask`` or ``.mask`` suffix; exactly one
may match. Outputs mirror the names: ``take1.mov`` -> ``OUT/take1.mov`` (other video endings become ``.mp4``), a frame
folder -> a frame folder, an image -> ``.png``.

The output folder follows the rule of a frame-folder output: it is new, empty, or one that earlier batches wrote
(``OUT/.fastremover-batch.json`` lists the report and every output they finished; anything else in it, such
as a file of the user's, makes the batch refuse to start). Nothing in it is overwritten that a batch did not write.

When the masks sit beside the clips (``--masks`` is the input folder), a file that is the mask of another clip is a
mask, not a clip; a file that is both (it is named like another clip's mask and has a mask of its own beside it) is
refused before anything runs, since no name can say which it is: keep the masks in a folder of their own.

Resume: after a clip succeeds the driver writes a record (``OUT/.fastremover-batch/<clip>.json``) of its inputs
(path, size and modification time of the file, or of every file of a frame folder), its options, the model, and the
output's size and modification time. A later run skips the clip when the record matches all of these; anything else
(no record, a changed input or option, a replaced or missing output) runs it again.

Nothing here imports torch; the media libraries are imported only to probe frame counts.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastremover.config import EngineConfig, ModelSource
from fastremover.errors import FastRemoverError
from fastremover.options import RunOptions, validate_mask_threshold
from fastremover.outputs import VIDEO_OUTPUTS, is_ours_by_name
from fastremover.worker import DEFAULT_MAX_DECODED_GIB, Job

#: Endings read as videos and as images (= fastremover.media.VIDEO_EXTENSIONS / IMAGE_EXTENSIONS, kept here so
#: planning imports no media library; tests/e2e/test_batch.py checks they agree).
VIDEO_ENDINGS = frozenset(
    {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".gif", ".mpg", ".mpeg", ".ts", ".mts", ".m2ts",
     ".wmv", ".flv", ".3gp", ".ogv"}
)
IMAGE_ENDINGS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
MASK_SUFFIXES = ("", "_mask", "-mask", ".mask")
RECORDS_DIR = ".fastremover-batch"
REPORT_NAME = "report.jsonl"
MANIFEST = ".fastremover-batch.json"  # what the batches that used this folder wrote into it
RECORD_VERSION = 1

#: Per-clip manifest columns -> (RunOptions field or "mask_threshold", parser of a CSV cell).
_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
OPTION_COLUMNS = {
    "steps": int, "seed": int, "dilate": int, "window": int, "overlap": int, "size": str, "crop": str,
    "schedule": str, "composite": bool, "mask_threshold": int,
}
PATH_COLUMNS = ("video", "mask", "output")


@dataclass
class ClipTask:
    """One clip of a batch: its job (paths are absolute), a frame-count estimate for ordering, and, when planning
    already found it cannot run (no mask), the reason."""

    index: int  # position in the plan (report order)
    name: str  # relative name, unique in the batch: "street/take1"
    job: Job
    frames: int = 0  # probed estimate (0 when the probe failed; the worker reports the real error)
    error: str | None = None


@dataclass
class BatchPlan:
    out_dir: Path
    tasks: list[ClipTask] = field(default_factory=list)

    def record_path(self, task: ClipTask) -> Path:
        return self.out_dir / RECORDS_DIR / f"{task.name}.json"

    @property
    def report_path(self) -> Path:
        return self.out_dir / REPORT_NAME


# ----------------------------------------------------------------------------------------------------------------------
# Finding clips and masks


def _is_frame_folder(path: Path) -> bool:
    try:
        return any(e.is_file() and Path(e.name).suffix.lower() in IMAGE_ENDINGS for e in os.scandir(path))
    except OSError:
        return False


def _walk_clips(root: Path, exclude: list[Path]) -> list[tuple[str, Path]]:
    """(name, path) of every clip under ``root``, sorted by name."""
    found: list[tuple[str, Path]] = []
    excluded = {os.path.realpath(p) for p in exclude}

    def visit(folder: Path) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise FastRemoverError(f"cannot list {folder}: {exc.strerror or exc}") from None
        for entry in entries:
            path = Path(entry.path)
            if entry.name.startswith(".") or os.path.realpath(path) in excluded:
                continue
            rel = path.relative_to(root)
            if entry.is_dir():
                if _is_frame_folder(path):
                    found.append((rel.as_posix(), path))
                else:
                    visit(path)
            elif entry.is_file():
                suffix = path.suffix.lower()
                if suffix in VIDEO_ENDINGS or suffix in IMAGE_ENDINGS:
                    found.append((rel.with_suffix("").as_posix(), path))

    if _is_frame_folder(root) and not any(
        e.is_dir() or Path(e.name).suffix.lower() in VIDEO_ENDINGS for e in os.scandir(root)
    ):
        raise FastRemoverError(
            f"{root} holds only image files: that looks like the frames of one clip; run `fastremover remove` on it, "
            "or put each clip's frames in its own sub-folder"
        )
    visit(root)
    return found


def find_mask(masks: Path, name: str, clip: Path | None = None) -> Path:
    """The one mask in ``masks`` named like the clip ``name`` (see the module docstring), or FastRemoverError.
    ``clip`` (the clip's own path, when masks sit beside their clips) is never its own mask."""
    rel = Path(name)
    folder = masks / rel.parent
    stem = rel.name
    wanted = {stem + s for s in MASK_SUFFIXES}
    matches = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        entries = []
    for entry in entries:
        path = Path(entry.path)
        if clip is not None and path == clip:
            continue
        if entry.is_dir():
            if entry.name in wanted and _is_frame_folder(path):
                matches.append(path)
        elif path.suffix.lower() in VIDEO_ENDINGS | IMAGE_ENDINGS and entry.name[: -len(path.suffix)] in wanted:
            matches.append(path)
    if not matches:
        raise FastRemoverError(
            f"no mask for {name} in {masks}: give {masks / rel.parent / stem}.mp4 (or _mask.mp4, .png, a frame "
            "folder), or list the mask in a manifest"
        )
    if len(matches) > 1:
        listed = ", ".join(str(m.relative_to(masks)) for m in matches)
        raise FastRemoverError(f"{len(matches)} masks match {name} ({listed}); keep one")
    return matches[0]


def output_name(source: Path, name: str) -> str:
    """The output path relative to OUT_DIR that mirrors the input (a trailing "/" for a frame folder)."""
    if source.is_dir():
        return name + "/"
    suffix = source.suffix.lower()
    if suffix in VIDEO_OUTPUTS:
        return name + source.suffix
    if suffix in IMAGE_ENDINGS:
        return name + ".png"
    return name + ".mp4"


# ----------------------------------------------------------------------------------------------------------------------
# Manifests


def _read_manifest_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a .csv or .jsonl manifest, with empty CSV cells dropped."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise FastRemoverError(f"cannot read the manifest {path}: {getattr(exc, 'strerror', None) or exc}") from None
    rows: list[tuple[int, dict]] = []
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames:
            raise FastRemoverError(f"{path}: empty manifest; the first row names the columns (video,mask,...)")
        for row in reader:
            if None in row:
                raise FastRemoverError(f"{path}:{reader.line_num}: more cells than columns")
            cells = {k.strip(): (v or "").strip() for k, v in row.items()}
            if any(cells.values()):
                rows.append((reader.line_num, {k: v for k, v in cells.items() if v != ""}))
    elif suffix in (".jsonl", ".ndjson"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise FastRemoverError(f"{path}:{number}: not JSON ({exc.msg}); one object per line") from None
            if not isinstance(row, dict):
                raise FastRemoverError(f"{path}:{number}: each line must be a JSON object like {{\"video\": ...}}")
            rows.append((number, {k: v for k, v in row.items() if v is not None}))
    else:
        raise FastRemoverError(f"{path}: a manifest is a .csv or .jsonl file (or give a folder of clips)")
    if not rows:
        raise FastRemoverError(f"{path}: the manifest lists no clips")
    return rows


def _option(where: str, column: str, value):
    kind = OPTION_COLUMNS[column]
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool:
            if text not in _BOOL:
                raise FastRemoverError(f"{where}: {column} {value!r}: use true or false")
            return _BOOL[text]
        try:
            return int(text)
        except ValueError:
            raise FastRemoverError(f"{where}: {column} {value!r}: must be a whole number") from None
    if kind is bool and not isinstance(value, bool):
        raise FastRemoverError(f"{where}: {column} {value!r}: use true or false")
    if kind is str and not isinstance(value, str):
        raise FastRemoverError(f"{where}: {column} {value!r}: must be text")
    return value


def _manifest_clip_name(video: str) -> str:
    """A manifest video's name for matching its mask and naming its output: its path relative to the manifest without
    the ending (``street/take1``), or its file name alone when the path is absolute or leaves the manifest's folder."""
    path = Path(video.rstrip("/" + os.sep))
    if path.is_absolute() or ".." in path.parts or str(path).startswith("~"):
        return path.with_suffix("").name
    return path.with_suffix("").as_posix()


def _inside(path: Path, folder: Path) -> bool:
    p, f = os.path.normpath(path), os.path.normpath(folder)
    return p.startswith(f.rstrip(os.sep) + os.sep)


# ----------------------------------------------------------------------------------------------------------------------
# The plan


def _probe_frames(video: Path) -> int:
    try:
        from fastremover import media

        return int(media.probe(video)["num_frames"])
    except Exception:  # noqa: BLE001 - a clip that cannot be probed is the worker's to report; order it last
        return 0


@dataclass
class _Entry:
    """A clip as found, before it becomes a ClipTask."""

    name: str
    video: Path
    mask: Path | None
    error: str | None  # why it cannot run (no mask), or None
    output: str  # relative to OUT_DIR; a trailing "/" for a frame folder
    options: RunOptions
    mask_threshold: int


def _folder_entries(inputs: Path, masks: Path | None, out: Path, options: RunOptions, threshold: int) -> list[_Entry]:
    if masks is None:
        raise FastRemoverError("--masks: give the folder of masks (matched to the clips by name)")
    if os.path.realpath(out) == os.path.realpath(inputs):
        raise FastRemoverError(f"-o {out} is the input folder; write the outputs to another folder")
    clips = _walk_clips(inputs, exclude=[out, masks])
    if masks == inputs:  # masks beside their clips: a file used as a mask is not a clip
        used: dict[Path, str] = {}
        for name, path in clips:
            with contextlib.suppress(FastRemoverError):
                used[find_mask(masks, name, clip=path)] = name
        for name, path in clips:
            if path in used:
                try:
                    own = find_mask(masks, name, clip=path)
                except FastRemoverError:
                    continue
                raise FastRemoverError(
                    f"{path.name} is the mask of the clip {used[path]} and also a clip with a mask of its own "
                    f"({own.name}); with the masks beside the clips a name cannot say which it is: put the masks "
                    "in a folder of their own (--masks DIR)"
                )
        clips = [(name, path) for name, path in clips if path not in used]
    entries = []
    for name, path in clips:
        mask, error = None, None
        try:
            mask = find_mask(masks, name, clip=path)
        except FastRemoverError as exc:
            error = str(exc)
        entries.append(_Entry(name, path, mask, error, output_name(path, name), options, threshold))
    return entries


def _manifest_entry(where: str, row: dict, base: Path, masks: Path | None, out: Path, options: RunOptions,
                    threshold: int) -> _Entry:
    row = {k.strip().replace("-", "_"): v for k, v in row.items()}
    unknown = sorted(set(row) - set(PATH_COLUMNS) - set(OPTION_COLUMNS))
    if unknown:
        raise FastRemoverError(
            f"{where}: unknown column {unknown[0]!r}; columns are {', '.join(PATH_COLUMNS + tuple(OPTION_COLUMNS))}"
        )
    for column in PATH_COLUMNS:
        if column in row and not isinstance(row[column], str):
            raise FastRemoverError(f"{where}: {column} {row[column]!r}: must be a path")
    if "video" not in row:
        raise FastRemoverError(f"{where}: no video; each row needs a video path")
    video = (base / Path(row["video"]).expanduser()).absolute()
    clip = _manifest_clip_name(row["video"])
    output = row.get("output") or output_name(video, clip)
    if Path(output).is_absolute() or not _inside(out / output, out):
        raise FastRemoverError(f"{where}: output {output!r} must be a relative path inside -o {out}")
    mask, error = None, None
    if "mask" in row:
        mask = (base / Path(row["mask"]).expanduser()).absolute()
    elif masks is not None:
        try:
            mask = find_mask(masks, clip)
        except FastRemoverError as exc:
            error = str(exc)
    else:
        raise FastRemoverError(f"{where}: no mask column and no --masks folder to match {row['video']} in")
    changes = {k: _option(where, k, v) for k, v in row.items() if k in OPTION_COLUMNS}
    threshold = changes.pop("mask_threshold", threshold)
    clip_options = dataclasses.replace(options, **changes)
    try:
        clip_options.validate()
        validate_mask_threshold(threshold)
    except FastRemoverError as exc:
        raise FastRemoverError(f"{where}: {exc}") from None
    name = Path(output.rstrip("/" + os.sep)).with_suffix("").as_posix()
    return _Entry(name, video, mask, error, output, clip_options, threshold)


def plan_batch(
    inputs: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    masks: str | os.PathLike | None = None,
    options: RunOptions | None = None,
    mask_threshold: int = 20,
    max_decoded_gib: float = DEFAULT_MAX_DECODED_GIB,
) -> BatchPlan:
    """Every clip of ``inputs`` (a folder or a manifest) as a ClipTask with absolute paths, in name (or manifest) order,
    with its frame count probed for the dispatch order.

    Problems with the batch as a whole (missing folders, a malformed manifest, a bad option, two clips writing the same
    output) raise FastRemoverError before anything runs; a clip without a mask gets ``error`` and is reported failed.
    """
    options = options or RunOptions()
    options.validate()
    validate_mask_threshold(mask_threshold)
    inputs_path = Path(inputs).expanduser().absolute()
    out = Path(out_dir).expanduser().absolute()
    masks_path = None if masks is None else Path(masks).expanduser().absolute()
    if not inputs_path.exists():
        raise FastRemoverError(f"{inputs} does not exist; give a folder of clips or a .csv/.jsonl manifest")
    if masks_path is not None and not masks_path.is_dir():
        raise FastRemoverError(f"--masks {masks}: not a folder; give the folder that holds the masks")
    from fastremover.outputs import check_output

    check_output(out_dir, [inputs_path] + ([masks_path] if masks_path is not None else []), rule=batch_folder_rule)
    if inputs_path.is_dir():
        entries = _folder_entries(inputs_path, masks_path, out, options, mask_threshold)
    else:
        entries = [_manifest_entry(f"{inputs_path.name}:{number}", row, inputs_path.parent, masks_path, out, options,
                                   mask_threshold)
                   for number, row in _read_manifest_rows(inputs_path)]
    if not entries:
        raise FastRemoverError(f"{inputs}: no clips found (video files, or folders of numbered frames)")

    plan = BatchPlan(out_dir=out)
    seen: dict[str, Path] = {}
    for index, entry in enumerate(entries):
        key = entry.name.lower()  # names that differ only in case collide on case-insensitive filesystems
        if key in seen:
            raise FastRemoverError(
                f"two clips would write the same output {entry.name} ({seen[key]} and {entry.video}); rename one"
                + ("" if inputs_path.is_dir() else " or give an output column")
            )
        seen[key] = entry.video
        output = str(out / entry.output) + ("/" if entry.output.endswith(("/", os.sep)) else "")
        job = Job(video=str(entry.video), mask="" if entry.mask is None else str(entry.mask), output=output,
                  options=entry.options, mask_threshold=entry.mask_threshold, max_decoded_gib=max_decoded_gib)
        job.validate()
        frames = 0 if entry.error else _probe_frames(entry.video)
        plan.tasks.append(ClipTask(index=index, name=entry.name, job=job, frames=frames, error=entry.error))
    return plan


# ----------------------------------------------------------------------------------------------------------------------
# The output folder


def _read_listed(out: Path) -> set[str] | None:
    """What earlier batches wrote into ``out`` (relative paths; a frame folder ends in "/"), or None when no batch
    wrote there. A folder from before the manifest existed: the outputs its resume records name, and the report."""
    records = out / RECORDS_DIR
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        files = data.get("files") if isinstance(data, dict) else None
        if isinstance(files, list) and all(isinstance(f, str) for f in files):
            return set(files)
    except (OSError, ValueError):
        pass
    if not records.is_dir():
        return None
    listed = {REPORT_NAME}
    for path in records.rglob("*.json"):
        try:
            output = json.loads(path.read_text())["key"]["output"]
            listed.add(_relative_output(out, output))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return listed


def _relative_output(out: Path, output: str) -> str:
    rel = os.path.relpath(output.rstrip("/" + os.sep), out)
    return Path(rel).as_posix() + ("/" if output.endswith(("/", os.sep)) else "")


def _foreign(folder: Path, prefix: str, listed: set[str]) -> str | None:
    """The first file under ``folder`` that no batch wrote (relative to the output folder), or None."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return prefix or "."
    for entry in entries:
        rel = prefix + entry.name
        if (not prefix and entry.name in (RECORDS_DIR, MANIFEST)) or is_ours_by_name(entry.name) or rel in listed:
            continue
        if entry.is_dir(follow_symlinks=False):
            if rel + "/" in listed:
                continue  # a frame-folder output: its own manifest governs it
            found = _foreign(Path(entry.path), rel + "/", listed)
            if found is not None:
                return found
        else:
            return rel
    return None


def batch_folder_rule(out: Path) -> str | None:
    """None when a batch may write into the existing folder ``out`` (empty, or written by earlier batches and
    holding nothing else); otherwise why not."""
    try:
        names = sorted(os.listdir(out))
    except OSError as exc:
        return f"cannot list it: {exc.strerror or exc}"
    if not names:
        return None
    listed = _read_listed(out)
    if listed is None:
        return (f"already holds files that fastremover did not write (e.g. {names[0]!r}); a batch writes into a new or "
                "empty folder, or one an earlier batch wrote: choose another folder")
    found = _foreign(out, "", listed)
    if found is not None:
        return (f"holds files besides the ones earlier batches wrote (e.g. {found!r}); move them away or choose "
                "another folder")
    return None


def mark_written(plan: BatchPlan, written: list[str]) -> None:
    """Add ``written`` (paths inside the output folder; absolute, or relative to it) to the folder's manifest."""
    from fastremover.outputs import write_text

    listed = _read_listed(plan.out_dir) or set()
    listed |= {_relative_output(plan.out_dir, w) if os.path.isabs(w.rstrip("/")) else w for w in written}
    data = {"fastremover": "batch folder", "files": sorted(listed)}
    write_text(plan.out_dir / MANIFEST, json.dumps(data, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------------------
# Resume records


def _stat_identity(path: Path) -> dict:
    """Path, size and modification time of a file, or of each file of a folder (sorted by name)."""
    try:
        if path.is_dir():
            files = []
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                if entry.is_file():
                    st = entry.stat()
                    files.append([entry.name, st.st_size, st.st_mtime_ns])
            return {"path": str(path), "files": files}
        st = path.stat()
        return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    except OSError:
        return {"path": str(path), "missing": True}


def record_key(task: ClipTask, source: ModelSource, config: EngineConfig) -> dict:
    """What must not change for a finished clip to be skipped: inputs, options, threshold, model and engine."""
    job = task.job
    return {
        "version": RECORD_VERSION,
        "video": _stat_identity(Path(job.video)),
        "mask": _stat_identity(Path(job.mask)),
        "output": job.output,
        "options": dataclasses.asdict(job.options),
        "mask_threshold": job.mask_threshold,
        "model": source.describe(),
        "engine": config.describe(),
    }


def _output_target(output: str) -> Path:
    return Path(output.rstrip("/" + os.sep))


def write_record(plan: BatchPlan, task: ClipTask, key: dict, result: dict) -> None:
    """Record a finished clip (atomically): ``key`` (`record_key` taken before it ran), the output's identity now and
    the report fields to repeat when it is skipped."""
    from fastremover.outputs import write_text

    data = {"key": key, "output": _stat_identity(_output_target(task.job.output)), "result": result}
    write_text(plan.record_path(task), json.dumps(data, sort_keys=True) + "\n")


def finished_result(plan: BatchPlan, task: ClipTask, source: ModelSource, config: EngineConfig) -> dict | None:
    """The recorded result of ``task`` when its record matches the inputs, options, model and output now; else None."""
    try:
        data = json.loads(plan.record_path(task).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(record_key(task, source, config))):
        return None
    output = _stat_identity(_output_target(task.job.output))
    if output.get("missing") or data.get("output") != output:
        return None
    result = data.get("result")
    return result if isinstance(result, dict) else None
