"""What may be written where: the output rules, checked before anything is decoded or run.

A run never overwrites or deletes a file the user did not name as an output. Every path a command writes (``-o``,
``--preview-mask``, ``mask --preview``, ``verify --json``, the demo's and the batch's folders) is checked here, all of
them together and before any work (:func:`check_outputs`), and written through :func:`atomic_path`:

* an output must not be (by any spelling: ``./x``, ``a/../x``, a symlink, a hard link) one of the inputs, and a
  folder output must not hold an input;
* two outputs of one command must not be the same file, and one must not lie inside another's folder;
* an output needs a supported ending (``.mp4 .mov .mkv``, an image ending for one frame) or a trailing ``/`` for a
  folder of PNG frames: an empty or extension-less ``-o`` is refused rather than guessed;
* a frame folder may replace only an empty folder or one that fastremover wrote itself (it holds the manifest
  ``MANIFEST_NAME`` listing every file in it and nothing else);
* names must leave room for the temporary file written beside them, the location must be writable, and a loop of
  symbolic links is refused by name.

Temporary files and folders are named ``.<name>.fastremover-<host>-<pid>-<random>.tmp`` beside the target, so a later
run can recognise those of a killed run (same host, process gone) and remove them; see :func:`remove_stale_temps`.
Scratch folders in the system's temporary folder (:func:`scratch_folder`) carry the host and process id the same way.

This module needs no media libraries and no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
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
from typing import Callable, Iterator, Literal, Sequence

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
    kind: Literal["video", "image", "folder", "file", "workdir"]  # folder: of PNG frames; workdir: see Wanted
    flag: str = "-o"

    @property
    def write_path(self) -> str:
        """The path to hand to media.write_video (a folder keeps its trailing slash)."""
        return os.fspath(self.path) + ("/" if self.kind == "folder" else "")

    def check_frames(self, num_frames: int) -> None:
        if self.kind == "image" and num_frames > 1:
            raise FastRemoverError(
                f"{self.flag} {self.path}: a single image holds one frame but the clip has {num_frames}; write a video "
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


def _kind_of(text: str, path: Path, flag: str, endings: Sequence[str] | None) -> str:
    """What `text` names by its ending: a video, an image, a folder of frames (trailing /), or (``endings``) a file."""
    suffix = path.suffix.lower()
    if endings is not None:
        if suffix not in endings or text.endswith(("/", os.sep)):
            raise FastRemoverError(f"{flag} {text}: name a {' or '.join(endings)} file")
        return "file"
    if text.endswith(("/", os.sep)):
        return "folder"
    if suffix in VIDEO_OUTPUTS:
        return "video"
    if suffix in IMAGE_OUTPUTS:
        return "image"
    if not suffix:
        raise FastRemoverError(
            f"{flag} {text}: no file ending; use .mp4, .mov or .mkv for a video, or end it with / for a folder of PNG "
            f"frames ({text}/)"
        )
    raise FastRemoverError(
        f"{flag} {text}: cannot write {suffix!r} files; use .mp4, .mov or .mkv, .png for one frame, or a folder/"
    )


def _refuse_loops(path: Path, flag: str, text: str) -> None:
    """A loop of symbolic links on the way to `path` (or at it) is said by name, not met later as a traceback."""
    for where in (path, path.parent):
        try:
            os.stat(where)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FastRemoverError(f"{flag} {text}: {where} is a loop of symbolic links; choose another path") \
                    from None
        except ValueError:  # an embedded NUL
            raise FastRemoverError(f"{flag} {text!r}: a path cannot hold a NUL character") from None


def check_output(output: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *, flag: str = "-o",
                 endings: Sequence[str] | None = None,
                 rule: Callable[[Path], str | None] | None = None) -> OutputTarget:
    """The output target for ``flag output``, or FastRemoverError saying why it cannot be written. Touches nothing
    (a probe file is created and removed in an existing folder to check that it is writable).

    By default the ending says what is written (a video, an image, or a folder of PNG frames for a trailing ``/``);
    ``endings`` (e.g. ``(".json",)``) names a data file instead; ``rule`` makes the path a folder a command fills by
    its own rule (the demo's, a batch's): ``rule(folder)`` returns why an existing folder may not be used, or None.
    One output only: :func:`check_outputs` checks several against each other."""
    text = os.fspath(output)
    if not text.strip():
        raise FastRemoverError(f"{flag} is empty; name an output such as out.mp4, or a folder ending in / for PNG "
                               "frames")
    if text == "-":
        raise FastRemoverError(f"{flag} -: writing to standard output is not supported; name an output file such as "
                               "out.mp4")
    path = Path(text.rstrip("/" + os.sep) or os.sep)
    kind = "workdir" if rule is not None else _kind_of(text, path, flag, endings)
    if path.name in ("", ".", "..") and kind != "workdir":
        raise FastRemoverError(f"{flag} {text}: name a new folder (e.g. {text.rstrip('/')}/frames/), not the current "
                               "one")
    _refuse_loops(path, flag, text)
    for source in inputs:
        source = Path(source)
        if _same_path(path, source):
            where = "to another folder" if kind in ("folder", "workdir") else "the result to a new file"
            raise FastRemoverError(f"{flag} {text} is the input {source}; write {where}")
        if kind in ("folder", "workdir") and _inside(source, path):
            raise FastRemoverError(f"{flag} {text} holds the input {source}; write to another folder")

    for part in path.parts[:-1]:
        if len(os.fsencode(part)) > 255:  # NAME_MAX of every common filesystem
            raise FastRemoverError(f"{flag}: the folder name {part[:40]}... is longer than 255 bytes; choose a "
                                   "shorter one")
    name_max = _name_max(_existing_ancestor(path.parent))
    size = len(os.fsencode(path.name))
    if size + _TEMP_SUFFIX_LEN > name_max:
        fits = name_max - _TEMP_SUFFIX_LEN
        raise FastRemoverError(
            f"{flag}: the name {path.name[:40]}... is {size} bytes long; at most {fits} fit here "
            "(fastremover writes a temporary file beside it first); choose a shorter name"
        )
    if len(os.fsencode(path.absolute())) + _TEMP_SUFFIX_LEN >= 4096:
        raise FastRemoverError(f"{flag}: the output path is too long; choose a shorter one")

    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise FastRemoverError(f"cannot use {flag} {text}: {exc.strerror or exc}") from None
    if kind == "folder":
        reason = replaceable_folder(path)
        if reason is not None:
            raise FastRemoverError(f"{flag} {text}: {reason}")
    elif kind == "workdir":
        if path.exists() and not is_dir:
            raise FastRemoverError(f"{flag} {text} is a file; name a folder")
        reason = rule(path) if is_dir else None
        if reason is not None:
            raise FastRemoverError(f"{flag} {text}: {reason}")
    elif is_dir:
        raise FastRemoverError(f"{flag} {text} is an existing folder; name a file"
                               + ("" if kind == "file" else ", or end it with / for PNG frames"))
    if kind in ("video", "folder") and (store := resume_path(path)).exists() and not store.is_dir():
        raise FastRemoverError(f"{flag} {text}: {store} is a file where fastremover keeps a run's resume state; "
                               "move it away")
    _check_writable(path if kind in ("folder", "workdir") and is_dir else path.parent, f"{flag} {text}")
    return OutputTarget(path=path, kind=kind, flag=flag)


@dataclass(frozen=True)
class Wanted:
    """One path a command will write, for :func:`check_outputs`: the flag that names it (for messages), the path,
    and what it is (see :func:`check_output`: ``endings`` for a data file, ``rule`` for a command's own folder)."""

    flag: str
    path: str | os.PathLike | None  # None: not asked for (skipped)
    endings: tuple[str, ...] | None = None
    rule: Callable[[Path], str | None] | None = None


def check_outputs(wanted: Sequence[Wanted], inputs: Sequence[str | os.PathLike | None] = ()) -> list[OutputTarget]:
    """Every path a command writes, checked once, before any work: each one as :func:`check_output` does against
    all the inputs, then against each other: two outputs that are the same file (by any spelling), or one inside
    another's folder, are refused. Returns the targets of the outputs asked for (``path`` not None), in order."""
    sources = [s for s in inputs if s is not None and os.fspath(s) != ""]
    targets = [check_output(w.path, sources, flag=w.flag, endings=w.endings, rule=w.rule)
               for w in wanted if w.path is not None]
    for i, a in enumerate(targets):
        for b in targets[i + 1:]:
            if _same_path(a.path, b.path):
                raise FastRemoverError(f"{b.flag} {b.path} and {a.flag} {a.path} are the same file; give each its own "
                                       "path")
            for outer, inner in ((a, b), (b, a)):
                if outer.kind in ("folder", "workdir") and _inside(inner.path, outer.path):
                    raise FastRemoverError(f"{inner.flag} {inner.path} is inside the folder {outer.flag} "
                                           f"{outer.write_path} that fastremover writes; put it somewhere else")
    return targets


def _check_writable(folder: Path, what: str) -> None:
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise FastRemoverError(f"cannot write the output {what}: {base} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fastremover-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FastRemoverError(
            f"cannot write the output {what}: {base}: {exc.strerror or exc}; choose another location"
        ) from None


# ----------------------------------------------------------------------------------------------------------------------
# Writing


#: OSErrors of a write that the user can act on (a full disk, permissions, a path that is not a folder): said in one
#: line naming the path (:func:`write_error`).
USER_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENOSPC, errno.EEXIST,
     getattr(errno, "EDQUOT", errno.ENOSPC), errno.ENAMETOOLONG, errno.ELOOP, errno.EFBIG}
)


def write_error(path: str | os.PathLike, exc: OSError) -> FastRemoverError:
    """The one-line error for a failed write of ``path``."""
    reason = exc.strerror or str(exc)
    return FastRemoverError(f"cannot write {os.fspath(path)}: {reason}; choose a writable location or free some "
                            "space")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (created empty, mode 0o666 minus the umask); on success it is renamed
    over ``path``, on any exception (KeyboardInterrupt and the CLI's SIGTERM too) it is removed. Temporary files
    that killed runs left for the same target are removed first (:func:`remove_stale_temps`). A missing parent
    folder is created. An OSError the user can act on becomes a one-line FastRemoverError naming ``path``.
    Every file fastremover writes goes through here (``media.atomic_write_path`` is this for media files)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise FastRemoverError(f"cannot write {path}: {path.parent} is not a folder (a file is in the way); choose "
                               "another output path") from None
    except OSError as exc:
        raise write_error(path, exc) from None
    if path.is_dir():
        raise FastRemoverError(f"cannot write {path}: it is an existing folder; choose a file name")
    remove_stale_temps(path.parent, path.name)
    tmp = path.with_name(temp_name(path.name))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(fd)
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in USER_ERRNOS:
            raise write_error(path, exc) from exc
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------------
# Scratch folders

_SCRATCH = re.compile(r"^fastremover-(?P<purpose>[a-z0-9]+)-(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]{8}$")


def remove_stale_scratch(folder: str | os.PathLike | None = None) -> list[Path]:
    """Remove the scratch folders (:func:`scratch_folder`) that killed runs on this host left in ``folder`` (the
    system's temporary folder by default): those whose process is gone. Returns what was removed."""
    base = Path(folder or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        m = _SCRATCH.match(entry.name)
        if not m or m["host"] != _HOST or _process_alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
                removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def scratch_folder(purpose: str) -> Iterator[Path]:
    """A new private folder ``fastremover-<purpose>-<host>-<pid>-<random>`` in the system's temporary folder, removed
    when the block ends; those of killed runs (process gone) are removed first, so a SIGKILL leaves at most one."""
    base = Path(tempfile.gettempdir())
    remove_stale_scratch(base)
    path = base / f"fastremover-{purpose}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir(mode=0o700)
    except OSError as exc:
        raise FastRemoverError(f"cannot make a scratch folder in {base}: {exc.strerror or exc}; set TMPDIR to a "
                               "writable folder") from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def resume_path(output: str | os.PathLike) -> Path:
    """Where a run keeps what a killed run needs to continue (``stream.ResumeStore``): ``.<name>.fastremover-resume``
    beside the output."""
    path = Path(os.fspath(output).rstrip("/" + os.sep))
    return path.with_name(f".{path.name}.fastremover-resume")


def temp_target(name: str) -> str | None:
    """The name a temporary file or folder of a write (:func:`temp_name`) stands in for; None for any other name."""
    m = _TEMP.match(name)
    return m["name"] if m else None


def is_ours_by_name(name: str) -> bool:
    """Whether a file name is one fastremover gives its transient files beside an output: a temporary file or
    folder of a write (:func:`temp_name`) or a resume store (``.<name>.fastremover-resume``)."""
    return bool(_TEMP.match(name)) or (name.startswith(".") and name.endswith(".fastremover-resume"))


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
