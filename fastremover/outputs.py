"""What may be written where: the output rules, checked before anything is decoded or run.

A run never overwrites or deletes a file the user did not name as the output:

* the output must not be (by any spelling: ``./x``, ``a/../x``, a symlink, a hard link) one of the inputs, and a
  frame-folder output must not hold an input;
* an output needs a supported ending (``.mp4 .mov .mkv``, an image ending for one frame) or a trailing ``/`` for a
  folder of PNG frames: an empty or extension-less ``-o`` is refused rather than guessed;
* a frame folder may replace only an empty folder or one that fastremover wrote itself (it holds the manifest
  ``MANIFEST_NAME`` listing every file in it and nothing else);
* names must leave room for the temporary file written beside them, and the location must be writable.

Temporary files and folders are named ``.<name>.fastremover-<host>-<pid>-<random>.tmp`` beside the target, so a later
run can recognise those of a killed run (same host, process gone) and remove them; see :func:`remove_stale_temps`.

This module needs no media libraries and no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from fastremover.errors import FastRemoverError

#: Video containers written (all H.264), by ending -> FFmpeg format name.
VIDEO_OUTPUTS = {".mp4": "mp4", ".mov": "mov", ".mkv": "matroska"}
#: Single-image outputs (1-frame results).
IMAGE_OUTPUTS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
#: The file a frame-folder output carries to show that fastremover wrote it (and which files it wrote).
MANIFEST_NAME = ".fastremover-frames.json"
FRAME_NAME = re.compile(r"^\d{5,}\.png$")

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TEMP = re.compile(r"^\.(?P<name>.+)\.fastremover-(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]{8}\.(?:tmp|old)$")
_TEMP_SUFFIX_LEN = len(".fastremover-000000-4194304-00000000.tmp") + 1  # + the leading dot; pid_max is 2**22


@dataclass(frozen=True)
class OutputTarget:
    path: Path  # as the user gave it (without a trailing slash for folders)
    kind: Literal["video", "image", "folder"]

    @property
    def write_path(self) -> str:
        """The path to hand to media.write_video (a folder keeps its trailing slash)."""
        return os.fspath(self.path) + ("/" if self.kind == "folder" else "")

    def check_frames(self, num_frames: int) -> None:
        if self.kind == "image" and num_frames > 1:
            raise FastRemoverError(
                f"-o {self.path}: a single image holds one frame but the clip has {num_frames}; write a video "
                f"(.mp4) or a folder of frames ({self.path.with_suffix('')}/)"
            )


def temp_name(name: str, kind: str = "tmp") -> str:
    """The hidden temporary name written beside ``name`` by this process."""
    return f".{name}.fastremover-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.{kind}"


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def remove_stale_temps(folder: Path, name: str) -> list[Path]:
    """Remove the temporary files and folders that killed runs of fastremover on this host left for the target
    ``folder/name`` (their process is gone). Returns what was removed. Anything else is never touched."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if not m or m["name"] != name or m["host"] != _HOST or _process_alive(int(m["pid"])):
            continue
        path = Path(entry.path)
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed


def _same_path(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        if os.path.samefile(a, b):
            return True
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(child: Path, folder: Path) -> bool:
    c, f = os.path.realpath(child), os.path.realpath(folder)
    return c == f or c.startswith(f.rstrip(os.sep) + os.sep)


def _existing_ancestor(path: Path) -> Path:
    current = path.absolute()
    while True:
        try:
            if current.exists():
                return current
        except OSError as exc:
            raise FastRemoverError(f"cannot use {path}: {exc.strerror or exc}") from None
        if current.parent == current:
            return current
        current = current.parent


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def read_manifest(folder: Path) -> list[str] | None:
    """The frame names a fastremover-written folder lists, or None when ``folder`` has no valid manifest."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and FRAME_NAME.match(f) for f in files):
        return None
    return files


def replaceable_folder(folder: Path) -> str | None:
    """None when a frame-folder output may replace ``folder`` (missing, empty, or written by fastremover and holding
    nothing else); otherwise the reason it may not."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        return f"cannot list {folder}: {exc.strerror or exc}"
    if not names:
        return None
    listed = read_manifest(folder)
    if listed is None:
        return (f"{folder}/ already holds files that fastremover did not write (e.g. {names[0]!r}); fastremover never "
                "deletes files it did not write: choose a new or empty folder")
    foreign = sorted(set(names) - set(listed) - {MANIFEST_NAME})
    if foreign:
        return (f"{folder}/ holds files besides fastremover's frames (e.g. {foreign[0]!r}); move them away or choose "
                "a new folder")
    return None


def check_output(output: str | os.PathLike, inputs: Sequence[str | os.PathLike] = ()) -> OutputTarget:
    """The output target for ``-o output``, or FastRemoverError saying why it cannot be written. Touches nothing
    (a probe file is created and removed in an existing folder to check that it is writable)."""
    text = os.fspath(output)
    if not text.strip():
        raise FastRemoverError("-o is empty; name an output such as out.mp4, or a folder ending in / for PNG frames")
    if text == "-":
        raise FastRemoverError("-o -: writing to standard output is not supported; name an output file such as out.mp4")
    is_folder = text.endswith(("/", os.sep))
    path = Path(text.rstrip("/" + os.sep) or os.sep)
    suffix = path.suffix.lower()
    if is_folder:
        kind = "folder"
    elif suffix in VIDEO_OUTPUTS:
        kind = "video"
    elif suffix in IMAGE_OUTPUTS:
        kind = "image"
    elif not suffix:
        raise FastRemoverError(
            f"-o {text}: no file ending; use .mp4, .mov or .mkv for a video, or end it with / for a folder of PNG "
            f"frames ({text}/)"
        )
    else:
        raise FastRemoverError(
            f"-o {text}: cannot write {suffix!r} files; use .mp4, .mov or .mkv, .png for one frame, or a folder/"
        )
    if path.name in ("", ".", ".."):
        raise FastRemoverError(f"-o {text}: name a new folder (e.g. {text.rstrip('/')}/frames/), not the current one")
    for source in inputs:
        source = Path(source)
        if _same_path(path, source):
            raise FastRemoverError(f"-o {text} is the input {source}; write the result to a new file")
        if kind == "folder" and _inside(source, path):
            raise FastRemoverError(f"-o {text} holds the input {source}; write the frames to another folder")

    for part in path.parts[:-1]:
        if len(part.encode()) > 255:  # NAME_MAX of every common filesystem
            raise FastRemoverError(f"-o: the folder name {part[:40]}... is longer than 255 bytes; choose a shorter one")
    name_max = _name_max(_existing_ancestor(path.parent))
    if len(path.name.encode()) + _TEMP_SUFFIX_LEN > name_max:
        fits = name_max - _TEMP_SUFFIX_LEN
        raise FastRemoverError(
            f"-o: the name {path.name[:40]}... is {len(path.name.encode())} bytes long; at most {fits} fit here "
            "(fastremover writes a temporary file beside it first); choose a shorter name"
        )
    if len(os.fsencode(path.absolute())) + _TEMP_SUFFIX_LEN >= 4096:
        raise FastRemoverError("-o: the output path is too long; choose a shorter one")

    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise FastRemoverError(f"cannot use -o {text}: {exc.strerror or exc}") from None
    if kind == "folder":
        reason = replaceable_folder(path)
        if reason is not None:
            raise FastRemoverError(f"-o {text}: {reason}")
    elif is_dir:
        raise FastRemoverError(f"-o {text} is an existing folder; name a file, or end it with / for PNG frames")
    _check_writable(path if kind == "folder" and is_dir else path.parent, text)
    return OutputTarget(path=path, kind=kind)


def _check_writable(folder: Path, text: str) -> None:
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise FastRemoverError(f"cannot write the output -o {text}: {base} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fastremover-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FastRemoverError(
            f"cannot write the output -o {text}: {base}: {exc.strerror or exc}; choose another location"
        ) from None


# ----------------------------------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class InputProbe:
    num_frames: int  # the video's (an estimate when the container has no count; 0 when unknown)
    width: int
    height: int


def _check_readable(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    try:
        if not p.exists():
            raise FastRemoverError(f"{what} {p} does not exist; check the path")
        if p.is_dir():
            os.listdir(p)
        else:
            with open(p, "rb"):
                pass
    except FastRemoverError:
        raise
    except OSError as exc:
        raise FastRemoverError(f"cannot read the {what} {p}: {exc.strerror or exc}") from None
    return p


def check_inputs(video: str | os.PathLike, mask: str | os.PathLike) -> InputProbe:
    """Both inputs readable and probed as media (from the container, not decoded); the video's frame count and size.
    What memory the run needs is the worker's to check (it depends on the window, not on the clip's length)."""
    video_path = _check_readable(video, "video")
    mask_path = _check_readable(mask, "mask")
    from fastremover import media

    v = media.probe(video_path)
    media.probe(mask_path)  # a corrupt or unsupported mask fails here, before anything runs
    return InputProbe(num_frames=int(v["num_frames"]), width=int(v["width"]), height=int(v["height"]))


# ----------------------------------------------------------------------------------------------------------------------
# Swapping a folder in


def _renameat2_exchange():
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        libc = ctypes.CDLL(lib, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def swap_in_folder(new: Path, target: Path) -> None:
    """Put the finished folder ``new`` at ``target``. ``target`` must be missing, empty, or replaceable (see
    :func:`replaceable_folder`); its old frames are removed after the swap, nothing else is. On Linux the swap is one
    atomic exchange (renameat2), elsewhere two renames."""
    reason = replaceable_folder(target)
    if reason is not None:
        raise FastRemoverError(f"cannot write frames to {target}: {reason}")
    if not target.exists():
        os.rename(new, target)
        return
    if not os.listdir(target):
        os.rename(new, target)  # replaces an empty folder atomically
        return
    exchange = _renameat2_exchange()
    if exchange is not None and exchange(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(target),
                                         _RENAME_EXCHANGE) == 0:
        old = new  # `new` now names the previous folder
    else:
        old = target.with_name(temp_name(target.name, "old"))
        os.rename(target, old)
        os.rename(new, target)
    listed = read_manifest(old) or []
    for name in [*listed, MANIFEST_NAME]:
        with contextlib.suppress(FileNotFoundError):
            (old / name).unlink()
    with contextlib.suppress(OSError):
        old.rmdir()  # left in place if someone put a file there meanwhile
