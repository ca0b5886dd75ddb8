"""The batch's report (``OUT_DIR/report.jsonl``), its progress bars and its closing summary.

The report has one JSON object per clip: ``clip``, ``status`` (``ok``, ``failed`` or ``skipped``: done by an earlier
run whose record matches), ``error`` (one line, or null), ``seconds`` (the clip's run: read, remove, write; for a
skipped clip, the run that made it), ``frames``, ``sha256`` (of the output), and ``output``, ``video``, ``mask``,
``worker`` (host:pid and GPU), ``notes``; failures from a bug add ``traceback``. While the batch runs, lines are
appended as clips finish (so a killed batch leaves the lines of what it finished); at the end the file is rewritten
atomically, one line per clip in plan order.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fastremover.batch.plan import BatchPlan, ClipTask
from fastremover.errors import FastRemoverError

STATUSES = ("ok", "failed", "skipped")


def report_line(task: ClipTask, entry: dict) -> dict:
    """The report's object for ``task`` from a runner's entry (see execute.run_clip) or a record's result."""
    line = {
        "clip": task.name,
        "status": entry["status"],
        "error": entry.get("error"),
        "seconds": None if entry.get("seconds") is None else round(float(entry["seconds"]), 4),
        "frames": entry.get("frames"),
        "sha256": entry.get("sha256"),
        "output": task.job.output,
        "video": task.job.video,
        "mask": task.job.mask or None,
        "worker": entry.get("worker"),
        "notes": entry.get("notes") or [],
    }
    if entry.get("traceback"):
        line["traceback"] = entry["traceback"]
    return line


class ReportWriter:
    """Appends report lines as clips finish; `finish` rewrites the whole report in plan order, atomically."""

    def __init__(self, plan: BatchPlan):
        self.plan = plan
        self.lines: dict[int, dict] = {}
        try:
            plan.out_dir.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = open(plan.report_path, "w", encoding="utf-8")
        except OSError as exc:
            raise FastRemoverError(f"cannot write {plan.report_path}: {exc.strerror or exc}; choose another -o "
                                   "folder") from None

    def add(self, task: ClipTask, entry: dict) -> dict:
        line = report_line(task, entry)
        self.lines[task.index] = line
        if self._file is not None:
            try:
                self._file.write(json.dumps(line) + "\n")
                self._file.flush()
            except OSError as exc:  # a full disk: said naming the report; the batch stops (finish tries once more)
                from fastremover.outputs import USER_ERRNOS, write_error

                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
                if exc.errno in USER_ERRNOS:
                    raise write_error(self.plan.report_path, exc) from None
                raise
        return line

    def finish(self) -> Path:
        """The whole report in plan order, written atomically (fastremover.outputs.write_text)."""
        from fastremover.outputs import write_text

        self.close()
        path = self.plan.report_path
        write_text(path, "".join(json.dumps(self.lines[index]) + "\n" for index in sorted(self.lines)))
        return path

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # the lines are written again by finish
                file.close()


@dataclass
class Summary:
    """Counts of a finished batch, and its throughput over the clips run by this batch (not the skipped ones)."""

    total: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    frames_run: int = 0  # frames of the clips this batch ran successfully
    wall_s: float = 0.0  # from the start of the runner (worker start-up included) to the last result
    failures: list[tuple[str, str]] = field(default_factory=list)  # (clip, error)
    report: str = ""

    def add(self, line: dict) -> None:
        self.counts[line["status"]] += 1
        if line["status"] == "ok":
            self.frames_run += int(line["frames"] or 0)
        elif line["status"] == "failed":
            self.failures.append((line["clip"], line["error"] or ""))

    @property
    def all_succeeded(self) -> bool:
        return self.counts["failed"] == 0 and sum(self.counts.values()) == self.total

    def table(self) -> str:
        c = self.counts
        rate = self.frames_run / self.wall_s if self.wall_s > 0 else 0.0
        rows = [
            f"{'clips':<8}{'ok':>8}{'failed':>8}{'skipped':>9}{'total':>8}",
            f"{'':<8}{c['ok']:>8}{c['failed']:>8}{c['skipped']:>9}{self.total:>8}",
            f"frames: {self.frames_run} in {self.wall_s:.1f} s = {rate:.2f} frames/s (clips run now, all workers)",
        ]
        if self.failures:
            rows.append("failed:")
            rows += [f"  {clip}: {error}" for clip, error in self.failures]
        if self.report:
            rows.append(f"report: {self.report}")
        return "\n".join(rows)


class BatchBars:
    """Two tqdm bars on stderr: clips, and frames (probed counts, advanced as clips finish), each with its ETA."""

    def __init__(self, clips: int, frames: int, enabled: bool):
        self.enabled = enabled and clips > 0
        if not self.enabled:
            return
        from tqdm import tqdm

        self.clips = tqdm(total=clips, desc="clips", unit="clip", position=0, file=sys.stderr, dynamic_ncols=True)
        self.frames = tqdm(total=frames, desc="frames", unit="frame", position=1, file=sys.stderr, dynamic_ncols=True)
        self.failed = 0

    def done(self, task: ClipTask, line: dict) -> None:
        if not self.enabled:
            return
        self.failed += line["status"] == "failed"
        self.clips.set_postfix_str(f"last {task.name}" + (f", {self.failed} failed" if self.failed else ""),
                                   refresh=False)
        self.clips.update(1)
        self.frames.update(task.frames)

    def close(self) -> None:
        if self.enabled:
            self.frames.close()
            self.clips.close()
