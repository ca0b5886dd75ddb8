"""`fastremover batch` on one host: planning (folders, manifests, masks by name, output names), resume records, the
process pool, failures that do not stop the batch, and a killed batch that resumes. Clips are tiny (<= 13 frames of
64x48) and run with the weightless classic remover, so every output can be compared byte for byte with one `remove`."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fastremover import media
from fastremover.batch import Runner, plan_batch, run_batch
from fastremover.batch.__main__ import main as batch_main
from fastremover.batch.cli import EXIT_CLIPS_FAILED, pick_slots
from fastremover.batch.driver import dispatch_order
from fastremover.batch.plan import IMAGE_ENDINGS, RECORDS_DIR, VIDEO_ENDINGS
from fastremover.config import EngineConfig, ModelSource
from fastremover.errors import FastRemoverError
from fastremover.options import RunOptions
from fastremover.worker import Job, RemovalWorker
from helpers import CLIPS, frames_of, make_clips, synthetic


def read_report(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Planning


def test_endings_agree_with_media():
    assert VIDEO_ENDINGS == media.VIDEO_EXTENSIONS
    assert IMAGE_ENDINGS == media.IMAGE_EXTENSIONS


def test_folder_plan_masks_by_name_and_mirrored_outputs(tmp_path):
    inputs, masks, out = tmp_path / "in", tmp_path / "masks", tmp_path / "out"
    touch(inputs / "a.mov")
    touch(inputs / "b.webm")
    touch(inputs / "street" / "take1.mp4")
    touch(inputs / "frames" / "00001.png")  # a frame-folder clip
    touch(inputs / "frames" / "00002.png")
    touch(inputs / "nomask.mp4")
    touch(inputs / "two.mp4")
    touch(inputs / "notes.txt")  # not a clip
    touch(masks / "a.mp4")
    touch(masks / "b_mask.png")  # one image for every frame
    touch(masks / "street" / "take1-mask.mkv")
    touch(masks / "frames" / "00001.png")  # a frame-folder mask
    touch(masks / "two.mp4")
    touch(masks / "two_mask.mp4")

    plan = plan_batch(inputs, out, masks=masks, options=RunOptions(steps=3))
    by_name = {t.name: t for t in plan.tasks}
    assert list(by_name) == ["a", "b", "frames", "nomask", "street/take1", "two"]
    assert [t.index for t in plan.tasks] == list(range(6))
    assert by_name["a"].job.output == str(out / "a.mov")  # a writable ending is kept
    assert by_name["b"].job.output == str(out / "b.mp4")  # webm is read, not written
    assert by_name["frames"].job.output == str(out / "frames") + "/"  # frame folder -> frame folder
    assert by_name["street/take1"].job.output == str(out / "street" / "take1.mp4")
    assert by_name["a"].job.mask == str(masks / "a.mp4")
    assert by_name["b"].job.mask == str(masks / "b_mask.png")
    assert by_name["frames"].job.mask == str(masks / "frames")
    assert by_name["street/take1"].job.mask == str(masks / "street" / "take1-mask.mkv")
    assert all(t.job.options.steps == 3 for t in plan.tasks)
    assert "no mask for nomask" in by_name["nomask"].error
    assert "2 masks match two" in by_name["two"].error
    assert by_name["a"].error is None and by_name["a"].frames == 0  # unprobeable: ordered last, worker reports it


def test_masks_beside_their_clips_are_not_clips(tmp_path):
    folder = tmp_path / "clips"
    touch(folder / "x.mp4")
    touch(folder / "x_mask.mp4")
    touch(folder / "y.mp4")
    touch(folder / "y_mask.png")
    plan = plan_batch(folder, tmp_path / "out", masks=folder)
    assert [(t.name, Path(t.job.mask).name) for t in plan.tasks] == [("x", "x_mask.mp4"), ("y", "y_mask.png")]


def test_folder_plan_refusals(tmp_path):
    inputs, masks = tmp_path / "in", tmp_path / "masks"
    masks.mkdir()
    with pytest.raises(FastRemoverError, match="does not exist"):
        plan_batch(inputs, tmp_path / "out", masks=masks)
    touch(inputs / "00001.png")
    with pytest.raises(FastRemoverError, match="frames of one clip"):
        plan_batch(inputs, tmp_path / "out", masks=masks)
    (inputs / "00001.png").unlink()
    touch(inputs / "a.mp4")
    touch(inputs / "a" / "00001.png")  # a frame folder and a video with the same name
    with pytest.raises(FastRemoverError, match="same output a"):
        plan_batch(inputs, tmp_path / "out", masks=masks)
    with pytest.raises(FastRemoverError, match="--masks"):
        plan_batch(inputs, tmp_path / "out")
    with pytest.raises(FastRemoverError, match="is the input .*; write to another folder"):
        plan_batch(inputs, inputs, masks=masks)
    with pytest.raises(FastRemoverError, match="--steps"):
        plan_batch(inputs, tmp_path / "out", masks=masks, options=RunOptions(steps=0))


def test_manifest_csv_and_jsonl(tmp_path):
    touch(tmp_path / "v" / "one.mp4")
    touch(tmp_path / "v" / "two.mkv")
    touch(tmp_path / "m" / "one_mask.mp4")
    touch(tmp_path / "m" / "v" / "two.mp4")
    (tmp_path / "list.csv").write_text(
        "video,mask,output,steps,seed,size,crop,composite,mask-threshold\n"
        "v/one.mp4,m/one_mask.mp4,,4,7,,off,false,100\n"
        "v/two.mkv,,renamed/two.mp4,,,64x48,,,\n"
    )
    plan = plan_batch(tmp_path / "list.csv", tmp_path / "out", masks=tmp_path / "m", options=RunOptions(steps=2))
    one, two = plan.tasks
    assert (one.name, one.job.output, one.job.mask) == ("v/one", str(tmp_path / "out/v/one.mp4"),
                                                        str(tmp_path / "m/one_mask.mp4"))
    assert (one.job.options.steps, one.job.options.seed, one.job.options.crop, one.job.options.composite) == (
        4, 7, "off", False)
    assert one.job.mask_threshold == 100
    assert (two.name, two.job.output) == ("renamed/two", str(tmp_path / "out/renamed/two.mp4"))
    assert two.job.mask == str(tmp_path / "m/v/two.mp4")  # matched by name in --masks (mirrored path)
    assert (two.job.options.steps, two.job.options.size, two.job.mask_threshold) == (2, "64x48", 20)

    (tmp_path / "list.jsonl").write_text(
        json.dumps({"video": str(tmp_path / "v/one.mp4"), "mask": "m/one_mask.mp4", "dilate": 3}) + "\n\n"
        + json.dumps({"video": "v/two.mkv", "mask": "m/v/two.mp4", "overlap": 5, "window": 21}) + "\n"
    )
    one, two = plan_batch(tmp_path / "list.jsonl", tmp_path / "out").tasks
    assert (one.name, one.job.output, one.job.options.dilate) == ("one", str(tmp_path / "out/one.mp4"), 3)
    assert (two.name, two.job.output, two.job.options.window, two.job.options.overlap) == (
        "v/two", str(tmp_path / "out/v/two.mkv"), 21, 5)


@pytest.mark.parametrize("text, words", [
    ("video,mask,colour\na.mp4,m.mp4,red\n", "unknown column 'colour'"),
    ("video,mask,steps\na.mp4,m.mp4,many\n", "list.csv:2: steps 'many': must be a whole number"),
    ("video,mask,steps\na.mp4,m.mp4,0\n", "list.csv:2: --steps 0"),
    ("video,mask,composite\na.mp4,m.mp4,maybe\n", "composite 'maybe'"),
    ("video,mask,mask_threshold\na.mp4,m.mp4,300\n", "list.csv:2: --mask-threshold 300"),
    ("video,mask,output\na.mp4,m.mp4,../escape.mp4\n", "must be a relative path inside"),
    ("video,mask,output\na.mp4,m.mp4,x.mp4\nb.mp4,m.mp4,X.mp4\n", "same output"),
    ("mask\nm.mp4\n", "no video"),
    ("video\na.mp4\n", "no mask column and no --masks"),
    ("video,mask\n", "lists no clips"),
])
def test_manifest_refusals(tmp_path, text, words):
    (tmp_path / "list.csv").write_text(text)
    with pytest.raises(FastRemoverError, match=words.replace("(", r"\(").replace(".", r"\.")):
        plan_batch(tmp_path / "list.csv", tmp_path / "out")


def test_manifest_jsonl_refusals(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"video": "a.mp4", "mask": "m.mp4"}\n[1, 2]\n')
    with pytest.raises(FastRemoverError, match="a.jsonl:2: each line must be a JSON object"):
        plan_batch(tmp_path / "a.jsonl", tmp_path / "out")
    (tmp_path / "a.jsonl").write_text('{"video": "a.mp4", "mask": "m.mp4", "steps": "4"}\n{nope\n')
    with pytest.raises(FastRemoverError, match="a.jsonl:2: not JSON"):
        plan_batch(tmp_path / "a.jsonl", tmp_path / "out")
    (tmp_path / "a.txt").write_text("a.mp4\n")
    with pytest.raises(FastRemoverError, match="a .csv or .jsonl"):
        plan_batch(tmp_path / "a.txt", tmp_path / "out")


def test_dispatch_order_is_longest_first_then_plan_order(tmp_path):
    inputs, masks = make_clips(tmp_path, count=6)
    plan = plan_batch(inputs, tmp_path / "out", masks=masks)
    assert [t.frames for t in plan.tasks] == [frames_of(i) for i in range(6)]  # probed
    assert [t.name for t in dispatch_order(plan.tasks)] == ["clip02", "clip05", "clip01", "clip04", "clip00", "clip03"]


def test_pick_slots():
    none, two = (lambda: 0), (lambda: 2)
    assert pick_slots(None, None, None, none) == [None]
    assert pick_slots(None, 3, None, none) == [None, None, None]
    assert pick_slots(None, None, None, two) == [0, 1]  # every GPU by default
    assert pick_slots(None, 2, "cpu", two) == [None, None]
    assert pick_slots("all", 4, None, two) == [0, 1, 0, 1]
    assert pick_slots("1", None, None, two) == [0]
    assert pick_slots("1,0", None, "cuda", two) == [1, 0]
    for gpus, workers, device, count, words in [
        ("all", None, None, none, "no CUDA GPU is visible"),
        ("2", None, None, none, "--gpus 2: no CUDA GPU is visible"),
        ("3", None, None, two, "shows 2 GPUs"),
        ("0,2", None, None, two, "GPUs 0..1"),
        ("0,0", None, None, two, "list each once"),
        ("x", None, None, two, "use all, a count N"),
        ("all", None, "cpu", two, "cannot be combined with --device cpu"),
        (None, 0, None, two, "--workers 0"),
        (None, None, "cuda", none, "--device cuda: no CUDA GPU"),
    ]:
        with pytest.raises(FastRemoverError, match=words):
            pick_slots(gpus, workers, device, count)


def test_visible_gpu_ids_follow_the_parents_cuda_visible_devices(monkeypatch):
    from fastremover.batch.local import visible_gpu_ids

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_ids([0, 2]) == ["0", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,GPU-abc")
    assert visible_gpu_ids([0, 2]) == ["5", "GPU-abc"]


def test_ray_missing_is_a_user_error(tmp_path, monkeypatch, capsys):
    inputs, masks = make_clips(tmp_path, count=1)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert batch_main([str(inputs), "--masks", str(masks), "-o", str(tmp_path / "out"), "--ray", "--quiet"]) == 2
    assert 'pip install "fastremover[cluster]"' in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Running


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[Path, Path, dict[str, bytes]]:
    """12 clips and masks (read-only: tests that change them copy them), and each clip's output from one
    RemovalWorker in this process, which is what `fastremover remove` runs: for 3 of them (one of each length) the
    test checks that `fastremover remove` gives the same bytes. Returns (inputs, masks, name -> output bytes)."""
    from fastremover.cli import main as cli_main

    root = tmp_path_factory.mktemp("clips")
    inputs, masks = make_clips(root)
    worker = RemovalWorker()
    expected = {}
    for i in range(CLIPS):
        name = f"clip{i:02d}.mp4"
        worker.run(Job(video=str(inputs / name), mask=str(masks / name), output=str(root / "worker" / name)))
        expected[name] = (root / "worker" / name).read_bytes()
        if i < 3:
            assert cli_main(["remove", str(inputs / name), "--mask", str(masks / name), "-o", str(root / "cli" / name),
                             "--quiet"]) == 0
            assert (root / "cli" / name).read_bytes() == expected[name], name
    return inputs, masks, expected


def copy_clips(clips, root: Path) -> tuple[Path, Path]:
    import shutil

    inputs, masks, _ = clips
    return Path(shutil.copytree(inputs, root / "in")), Path(shutil.copytree(masks, root / "masks"))


def test_two_workers_match_single_remove(clips, tmp_path, capsys):
    inputs, masks, expected = clips
    out = tmp_path / "out"
    code = batch_main([str(inputs), "--masks", str(masks), "-o", str(out), "--workers", "2", "--quiet"])
    summary = capsys.readouterr().out
    assert code == 0, summary
    report = read_report(out)
    assert [line["clip"] for line in report] == [f"clip{i:02d}" for i in range(CLIPS)]
    workers = set()
    for i, line in enumerate(report):
        output = out / f"clip{i:02d}.mp4"
        assert output.read_bytes() == expected[output.name], output.name
        assert (line["status"], line["error"], line["frames"]) == ("ok", None, frames_of(i))
        assert line["sha256"] == sha256(output)
        workers.add(line["worker"].split(":")[1])
    assert str(os.getpid()) not in workers and 1 <= len(workers) <= 2  # ran in the worker processes
    assert f"{CLIPS:>8}{0:>8}{0:>9}{CLIPS:>8}" in summary  # 12 ok, 0 failed, 0 skipped
    assert f"frames: {sum(frames_of(i) for i in range(CLIPS))} in" in summary

    # Run again, through the `fastremover` command: everything is done, nothing runs (not even a worker), all 12
    # are reported as skipped.
    from fastremover.cli import main as cli_main

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.mp4")}
    assert cli_main(["batch", str(inputs), "--masks", str(masks), "-o", str(out), "--workers", "2", "--quiet"]) == 0
    again = read_report(out)
    assert [line["status"] for line in again] == ["skipped"] * CLIPS
    assert [line["sha256"] for line in again] == [line["sha256"] for line in report]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.mp4")} == mtimes


def test_corrupt_clip_is_reported_and_the_others_finish(clips, tmp_path, capsys):
    inputs, masks = copy_clips(clips, tmp_path)
    (inputs / "clip06.mp4").write_bytes(b"\x00not a video\x00" * 64)
    out = tmp_path / "out"
    assert batch_main([str(inputs), "--masks", str(masks), "-o", str(out), "--quiet"]) == EXIT_CLIPS_FAILED
    summary = capsys.readouterr().out
    report = read_report(out)
    assert [line["status"] for line in report] == ["ok"] * 6 + ["failed"] + ["ok"] * 5
    bad = report[6]
    assert "clip06.mp4 is not a readable video" in bad["error"] and "\n" not in bad["error"]
    assert bad["sha256"] is None and not (out / "clip06.mp4").exists()
    assert "traceback" not in bad  # a user's problem, not a bug
    assert all((out / name).read_bytes() == data for name, data in clips[2].items() if name != "clip06.mp4")
    assert f"{11:>8}{1:>8}{0:>9}{CLIPS:>8}" in summary and "clip06: " in summary

    # Fix the clip: the rerun runs only it (the other 11 are skipped) and succeeds.
    video, _ = synthetic(frames_of(6), seed=6)
    media.write_video(inputs / "clip06.mp4", video.frames, video.fps)
    assert batch_main([str(inputs), "--masks", str(masks), "-o", str(out), "--quiet"]) == 0
    assert [line["status"] for line in read_report(out)] == ["skipped"] * 6 + ["ok"] + ["skipped"] * 5


def test_changed_inputs_or_options_rerun_and_force_reruns_all(tmp_path):
    inputs, masks = make_clips(tmp_path, count=3)
    out = tmp_path / "out"
    args = [str(inputs), "--masks", str(masks), "-o", str(out), "--quiet"]
    assert batch_main(args) == 0
    first = {line["clip"]: line["sha256"] for line in read_report(out)}

    _, mask = synthetic(frames_of(1), seed=99)  # a new mask for clip01
    media.write_video(masks / "clip01.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), 24)
    (out / "clip02.mp4").write_bytes(b"replaced by someone")  # an output that is not the one recorded
    assert batch_main(args) == 0
    second = {line["clip"]: line for line in read_report(out)}
    assert [second[c]["status"] for c in ("clip00", "clip01", "clip02")] == ["skipped", "ok", "ok"]
    assert second["clip01"]["sha256"] != first["clip01"] and second["clip02"]["sha256"] == first["clip02"]

    assert batch_main(args + ["--dilate", "2"]) == 0  # another option: every clip again
    assert [line["status"] for line in read_report(out)] == ["ok"] * 3
    assert batch_main(args + ["--dilate", "2", "--force"]) == 0
    assert [line["status"] for line in read_report(out)] == ["ok"] * 3


def test_mismatched_mask_and_missing_mask_are_per_clip_failures(tmp_path):
    inputs, masks = make_clips(tmp_path, count=3)
    _, mask = synthetic(frames_of(0) + 2, seed=0)  # 7 mask frames for a 5-frame clip
    media.write_video(masks / "clip00.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), 24)
    (masks / "clip02.mp4").unlink()
    out = tmp_path / "out"
    lines = []
    summary = run_batch(plan_batch(inputs, out, masks=masks), ModelSource(), on_line=lines.append)
    assert not summary.all_succeeded and summary.counts == {"ok": 1, "failed": 2, "skipped": 0}
    status = {line["clip"]: line for line in lines}
    assert "7 frames but the video has 5" in status["clip00"]["error"]
    assert "no mask for clip02" in status["clip02"]["error"]
    assert status["clip01"]["status"] == "ok"


def test_a_bug_on_one_clip_is_recorded_with_its_traceback(clips, tmp_path):
    from types import SimpleNamespace

    from fastremover.batch.execute import run_clip

    class BrokenPipeline:  # stands in for a RemovalPipeline whose every method has a bug
        config = SimpleNamespace(notes=[], describe=dict)

        def __getattr__(self, name):
            def broken(*args, **kwargs):
                raise ValueError("boom")

            return broken

    inputs, masks, _ = clips
    task = plan_batch(inputs, tmp_path / "out", masks=masks).tasks[0]
    entry = run_clip(RemovalWorker(pipeline=BrokenPipeline()), task)
    assert (entry["status"], entry["error"]) == ("failed", "internal error: ValueError: boom")
    assert "Traceback" in entry["traceback"] and "boom" in entry["traceback"]
    assert not Path(task.job.output).exists()


def test_model_that_cannot_load_stops_the_batch(tmp_path):
    inputs, masks = make_clips(tmp_path, count=1)
    plan = plan_batch(inputs, tmp_path / "out", masks=masks)
    with pytest.raises(FastRemoverError, match="unknown preset"):
        run_batch(plan, ModelSource("random", preset="no-such-preset"), runner=Runner(slots=(None,)))
    # In the worker processes (a checkpoint folder that is not there: refused before torch is imported there).
    with pytest.raises(FastRemoverError, match="not 'classic', 'random' or an existing checkpoint folder"):
        run_batch(plan, ModelSource(str(tmp_path / "no-checkpoint")), runner=Runner(slots=(None, None)))


def test_a_worker_that_dies_costs_its_clip_and_is_replaced(clips, tmp_path):
    from fastremover.batch.local import run_pool

    inputs, masks, expected = clips
    plan = plan_batch(inputs, tmp_path / "out", masks=masks)
    tasks = dispatch_order(plan.tasks[:4])
    entries, pids = {}, []

    def kill_the_first(task, worker):  # SIGKILL the worker process as its first clip starts (an OOM kill, a segfault)
        pids.append(int(worker.split(":")[1].split()[0]))
        if len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)

    run_pool(tasks, ModelSource(), EngineConfig(), [None], lambda task, entry: entries.setdefault(task.name, entry),
             on_start=kill_the_first)
    first = tasks[0].name
    assert entries[first]["status"] == "failed" and "worker process died (exit code -9)" in entries[first]["error"]
    assert pids[0] != pids[1] == pids[-1]  # a new process ran the other clips
    for task in tasks[1:]:
        assert entries[task.name]["status"] == "ok"
        assert Path(task.job.output).read_bytes() == expected[Path(task.job.output).name]


def test_a_worker_that_dies_before_starting_its_clip_hands_it_on(clips, tmp_path):
    """A worker process that dies after the clip was handed to it and before it started it (here: unpickling the
    clip ends it) costs nothing: the clip goes to the next process, and every clip is written."""
    import dataclasses

    from helpers import DieOnce

    from fastremover.batch.local import run_pool

    inputs, masks, expected = clips
    plan = plan_batch(inputs, tmp_path / "out", masks=masks)
    tasks = dispatch_order(plan.tasks[:3])
    marker = tmp_path / "died"
    tasks[0] = dataclasses.replace(tasks[0], name=DieOnce(tasks[0].name, str(marker)))
    entries = {}
    run_pool(tasks, ModelSource(), EngineConfig(), [None], lambda task, entry: entries.setdefault(task.name, entry))
    assert marker.exists()  # the first process did die receiving it
    for task in tasks:
        assert entries[task.name]["status"] == "ok", entries[task.name]
        assert Path(task.job.output).read_bytes() == expected[Path(task.job.output).name]


def wait_until_gone(session: int, timeout_s: float = 60) -> None:
    """Wait until no process of ``session`` is left (zombies included): the parent of orphans reaps them late."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session:  # the fields after the name: state, ppid, pgrp, session
                left.append(stat.parent.name)
        if not left:
            return
        assert time.monotonic() < deadline, f"processes {left} of the killed batch are still there"
        time.sleep(0.1)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from fastremover.batch import Runner, plan_batch, run_batch
    from fastremover.config import ModelSource

    def kill_after_five(line, seen=[]):
        seen.append(line)
        if len(seen) == 5:  # the driver and both workers, as `kill -9 -PGID` would
            os.killpg(os.getpgid(0), signal.SIGKILL)

    if __name__ == "__main__":
        inputs, masks, out = sys.argv[1:]
        run_batch(plan_batch(inputs, out, masks=masks), ModelSource(), runner=Runner(slots=(None, None)),
                  on_line=kill_after_five)
""")


def test_killed_batch_resumes_with_only_the_unfinished_clips(clips, tmp_path):
    inputs, masks, expected = clips
    out = tmp_path / "out"
    script = tmp_path / "kill_batch.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(inputs), str(masks), str(out)], start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr
    wait_until_gone(session=proc.pid)  # the killed workers too (a zombie still counts as running: its temp file stays)
    records = sorted(p.stem for p in (out / RECORDS_DIR).glob("*.json"))
    assert len(records) == 5  # a record is written before its report line
    done_before = {name: (out / f"{name}.mp4").stat().st_mtime_ns for name in records}

    assert batch_main([str(inputs), "--masks", str(masks), "-o", str(out), "--quiet"]) == 0
    report = read_report(out)
    assert [line["clip"] for line in report] == [f"clip{i:02d}" for i in range(CLIPS)]
    assert sorted(line["clip"] for line in report if line["status"] == "skipped") == records
    assert sum(line["status"] == "ok" for line in report) == CLIPS - 5
    assert {name: (out / f"{name}.mp4").stat().st_mtime_ns for name in records} == done_before  # not rewritten
    for i, line in enumerate(report):
        output = Path(line["output"])
        assert output.read_bytes() == expected[output.name], output.name
        assert (line["sha256"], line["frames"]) == (sha256(output), frames_of(i))
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary file is left behind
