"""The batch driver: skips what is done, hands the rest to a runner longest-first, and records every outcome.

Whatever runs the clips (this process, a local pool of worker processes, Ray actors), the driver alone writes the
resume records and the report, so the bookkeeping is the same everywhere. A clip's record is written after its
output exists and before its report line, so a batch killed at any point leaves, for each clip, either a finished
output with a matching record (skipped next time) or something that is run again; a long clip killed after some of
its windows continues from them (`Job.resume`: the worker's resume store beside the output).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from fastremover.batch.plan import (REPORT_NAME, BatchPlan, ClipTask, finished_result, mark_written, record_key,
                                    write_record)
from fastremover.batch.report import BatchBars, ReportWriter, Summary
from fastremover.config import EngineConfig, ModelSource


@dataclass(frozen=True)
class Runner:
    """Where the clips run: ``kind`` "local" with ``slots`` (per worker process, the index of a GPU this process sees,
    or None for a CPU worker; one slot runs in this process), or "ray" with ``workers`` actors (None: one per GPU,
    or per CPU on a cluster without GPUs) on the cluster at ``address`` (None: a new local one; ignored when this
    process is already connected)."""

    kind: str = "local"
    slots: Sequence[int | None] = (None,)
    workers: int | None = None
    address: str | None = None


def dispatch_order(tasks: Sequence[ClipTask]) -> list[ClipTask]:
    """Longest first (probed frame count), then plan order: long clips start early, short ones fill in at the end."""
    return sorted(tasks, key=lambda t: (-t.frames, t.index))


def run_batch(plan: BatchPlan, source: ModelSource, config: EngineConfig | None = None, runner: Runner = Runner(), *,
              force: bool = False, progress: bool = False, on_line: Callable[[dict], None] | None = None) -> Summary:
    """Run every clip of ``plan`` that is not already done (all of them with ``force``) with the model ``source``
    and the engine ``config`` (None: the defaults with the environment's overrides) and write the report.

    A failing clip is reported and the others go on; ``on_line`` gets each report line as it is written. Raises
    FastRemoverError only for the batch as a whole (the model cannot be loaded, Ray is missing or unreachable)."""
    config = config if config is not None else EngineConfig.from_env()
    mark_written(plan, [REPORT_NAME])  # the folder is ours from now on (plan.batch_folder_rule)
    report = ReportWriter(plan)
    summary = Summary(total=len(plan.tasks), report=str(plan.report_path))
    keys: dict[int, dict] = {}  # what each clip's record will say it was made from, taken before it runs

    def add(task: ClipTask, entry: dict) -> None:
        line = report.add(task, entry)
        summary.add(line)
        if on_line:
            on_line(line)

    try:
        todo: list[ClipTask] = []
        for task in plan.tasks:
            previous = None if force or task.error else finished_result(plan, task, source, config)
            if previous is not None:
                add(task, {**previous, "status": "skipped", "error": None})
            elif task.error is not None:
                add(task, {"status": "failed", "error": task.error})
            else:
                keys[task.index] = record_key(task, source, config)
                # A clip killed mid-way continues from its last finished window (the worker's resume store; the
                # output is the same bytes); --force starts it over.
                task.job = dataclasses.replace(task.job, resume=not force)
                todo.append(task)
        order = dispatch_order(todo)
        bars = BatchBars(len(order), sum(t.frames for t in order), enabled=progress)
        start = time.perf_counter()

        def on_done(task: ClipTask, entry: dict) -> None:
            if entry["status"] == "ok":  # the record first: a batch killed after it has the clip done
                write_record(plan, task, keys[task.index], {k: entry.get(k) for k in RECORDED})
            summary.wall_s = time.perf_counter() - start
            bars.done(task, entry)
            add(task, entry)

        try:
            if order:
                # Listed before any worker can write them: a batch killed after a worker wrote an output, before the
                # driver heard of it, still finds that output ours when it is run again.
                mark_written(plan, [task.job.output for task in order])
                _run(order, source, config, runner, on_done)
        finally:
            bars.close()
    finally:
        report.finish()
    return summary


RECORDED = ("seconds", "frames", "sha256", "worker", "notes")  # a finished clip's report fields, kept in its record


def _run(order: list[ClipTask], source: ModelSource, config: EngineConfig, runner: Runner, on_done) -> None:
    if runner.kind == "ray":
        from fastremover.batch import ray_runner

        connected = ray_runner.connect(runner.address)
        try:
            ray_runner.run_ray(order, source, config, on_done, workers=runner.workers)
        finally:
            if connected:
                ray_runner.import_ray().shutdown()
    elif runner.kind != "local":
        raise ValueError(f"Runner.kind {runner.kind!r}: 'local' or 'ray'")
    elif len(runner.slots) == 1:
        from fastremover.batch.local import run_in_process

        run_in_process(order, source, config, on_done, gpu=runner.slots[0])
    else:
        from fastremover.batch.local import run_pool

        run_pool(order, source, config, runner.slots, on_done)
