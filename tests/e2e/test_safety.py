"""Never lose a user's file, fail fast, one line per user error (issue 21).

Every refusal asserts the exit code, the message, no traceback, and that every file that existed before is
byte-identical afterwards (and that nothing new was left behind).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest

from fastremover import media, outputs
from fastremover.cli import main
from fastremover.models.loading import random_models, save_checkpoint

from helpers import snapshot
from helpers.av_clips import write_av_clip


def make_clip(folder: Path, frames: int = 9, h: int = 48, w: int = 64) -> tuple[Path, Path]:
    video, mask = media.synthetic_clip(frames, h, w, seed=3)
    v, m = folder / "in.mp4", folder / "mask.mp4"
    media.write_video(v, video.frames, 24)
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    return v, m


def run(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.strip().splitlines() if line.startswith("fastremover: error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture
def clip(tmp_path):
    v, m = make_clip(tmp_path)
    return tmp_path, v, m


# ----------------------------------------------------------------------------------------------------------------------
# Data loss


def test_output_that_is_an_input_by_any_spelling_is_refused(clip, capsys, monkeypatch):
    root, v, m = clip
    monkeypatch.chdir(root)
    (root / "sub").mkdir()
    os.symlink(v, root / "link.mp4")
    os.link(m, root / "hard.mp4")
    before = snapshot(root)
    for output in ["in.mp4", "./in.mp4", "sub/../in.mp4", str(root / "in.mp4"), "link.mp4", "mask.mp4",
                   "./sub/../mask.mp4", "hard.mp4"]:
        refused(*run(["remove", "in.mp4", "--mask", "mask.mp4", "-o", output, "--quiet"], capsys)[::2], "is the input")
    assert snapshot(root) == before


def test_frame_folder_output_over_the_input_folder_is_refused(tmp_path, capsys):
    video, mask = media.synthetic_clip(5, 48, 64, seed=1)
    frames = tmp_path / "frames"
    media.write_video(str(frames) + "/", video.frames, 24)  # written by fastremover: replaceable in general
    m = tmp_path / "mask.png"
    media.write_image(m, np.repeat(mask[0][..., None].astype(np.uint8) * 255, 3, axis=-1))
    before = snapshot(tmp_path)
    for output in [f"{frames}/", f"{tmp_path}/frames/../frames/", f"{tmp_path}/"]:
        refused(*run(["remove", frames, "--mask", m, "-o", output, "--quiet"], capsys)[::2], "input")
    assert snapshot(tmp_path) == before


def test_folder_of_foreign_files_is_never_touched(clip, capsys):
    root, v, m = clip
    own = root / "mine"
    own.mkdir()
    (own / "00000.png").write_bytes(b"my holiday photo")
    (own / "00007.png").write_bytes(b"another")
    (own / "notes.txt").write_text("keep me")
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", f"{own}/", "--quiet"], capsys)[::2], "did not write")
    assert snapshot(root) == before


def test_frame_folder_is_replaced_only_when_fastremover_wrote_it(clip, capsys):
    root, v, m = clip
    out = root / "frames"
    code, _, err = run(["remove", v, "--mask", m, "-o", f"{out}/", "--quiet"], capsys)
    assert code == 0, err
    manifest = json.loads((out / outputs.MANIFEST_NAME).read_text())
    assert manifest["files"] == [f"{i:05d}.png" for i in range(9)]
    assert sorted(os.listdir(out)) == sorted([*manifest["files"], outputs.MANIFEST_NAME])
    # Its own folder: replaced by the next run (no leftovers beside it).
    code, _, err = run(["remove", v, "--mask", m, "-o", f"{out}/", "--quiet", "--dilate", "2"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == ["frames", "in.mp4", "mask.mp4"]
    # A file of the user's appears in it: now it is refused, and the user's file and the frames stay.
    (out / "my-edit.txt").write_text("mine")
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", f"{out}/", "--quiet"], capsys)[::2], "my-edit.txt")
    assert snapshot(root) == before


@pytest.mark.parametrize("output, words", [("", "empty"), ("   ", "empty"), ("-", "standard output"),
                                           ("result", "no file ending"), ("result.xyz", "cannot write"),
                                           ("./", "not the current one"), ("one.png", "single image")])
def test_empty_extensionless_and_odd_outputs_are_refused(clip, capsys, monkeypatch, output, words):
    root, v, m = clip
    monkeypatch.chdir(root)
    (root / "keep.txt").write_text("x")
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", output, "--quiet"], capsys)[::2], words)
    assert snapshot(root) == before


def test_interrupted_folder_write_leaves_the_old_folder_whole(clip, monkeypatch):
    root, v, m = clip
    video = media.read_video(v)
    out = root / "frames"
    media.write_video(f"{out}/", video.frames, 24)
    before = snapshot(root)
    calls = []
    real_encode = media._encode_image

    def encode_then_interrupt(path, frame):
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_encode(path, frame)

    monkeypatch.setattr(media, "_encode_image", encode_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        media.write_video(f"{out}/", video.frames[::-1].copy(), 24)
    assert len(calls) == 4
    assert snapshot(root) == before  # old frames intact, the half-written new folder gone


def test_sigterm_during_the_write_cleans_up_and_exits_143(tmp_path):
    v, m = make_clip(tmp_path, frames=80, h=144, w=192)
    out = tmp_path / "out.mp4"
    before = snapshot(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "fastremover.cli", "remove", str(v), "--mask", str(m), "-o",
                             str(out), "--quiet", "--model", "classic"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(".out.mp4.fastremover-") for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before its temporary output appeared"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "terminated" in err
    assert snapshot(tmp_path) == before  # no output, no temporary file


def test_stale_temporary_files_of_killed_runs_are_removed(clip, capsys):
    root, v, m = clip
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f".out.mp4.fastremover-{outputs._HOST}-{dead.pid}-0123abcd.tmp"
    stale.write_bytes(b"partial")
    alive = root / f".out.mp4.fastremover-{outputs._HOST}-{os.getpid()}-0123abcd.tmp"
    alive.write_bytes(b"being written")
    other_host = root / f".out.mp4.fastremover-ffffff-{dead.pid}-0123abcd.tmp"
    other_host.write_bytes(b"another machine's")
    other_target = root / f".other.mp4.fastremover-{outputs._HOST}-{dead.pid}-0123abcd.tmp"
    other_target.write_bytes(b"not ours to clean here")
    user_file = root / ".out.mp4.my-notes.tmp"
    user_file.write_bytes(b"user's")
    code, _, err = run(["remove", v, "--mask", m, "-o", root / "out.mp4", "--quiet"], capsys)
    assert code == 0, err
    assert not stale.exists()
    for kept in (alive, other_host, other_target, user_file):
        assert kept.exists(), kept


# ----------------------------------------------------------------------------------------------------------------------
# Fail fast


@pytest.mark.parametrize("flags, words", [
    (["--mask-threshold", "300"], "--mask-threshold 300"),
    (["--mask-threshold", "-1"], "--mask-threshold -1"),
    (["--seed", "-1"], "--seed -1"),
    (["--seed", str(2**63)], "--seed"),
    (["--steps", "0"], "--steps 0"),
    (["--steps", "100000"], "--steps 100000"),
    (["--dilate", "-1"], "--dilate -1"),
    (["--device", "foo"], "--device 'foo'"),
    (["--device", "meta"], "--device 'meta'"),
    (["--size", "16x1600000"], "at most 7680"),
    (["--size", "3840x3840"], "pixels in all"),
    (["--max-decoded-gib", "0"], "--max-decoded-gib"),
])
def test_option_ranges_are_checked_before_anything_runs(clip, capsys, flags, words):
    root, v, m = clip
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", root / "o.mp4", "--quiet", *flags], capsys)[::2], words)
    assert snapshot(root) == before


def test_a_bad_flag_or_path_is_reported_without_importing_torch(clip):
    """A refusal before the run (a flag, the output path, a missing input) imports neither torch nor OpenCV."""
    root, v, m = clip
    code = ("import sys; from fastremover.cli import main; rc = main(sys.argv[1:]); "
            "loaded = [n for n in ('torch', 'cv2') if sys.modules.get(n) is not None]; "
            "assert not loaded, f'imported: {loaded}'; sys.exit(rc)")
    missing = str(root / "missing.mp4")
    for inputs, flags in (((v, m), ["--seed", "-5"]), ((v, m), ["-o", str(root / "x")]), ((v, m), ["-o", str(v)]),
                          ((missing, m), ["--model", "random", "--preset", "tiny"]),
                          ((v, missing), ["--model", "random", "--preset", "tiny"])):
        argv = ["remove", str(inputs[0]), "--mask", str(inputs[1]), "-o", str(root / "o.mp4"), *flags]
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "fastremover: error:" in proc.stderr


def test_a_long_name_is_refused_before_the_run(clip, capsys):
    root, v, m = clip
    before = snapshot(root)
    for length in (242, 300):  # 242 is a valid name, but its temporary file's name is not
        name = "a" * (length - 4) + ".mp4"
        refused(*run(["remove", v, "--mask", m, "-o", root / name, "--quiet"], capsys)[::2], "shorter name")
    refused(*run(["remove", v, "--mask", m, "-o", root / ("b" * 300) / "o.mp4", "--quiet"], capsys)[::2], "folder name")
    assert snapshot(root) == before


def test_a_small_file_that_decodes_large_is_refused_before_decoding(tmp_path, capsys):
    video = tmp_path / "big.mp4"
    media.write_video(video, np.zeros((12, 1024, 1024, 3), np.uint8), 24)  # a few KB, 36 MiB decoded
    mask = tmp_path / "mask.png"
    media.write_image(mask, np.zeros((1024, 1024, 3), np.uint8))
    assert video.stat().st_size < 200_000
    before = snapshot(tmp_path)
    code, _, err = run(["remove", video, "--mask", mask, "-o", tmp_path / "o.mp4", "--max-decoded-gib", "0.03",
                        "--quiet"], capsys)
    refused(code, err, "decodes to", "GiB", "--max-decoded-gib")
    assert snapshot(tmp_path) == before
    # A frame folder announces no byte size up front: the reader stops as soon as the budget is passed.
    with pytest.raises(media.FastRemoverError, match="decodes to more than"):
        media.read_video(video, max_bytes=5 * 1024 * 1024 * 3)


def test_wrong_typed_checkpoint_config_names_the_key(tmp_path, capsys):
    v, m = make_clip(tmp_path)
    ckpt = save_checkpoint(random_models("tiny"), tmp_path / "ckpt")
    config = json.loads((ckpt / "transformer" / "config.json").read_text())
    config["num_layers"] = "1"
    (ckpt / "transformer" / "config.json").write_text(json.dumps(config))
    refused(*run(["remove", v, "--mask", m, "-o", tmp_path / "o.mp4", "--model", ckpt, "--quiet"], capsys)[::2],
            "num_layers", "wrong type")
    vae = json.loads((ckpt / "vae" / "config.json").read_text())
    config["num_layers"] = 1
    (ckpt / "transformer" / "config.json").write_text(json.dumps(config))
    vae["dim_mult"] = [1, "2", 4, 4]
    (ckpt / "vae" / "config.json").write_text(json.dumps(vae))
    refused(*run(["remove", v, "--mask", m, "-o", tmp_path / "o.mp4", "--model", ckpt, "--quiet"], capsys)[::2],
            "dim_mult")
    assert not (tmp_path / "o.mp4").exists()


def test_an_unlistable_input_folder_is_one_line(tmp_path, capsys, monkeypatch):
    video, mask = media.synthetic_clip(5, 48, 64, seed=1)
    frames = tmp_path / "frames"
    media.write_video(str(frames) + "/", video.frames, 24)
    m = tmp_path / "mask.png"
    media.write_image(m, np.zeros((48, 64, 3), np.uint8))
    if os.geteuid() != 0:
        frames.chmod(0)  # the real thing where permissions apply
    else:  # root may list anything: the operating system's answer for a folder it may not list
        real = os.listdir

        def listdir(path="."):
            if os.path.realpath(path) == os.path.realpath(frames):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(os, "listdir", listdir)
    try:
        refused(*run(["remove", frames, "--mask", m, "-o", tmp_path / "o.mp4", "--quiet"], capsys)[::2],
                "Permission denied", "frames")
    finally:
        frames.chmod(0o755)


def test_user_oserrors_anywhere_are_one_line(clip, capsys, monkeypatch):
    """An OSError a user causes that no check foresaw (here: the disk fills during the write) is still one line."""
    root, v, m = clip

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(media, "_encode_h264", full_disk)
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", root / "o.mp4", "--quiet"], capsys)[::2], "No space left")
    assert snapshot(root) == before


# ----------------------------------------------------------------------------------------------------------------------
# Audio, swapped inputs


def test_every_audio_stream_is_copied(tmp_path, capsys):
    video, mask = media.synthetic_clip(24, 48, 64, seed=2)
    src = tmp_path / "two-tracks.mp4"
    write_av_clip(src, video.frames, tones=(440, 660))
    m = tmp_path / "mask.mp4"
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    code, _, err = run(["remove", src, "--mask", m, "-o", tmp_path / "out.mp4", "--quiet"], capsys)
    assert code == 0, err
    with av.open(str(src)) as a, av.open(str(tmp_path / "out.mp4")) as b:
        assert len(b.streams.audio) == 2
        for index in range(2):
            src_packets = [bytes(p) for p in a.demux(a.streams.audio[index]) if p.size][:5]
            a.seek(0)
            out_packets = [bytes(p) for p in b.demux(b.streams.audio[index]) if p.size][:5]
            b.seek(0)
            assert src_packets == out_packets, index


def test_swapped_video_and_mask_get_a_warning(clip, capsys):
    root, v, m = clip
    code, _, err = run(["remove", m, "--mask", v, "-o", root / "o.mp4", "--quiet"], capsys)
    assert "swapped" in err and "Traceback" not in err  # (the run itself may then find the "mask" covers everything)
    code, _, err = run(["remove", v, "--mask", m, "-o", root / "o2.mp4", "--quiet"], capsys)
    assert code == 0 and "swapped" not in err and "does not look like" not in err


# ----------------------------------------------------------------------------------------------------------------------
# Install and API


def test_commands_run_without_triton(tmp_path):
    """`pip install -e .` has no Triton: demo, info and remove (classic and the tiny model on the CPU) must work."""
    demo = tmp_path / "demo"
    runs = [["demo", "-o", str(demo), "--frames", "9", "--width", "64", "--height", "48", "--quiet"],
            ["info"],
            ["remove", str(demo / "input.mp4"), "--mask", str(demo / "mask.mp4"), "-o", str(tmp_path / "t.mp4"),
             "--model", "random", "--preset", "tiny", "--steps", "1", "--device", "cpu", "--quiet"]]
    code = ("import json, sys; sys.modules['triton'] = None; from fastremover.cli import main\n"
            "for argv in json.loads(sys.argv[1]):\n    rc = main(argv)\n    assert rc == 0, (argv[0], rc)\n"
            "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert media.read_video(tmp_path / "t.mp4").num_frames == 9


@pytest.mark.parametrize("missing, argv, says", [
    ("fastapi", ["serve", "--port", "0"], 'pip install -e ".[serve]"'),
    ("uvicorn", ["serve", "--port", "0"], 'pip install -e ".[serve]"'),
    ("python_multipart", ["serve", "--port", "0"], "needs python-multipart"),
    ("ray", ["batch", "{clips}", "--masks", "{clips}", "-o", "{out}/", "--ray", "127.0.0.1:1"],
     'pip install -e ".[cluster]"'),
    ("diffusers", ["bench", "--workload", "w1", "--modes", "eager", "--preset", "tiny"],
     'pip install -e ".[reference]"'),
])
def test_a_command_without_its_extra_says_so_before_any_work(tmp_path, missing, argv, says):
    """A command whose optional packages are not installed prints one line naming the extra and exits 2 before it
    reads, plans or writes anything (no traceback, no output folder, no report)."""
    clips, out = tmp_path / "clips", tmp_path / "out"
    clips.mkdir()
    demo_args = ["demo", "-o", str(tmp_path / "demo"), "--frames", "5", "--width", "32", "--height", "32", "--quiet"]
    assert subprocess.run([sys.executable, "-m", "fastremover", *demo_args], capture_output=True,
                          timeout=120).returncode == 0
    (tmp_path / "demo" / "input.mp4").rename(clips / "a.mp4")
    (tmp_path / "demo" / "mask.mp4").rename(clips / "a_mask.mp4")
    argv = [a.format(clips=clips, out=out) for a in argv]
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from fastremover.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fastremover: error:")]
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists()


def test_public_api_imports_lazily():
    proc = subprocess.run([sys.executable, "-c", (
        "import sys, fastremover; assert 'torch' not in sys.modules; "
        "from fastremover import RemovalPipeline, RunOptions, RemovalWorker, read_video, write_video; "
        "assert RemovalPipeline.__doc__ and RunOptions.__doc__ and read_video.__doc__")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_killed_but_unreaped_writer_counts_as_gone():
    """A writer killed a moment ago may still be a zombie (its parent has not reaped it): its temporary files are
    stale all the same."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    assert not outputs._process_alive(child.pid)  # exited, not yet reaped
    assert outputs._process_alive(os.getpid())
    child.wait()
    assert not outputs._process_alive(child.pid)
