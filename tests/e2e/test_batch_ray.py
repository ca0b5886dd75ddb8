"""`fastremover batch --ray` on a local Ray cluster of 2 CPUs: the workers are Ray actors (one CPU each here, one GPU
each on a GPU cluster) and every output is byte-identical to one `remove` of that clip in this process."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
ray = pytest.importorskip("ray", reason="Ray is not installed (the dev extra installs it; the cluster extra for users)")

from fastremover.batch.__main__ import main as batch_main
from fastremover.batch.cli import EXIT_CLIPS_FAILED
from fastremover.worker import Job, RemovalWorker
from helpers import CLIPS, frames_of, make_clips


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_actors_match_single_remove(local_ray, tmp_path, capsys):
    inputs, masks = make_clips(tmp_path)
    (inputs / "clip06.mp4").write_bytes(b"\x00not a video\x00" * 64)  # a corrupt clip in the middle
    out = tmp_path / "out"
    code = batch_main([str(inputs), "--masks", str(masks), "-o", str(out), "--ray", "--quiet"])
    summary = capsys.readouterr().out
    assert code == EXIT_CLIPS_FAILED, summary

    report = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    assert [line["clip"] for line in report] == [f"clip{i:02d}" for i in range(CLIPS)]
    assert [line["status"] for line in report] == ["ok"] * 6 + ["failed"] + ["ok"] * 5
    assert "clip06.mp4 is not a readable video" in report[6]["error"]
    worker = RemovalWorker()
    places = set()
    for i, line in enumerate(report):
        if i == 6:
            continue
        output = out / f"clip{i:02d}.mp4"
        reference = tmp_path / "single" / output.name
        worker.run(Job(video=str(inputs / output.name), mask=str(masks / output.name), output=str(reference)))
        assert output.read_bytes() == reference.read_bytes(), output.name
        assert (line["frames"], line["sha256"]) == (frames_of(i), hashlib.sha256(reference.read_bytes()).hexdigest())
        places.add(line["worker"].split(":")[1])
    assert str(os.getpid()) not in places and 1 <= len(places) <= 2  # ran in the (2) actors' processes
    assert f"{11:>8}{1:>8}{0:>9}{CLIPS:>8}" in summary

