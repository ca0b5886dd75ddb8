"""The CLI, batch, mask, resume and h3-decode hardening of issues 42 (items 7-13 and its "Also" list) and 48.

Every refusal asserts the exit code, one `fastremover: error:` line, no traceback, that every file that existed before
is byte-identical afterwards, and that nothing was left behind (no temporary file, scratch folder or partial output).
Clips are tiny (9 frames of 64x48) and run with the weightless classic remover.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from fastremover import media, outputs, stream
from fastremover.cli import main
from fastremover.errors import FastRemoverError
from helpers import REPO, snapshot


def leftovers(root: Path) -> list[str]:
    """Temporary files, part files and scratch folders of fastremover under root."""
    return sorted(os.fsdecode(p.relative_to(root)) for p in root.rglob("*")
                  if ".fastremover-" in p.name and (p.name.endswith((".tmp", ".old")) or ".part" in p.name)
                  or p.name.endswith(".part") or p.name.startswith("fastremover-boxmask-"))


def refused(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.strip().splitlines() if line.startswith("fastremover: error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def run(args, capsys) -> tuple[int, str, str]:
    code = main([os.fspath(a) if isinstance(a, Path) else str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def cli(args, *, env: dict | None = None, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    """`python -m fastremover ARGS` in a fresh process (bytes in and out: names need not be UTF-8)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "fastremover", *[os.fsencode(a) for a in args]], capture_output=True,
                          env=full, cwd=cwd, timeout=timeout)


def write_clip(folder: Path, name: str = "in.mp4", frames: int = 9, h: int = 48, w: int = 64,
               mask_name: str | None = "mask.mp4") -> tuple[Path, Path | None]:
    video, mask = media.synthetic_clip(frames, h, w, seed=3)
    v = folder / name
    media.write_video(v, video.frames, 24)
    if mask_name is None:
        return v, None
    m = folder / mask_name
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    return v, m


@pytest.fixture
def clip(tmp_path):
    v, m = write_clip(tmp_path)
    return tmp_path, v, m


BOX = "24,14,20,20"  # around the synthetic object on frame 0


# ----------------------------------------------------------------------------------------------------------------------
# 7. Every path a command writes: refused when it is an input or another output, before any work


@pytest.mark.parametrize("spelling", ["in.mp4", "./in.mp4", "sub/../in.mp4", "link.mp4", "hard.mp4"])
def test_preview_mask_that_is_the_input_is_refused(clip, capsys, monkeypatch, spelling):
    root, v, _ = clip
    monkeypatch.chdir(root)
    (root / "sub").mkdir()
    os.symlink(v, root / "link.mp4")
    os.link(v, root / "hard.mp4")
    before = snapshot(root)
    for extra in ([], ["--allow-uncertain"]):  # tracking that stays uncertain (exit 2 on old code) too
        refused(*run(["remove", "in.mp4", "--box", BOX, "--preview-mask", spelling, "-o", "o.mp4", "--quiet",
                      *extra], capsys)[::2], "--preview-mask", "is the input")
    assert snapshot(root) == before


def test_preview_mask_equal_to_the_output_or_inside_it_is_refused(clip, capsys, monkeypatch):
    root, v, _ = clip
    monkeypatch.chdir(root)
    before = snapshot(root)
    refused(*run(["remove", v, "--box", BOX, "--allow-uncertain", "--preview-mask", "p.mp4", "-o", "./p.mp4",
                  "--quiet"], capsys)[::2], "same file")
    refused(*run(["remove", v, "--box", BOX, "--allow-uncertain", "--preview-mask", "frames/p.mp4", "-o", "frames/",
                  "--quiet"], capsys)[::2], "inside the folder")
    refused(*run(["mask", v, "--box", BOX, "--allow-uncertain", "--preview", "m.mp4", "-o", "./m.mp4", "--quiet"],
                 capsys)[::2], "same file")
    refused(*run(["remove", v, "--mask", "mask.mp4", "--preview-mask", "p.mp4", "-o", "o.mp4", "--quiet"],
                 capsys)[::2], "--preview-mask", "--box")  # nothing would be previewed: not silently ignored
    assert snapshot(root) == before


def test_demo_preview_inside_its_folder_is_refused(tmp_path, capsys):
    before = snapshot(tmp_path)
    refused(*run(["demo", "-o", tmp_path / "d", "--frames", "5", "--width", "32", "--height", "32", "--box",
                  "8,8,10,10", "--preview-mask", tmp_path / "d" / "p.mp4", "--quiet"], capsys)[::2], "inside the folder")
    assert snapshot(tmp_path) == before


def test_verify_json_that_is_an_input_is_refused_before_work(clip, capsys):
    root, v, m = clip
    os.symlink(m, root / "results.json")  # the mask, by another name
    before = snapshot(root)
    refused(*run(["verify", v, "--mask", m, "--model", "random", "--preset", "tiny", "--steps", "1", "--json",
                  root / "results.json"], capsys)[::2], "--json", "is the input")
    assert snapshot(root) == before


def test_check_outputs_checks_the_set_once(tmp_path):
    a, b = tmp_path / "a.mp4", tmp_path / "b.mp4"
    a.write_bytes(b"x")
    os.link(a, b)
    W = outputs.Wanted
    with pytest.raises(FastRemoverError, match="same file"):
        outputs.check_outputs([W("-o", a), W("--preview-mask", b)])  # a hard link of one another
    with pytest.raises(FastRemoverError, match="is the input"):
        outputs.check_outputs([W("-o", tmp_path / "new.mp4"), W("--preview-mask", b)], inputs=[a])
    with pytest.raises(FastRemoverError, match="--json"):
        outputs.check_outputs([W("--json", tmp_path / "r.txt", endings=(".json",))])
    targets = outputs.check_outputs([W("-o", f"{tmp_path}/f/"), W("--preview-mask", None),
                                     W("--json", tmp_path / "r.json", endings=(".json",))], inputs=[a, None])
    assert [t.kind for t in targets] == ["folder", "file"]
    assert snapshot(tmp_path) == {"a.mp4": hashlib.sha256(b"x").hexdigest(), "b.mp4": hashlib.sha256(b"x").hexdigest()}


# ----------------------------------------------------------------------------------------------------------------------
# 8. A batch output folder: new, empty, or written by earlier batches


def batch_clips(root: Path, count: int = 2) -> Path:
    clips = root / "clips"
    clips.mkdir()
    for i in range(count):
        write_clip(clips, f"c{i}.mp4", mask_name=f"c{i}_mask.mp4")
    return clips


def test_batch_never_overwrites_a_users_files_in_its_folder(tmp_path, capsys):
    clips = batch_clips(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.jsonl").write_text('{"mine": true}\n')
    before = snapshot(tmp_path)
    refused(*run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)[::2], "did not write",
            "report.jsonl")
    assert snapshot(tmp_path) == before

    (out / "report.jsonl").unlink()
    code, _, err = run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)
    assert code == 0, err
    code, _, err = run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)  # ours now: skipped
    assert code == 0, err
    assert {line["status"] for line in map(json.loads, (out / "report.jsonl").read_text().splitlines())} == {
        "skipped"}
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "keep.mp4").write_bytes(b"mine")
    before = snapshot(tmp_path)
    refused(*run(["batch", clips, "--masks", clips, "-o", out, "--quiet", "--force"], capsys)[::2], "notes.txt")
    (out / "notes.txt").unlink()
    refused(*run(["batch", clips, "--masks", clips, "-o", out, "--quiet", "--force"], capsys)[::2], "sub/keep.mp4")
    assert snapshot(tmp_path) == {k: v for k, v in before.items() if k != "out/notes.txt"}
    assert leftovers(tmp_path) == []


def test_batch_folder_written_before_the_manifest_is_still_ours(tmp_path, capsys):
    clips = batch_clips(tmp_path)
    out = tmp_path / "out"
    assert run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)[0] == 0
    (out / ".fastremover-batch.json").unlink()  # as an older fastremover left it: records and the report only
    assert run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)[0] == 0


def test_an_output_written_just_before_the_batch_is_killed_is_still_ours(tmp_path, capsys, monkeypatch):
    """The worker has written a clip's output but the driver stops before it hears so (kill -9 on a loaded machine):
    the next run takes the folder as its own and continues."""
    import fastremover.batch.local as local

    clips = batch_clips(tmp_path)
    out = tmp_path / "out"
    original = local.run_clip

    def then_killed(worker, task):
        entry = original(worker, task)
        assert Path(task.job.output).is_file()
        raise KeyboardInterrupt  # the driver stops here, before on_done

    monkeypatch.setattr(local, "run_clip", then_killed)
    assert run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)[0] == 130
    monkeypatch.setattr(local, "run_clip", original)
    code, _, err = run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.glob("*.mp4")) == ["c0.mp4", "c1.mp4"]


# ----------------------------------------------------------------------------------------------------------------------
# 9. SIGTERM with --workers 2, a full disk: nothing left behind

SLOW_WRITES = textwrap.dedent("""
    # Loaded by every Python process of the test (the spawned batch workers too): H.264 writes take 0.3 s per frame
    # and announce themselves, so the test can stop the batch while both workers are writing.
    import os
    if os.environ.get("FR_SLOW_WRITES"):
        import time
        from pathlib import Path

        import fastremover.media as media

        original = media._encode_h264

        def slow(tmp, container_format, frames, rate, **kwargs):
            Path(os.environ["FR_SLOW_WRITES"], f"{os.getpid()}-{Path(tmp).name}").touch()

            def dribble():
                for frame in frames:
                    time.sleep(0.3)
                    yield frame

            return original(tmp, container_format, dribble(), rate, **kwargs)

        media._encode_h264 = slow
""")


def test_sigterm_mid_batch_with_two_workers_leaves_no_temporary_files(tmp_path):
    clips = batch_clips(tmp_path, count=4)
    out, site, marks = tmp_path / "out", tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WRITES)
    env = {**os.environ, "FR_SLOW_WRITES": str(marks),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "fastremover", "batch", str(clips), "--masks", str(clips), "-o",
                             str(out), "--workers", "2", "--quiet"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(marks.iterdir())) >= 2, "the workers never started writing"
    temps = [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert temps  # the writes are under way
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("fastremover: terminated")], err
    assert leftovers(out) == [], leftovers(out)


def test_a_full_disk_during_a_batch_names_the_path_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    clips = batch_clips(tmp_path)
    out = tmp_path / "out"

    def full_disk(tmp, *args, **kwargs):
        Path(tmp).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(media, "_encode_h264", full_disk)
    code, _, err = run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)
    assert code == 1, err  # each clip failed, said in the report
    report = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    assert all(line["status"] == "failed" and "No space left" in line["error"] and line["output"] in line["error"]
               for line in report), report
    assert not [p for p in out.rglob("*.mp4")] and leftovers(tmp_path) == []
    monkeypatch.undo()

    # The disk fills while the report is written at the end: one line naming it, no temporary report left.
    real_open = io.open

    class Full:
        """A file on a full disk: the first write stores a few bytes, then fails."""

        def __init__(self, file):
            self.file = file

        def write(self, data):
            self.file.write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def __getattr__(self, name):
            return getattr(self.file, name)

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and os.path.basename(os.fsdecode(file)).startswith(".report.jsonl."):
            return Full(f)
        return f

    monkeypatch.setattr(io, "open", full_open)
    monkeypatch.setattr(builtins, "open", full_open)
    code, _, err = run(["batch", clips, "--masks", clips, "-o", out, "--quiet"], capsys)
    monkeypatch.undo()
    refused(code, err, "No space left", str(out / "report.jsonl"))
    assert leftovers(tmp_path) == []


def test_a_full_disk_while_saving_a_window_leaves_no_part_file(tmp_path, monkeypatch):
    store = stream.ResumeStore(tmp_path / ".o.mp4.fastremover-resume", {"a": 1}, resume=False)
    store.start("first")
    frames = np.zeros((5, 8, 8, 3), np.uint8)

    def full_disk(file, **arrays):
        file.write(b"PK partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stream, "_write_npz", full_disk)
    record = {"start": 0, "stop": 5, "overlap": 0, "box": None, "run_hw": None, "ran": True}
    store.save(0, record, frames + 1, frames)  # written in the background: the error comes with the flush
    with pytest.raises(FastRemoverError, match="window_00000.npz: No space left"):
        store.flush()
    assert leftovers(tmp_path) == [] and store.windows == []


# ----------------------------------------------------------------------------------------------------------------------
# 10. Names: not UTF-8, Unicode under an ASCII locale, symbolic-link loops


def test_an_output_name_that_is_not_utf8_works(clip):
    root, v, m = clip
    name = os.fsdecode(b"out\xff.mp4")
    proc = cli(["remove", v, "--mask", m, "-o", root / name, "--quiet"], env={"PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"Traceback" not in proc.stderr
    assert os.fsencode(root / name) in proc.stdout  # printed back as the bytes it was given
    assert media.read_video(root / name).num_frames == 9


def test_a_unicode_output_name_under_an_ascii_locale_works(clip):
    root, v, m = clip
    proc = cli(["remove", v, "--mask", m, "-o", root / "été.mp4", "--quiet"],
               env={"PYTHONIOENCODING": "ascii", "LC_ALL": "C", "LANG": "C"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"Traceback" not in proc.stderr and b"wrote" in proc.stdout
    assert (root / "été.mp4").is_file()


def test_a_batch_clip_whose_name_is_not_utf8_runs(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    name = os.fsdecode(b"take\xe9")
    write_clip(clips, f"{name}.mp4", mask_name=f"{name}_mask.mp4")
    out = tmp_path / "out"
    proc = cli(["batch", clips, "--masks", clips, "-o", out, "--quiet"], env={"PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    (line,) = [json.loads(x) for x in (out / "report.jsonl").read_text().splitlines()]
    assert line["status"] == "ok" and line["clip"] == name
    assert media.read_video(out / f"{name}.mp4").num_frames == 9


def test_an_output_through_a_symlink_loop_is_one_line(clip, capsys):
    root, v, m = clip
    os.symlink("loop", root / "loop")
    os.symlink("self.mp4", root / "self.mp4")
    before = snapshot(root)
    for output in (root / "loop" / "o.mp4", root / "self.mp4", f"{root / 'loop'}/"):
        refused(*run(["remove", v, "--mask", m, "-o", output, "--quiet"], capsys)[::2], "loop of symbolic links")
    assert snapshot(root) == before


# ----------------------------------------------------------------------------------------------------------------------
# 11. A damaged resume store starts over; a mask that decodes huge is refused from its header


def saved_store(root: Path, v: Path, m: Path, monkeypatch, capsys) -> Path:
    """The resume store a killed two-window run of `remove in.mp4 -o o.mp4 --window 5 --overlap 1` leaves."""
    with monkeypatch.context() as patch:
        patch.setattr(stream.ResumeStore, "clear", lambda self: None)  # as if killed before it cleared its store
        assert run(["remove", v, "--mask", m, "-o", root / "o.mp4", "--window", "5", "--overlap", "1", "--quiet"],
                   capsys)[0] == 0
    (root / "o.mp4").unlink()
    store = stream.resume_dir(root / "o.mp4")
    assert sorted(p.name for p in store.iterdir()) == ["state.json", "window_00000.npz", "window_00001.npz"]
    return store


@pytest.mark.parametrize("damage", ["empty window", "garbage window", "empty state", "state without fields"])
def test_a_damaged_resume_store_is_discarded_with_a_note(clip, capsys, monkeypatch, damage):
    root, v, m = clip
    argv = ["remove", v, "--mask", m, "-o", root / "o.mp4", "--window", "5", "--overlap", "1", "--quiet"]
    assert run(argv, capsys)[0] == 0
    expected = (root / "o.mp4").read_bytes()
    (root / "o.mp4").unlink()
    store = saved_store(root, v, m, monkeypatch, capsys)
    if damage == "empty window":
        (store / "window_00001.npz").write_bytes(b"")
    elif damage == "garbage window":
        (store / "window_00000.npz").write_bytes(b"not a zip file at all")
    elif damage == "empty state":
        (store / "state.json").write_text("")
    else:
        state = json.loads((store / "state.json").read_text())
        state["windows"] = [{"start": 0}] * len(state["windows"])
        (store / "state.json").write_text(json.dumps(state))
    code, _, err = run([*argv, "--resume"], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "starting from the beginning" in err
    assert (root / "o.mp4").read_bytes() == expected
    assert not store.exists() and leftovers(root) == []


def test_a_mask_that_decodes_huge_is_refused_from_its_header(clip, capsys, monkeypatch):
    root, v, _ = clip
    ok, data = cv2.imencode(".png", np.zeros((12000, 12000), np.uint8))  # 150 KB that decode to 432 MB of RGB
    bomb = root / "bomb.png"
    bomb.write_bytes(data.tobytes())
    assert bomb.stat().st_size < 200_000
    decode = media._read_image_rgb

    def no_bombs(path):
        assert Path(path).name != "bomb.png", "the bomb was decoded"
        return decode(path)

    monkeypatch.setattr(media, "_read_image_rgb", no_bombs)
    assert media.image_size(bomb) == (12000, 12000)
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", bomb, "-o", root / "o.mp4", "--quiet"], capsys)[::2], "12000x12000",
            "far larger than the video")
    refused(*run(["remove", bomb, "--mask", bomb, "-o", root / "o.png", "--quiet", "--max-decoded-gib", "0.5"],
                 capsys)[::2], "decodes to", "GiB")
    refused(*run(["mask", bomb, "--box", "10,10,50,50", "-o", root / "m.png", "--quiet", "--max-decoded-gib", "0.2"],
                 capsys)[::2], "decodes to more than")
    assert snapshot(root) == before


def test_image_headers_give_the_size_of_every_image_ending(tmp_path):
    rng = np.random.default_rng(0)
    for ending in sorted(media.IMAGE_EXTENSIONS):
        for h, w in ((13, 17), (480, 640), (1, 300)):
            path = tmp_path / f"x{ending}"
            media.write_image(path, rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            assert media.image_size(path) == (w, h), (ending, h, w)
    (tmp_path / "cut.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert media.image_size(tmp_path / "cut.png") is None


# ----------------------------------------------------------------------------------------------------------------------
# 12. Options that would be ignored; h3-decode's checks


@pytest.mark.parametrize("flags, words", [
    (["--weights", "nvfp4"], "classic remover"),
    (["--weights", "nvfp4-w4a4"], "classic remover"),
    (["--force-w4a4"], "--weights nvfp4-w4a4 only"),
    (["--max-decoded-gib", "nan"], "positive number"),
])
def test_options_that_would_change_nothing_are_refused(clip, capsys, flags, words):
    root, v, m = clip
    before = snapshot(root)
    refused(*run(["remove", v, "--mask", m, "-o", root / "o.mp4", "--quiet", *flags], capsys)[::2], words)
    refused(*run(["batch", root, "--masks", root, "-o", root / "out", "--quiet", *flags], capsys)[::2], words)
    assert snapshot(root) == before


def test_w4a4_on_full_frames_is_refused_before_the_model_loads(clip, capsys):
    root, v, m = clip
    refused(*run(["remove", v, "--mask", m, "-o", root / "o.mp4", "--model", "random", "--preset", "tiny",
                  "--device", "cpu", "--weights", "nvfp4-w4a4", "--crop", "off", "--quiet"], capsys)[::2],
            "--crop off", "full frames")


def test_w4a4_with_crop_on_does_not_say_use_crop_on(clip, capsys):
    """A mask that reaches the frame's edges makes the --crop on box the whole frame: the refusal says so."""
    root, v, _ = clip
    mask = root / "edges.png"
    full = np.zeros((48, 64, 3), np.uint8)
    full[:, :3] = full[:, -3:] = 255
    full[:3] = full[-3:] = 255
    media.write_image(mask, full)
    line = refused(*run(["remove", v, "--mask", mask, "-o", root / "o.mp4", "--model", "random", "--preset", "tiny",
                         "--steps", "1", "--device", "cpu", "--weights", "nvfp4-w4a4", "--crop", "on", "--quiet"],
                        capsys)[::2], "whole frame", "--force-w4a4")
    assert "use --crop on" not in line
    assert not (root / "o.mp4").exists()


def latents(path: Path, shape) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({"z": torch.zeros(shape)}, str(path))
    return path


H3_NO_TORCH = ("import sys; from fastremover.cli import main; rc = main(sys.argv[1:]); "
               "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")


@pytest.mark.parametrize("args, words", [
    (["{z0}", "-o", "{root}/h.mp4"], "no height"),
    (["{z}", "-o", "{root}/h.mp4", "--weights-seed", str(2**70)], "--weights-seed"),
    (["{z}", "-o", "{root}/h.mp4", "--max-decoded-gib", "nan"], "--max-decoded-gib"),
    (["{z}", "-o", "{root}/h.mp4", "--fps", "nan"], "--fps"),
    (["{root}/missing.safetensors", "-o", "{root}/h.mp4"], "no such file"),
    (["{z}", "-o", ""], "-o is empty"),
    (["{z}", "-o", "{root}/h.mp4", "--weights", "{root}/nowhere"], "--weights"),
    (["{z}", "-o", "{root}/h.mp4", "--tiles-per-call", "0"], "--tiles-per-call"),
])
def test_h3_decode_refuses_before_importing_torch(tmp_path, args, words):
    z, z0 = latents(tmp_path / "z.safetensors", (4, 2, 2, 2)), latents(tmp_path / "z0.safetensors", (4, 2, 0, 3))
    before = snapshot(tmp_path)
    argv = ["h3-decode", *[a.format(root=tmp_path, z=z, z0=z0) for a in args], "--preset", "tiny"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", H3_NO_TORCH, *argv], capture_output=True, text=True, timeout=120,
                          env=env)
    refused(proc.returncode, proc.stderr, words)
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------------------------------
# 13. Masks beside the clips


def test_a_clip_that_is_also_another_clips_mask_is_not_dropped_silently(tmp_path, capsys):
    clips = tmp_path / "clips"
    clips.mkdir()
    write_clip(clips, "take.mp4", mask_name="take_mask.mp4")
    write_clip(clips, "take_mask_mask.mp4", mask_name=None)  # take_mask.mp4 has a mask of its own: is it a clip?
    before = snapshot(tmp_path)
    refused(*run(["batch", clips, "--masks", clips, "-o", tmp_path / "out", "--quiet"], capsys)[::2],
            "take_mask.mp4", "take_mask_mask.mp4", "--masks")
    assert snapshot(tmp_path) == before
    (clips / "take_mask_mask.mp4").unlink()  # now take_mask.mp4 is only a mask: one clip
    code, out, err = run(["batch", clips, "--masks", clips, "-o", tmp_path / "out", "--quiet"], capsys)
    assert code == 0, err
    assert [json.loads(x)["clip"] for x in (tmp_path / "out" / "report.jsonl").read_text().splitlines()] == ["take"]


# ----------------------------------------------------------------------------------------------------------------------
# Issue 48: tiny frames, leftovers of killed --box runs


@pytest.mark.parametrize("h, w, note", [(13, 17, False), (9, 9, True)])
def test_tiny_frames_work_in_the_classic_remover(tmp_path, capsys, h, w, note):
    v, m = write_clip(tmp_path, frames=5, h=h, w=w)
    code, out, err = run(["remove", v, "--mask", m, "-o", tmp_path / "o.mp4", "--quiet"], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    assert ("below the optical flow's minimum size" in err) == note, err
    result = media.read_video(tmp_path / "o.mp4")
    assert result.frames.shape == (5, h, w, 3)


KILLED_BOX_RUN = textwrap.dedent("""
    import os, signal, sys
    from fastremover import masktools
    from fastremover.cli import main

    def killed(*args, **kwargs):  # SIGKILL while the box mask is being built: nothing can clean up
        os.kill(os.getpid(), signal.SIGKILL)

    masktools.build_mask = killed
    main(sys.argv[1:])
""")


def test_a_killed_box_run_leaves_no_scratch_folder_for_long(clip, capsys, monkeypatch):
    root, v, _ = clip
    scratch = root / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    argv = ["remove", str(v), "--box", BOX, "--allow-uncertain", "-o", str(root / "o.mp4"), "--quiet"]
    proc = subprocess.run([sys.executable, "-c", KILLED_BOX_RUN, *argv], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p.name.startswith("fastremover-boxmask-") for p in scratch.iterdir()] == [True]  # what SIGKILL left
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    code, _, err = run(argv, capsys)
    assert code == 0, err
    assert list(scratch.iterdir()) == []  # the dead run's folder is gone, and this run's own too


# ----------------------------------------------------------------------------------------------------------------------
# Also: --version, --help, install hints


def test_version_help_and_install_hints(capsys):
    from fastremover import __version__
    from fastremover.extras import install_hint

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fastremover {__version__}"
    with pytest.raises(SystemExit):
        main(["remove", "--help"])
    assert "avi" in capsys.readouterr().out
    hint = install_hint("serve")
    assert 'pip install "fastremover[serve]"' in hint and 'pip install -e ".[serve]"' in hint
