"""One host: one worker process per slot (a GPU, or a CPU process), fed longest-first from one shared queue.

Each slot is a spawned process started with ``CUDA_VISIBLE_DEVICES`` set to its GPU (so torch sees that one alone,
as ``cuda``); it loads the model once (`RemovalWorker`), then takes clips from the shared queue until it is empty. The
driver queues the clips longest first, so the long clips start early and the short ones fill the gaps at the end. A
worker that dies (a crash in a decoder, the kernel's OOM killer) costs the clip it was running (reported failed) and
is started again; a worker that cannot load the model stops the batch with its error. Workers also stop, between
clips, when the driver is gone.

Each worker process talks to the driver over its own pipe, and the driver hands out the clips: nothing is shared
between workers, so a worker killed at any moment (holding a queue's lock, half-way through a message) takes only
its own pipe with it and can never block the others or its replacement.

One slot runs in the driver's own process (no spawn, same results).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable, Sequence

from fastremover.batch.execute import failed, run_clip, where
from fastremover.batch.plan import ClipTask
from fastremover.config import EngineConfig, ModelSource
from fastremover.env import visible_cuda_devices
from fastremover.errors import FastRemoverError
from fastremover.log import setup_cli
from fastremover.outputs import remove_stale_temps
from fastremover.worker import RemovalWorker

OnStart = Callable[[ClipTask, str], None]  # (task, worker)
OnDone = Callable[[ClipTask, dict], None]  # (task, report entry)

POLL_S = 0.5  # how often the driver looks for workers that died


def slot_config(config: EngineConfig, gpu: str | None) -> EngineConfig:
    """The engine config a slot's worker runs: a GPU slot sees only its GPU (CUDA_VISIBLE_DEVICES), as "cuda"."""
    return config if gpu is None else config.with_(device="cuda")


class _Stopped(BaseException):
    """SIGTERM in a worker process (the driver stopping it): raised in its main thread, so the write in progress
    removes its temporary output on the way out, as the CLI's own SIGTERM does."""


def _on_sigterm(signum, frame):
    raise _Stopped()


def _worker_main(slot: int, gpu: str | None, source: ModelSource, config: EngineConfig, conn, parent: int) -> None:
    """A worker process: load the model, then run the clips the driver sends over ``conn`` until its end marker
    (None) or the driver is gone. CUDA_VISIBLE_DEVICES is already ``gpu`` (set in the environment the process was
    spawned with). Its notes go to stderr (the package logger's CLI handler). SIGTERM stops it cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the workers
    signal.signal(signal.SIGTERM, _on_sigterm)
    setup_cli(0)
    try:
        _serve(slot, gpu, source, config, conn, parent)
    except (_Stopped, EOFError, BrokenPipeError):  # stopped, or the driver's end of the pipe is closed
        pass
    finally:
        conn.close()


def _serve(slot: int, gpu: str | None, source: ModelSource, config: EngineConfig, conn, parent: int) -> None:
    try:
        worker = RemovalWorker(source, slot_config(config, gpu))
        worker.pipeline  # noqa: B018 - one model load per worker, before the first clip
    except FastRemoverError as exc:
        conn.send(("init_failed", slot, str(exc), True))
        return
    except Exception:  # noqa: BLE001 - reported to the driver with its traceback
        conn.send(("init_failed", slot, traceback.format_exc(), False))
        return
    try:
        conn.send(("ready", slot, where()))
        while True:
            task = conn.recv()
            if task is None or os.getppid() != parent:  # the driver is done, or gone
                break
            conn.send(("start", slot, task.index, where()))
            conn.send(("done", slot, task.index, run_clip(worker, task)))
    finally:
        worker.close()


@contextlib.contextmanager
def _cuda_visible(gpu: str | None):
    """CUDA_VISIBLE_DEVICES=gpu in this process's environment while a child is spawned (None: unchanged)."""
    if gpu is None:
        yield
        return
    before = visible_cuda_devices()
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _raise_init_error(message: str, user: bool) -> None:
    if user:
        raise FastRemoverError(message)
    raise RuntimeError(f"a batch worker failed to start:\n{message}")


def run_in_process(tasks: Sequence[ClipTask], source: ModelSource, config: EngineConfig, on_done: OnDone,
                   on_start: OnStart | None = None, gpu: int | None = None) -> None:
    """Run ``tasks`` in order in this process on one worker (``gpu``: an index of the visible GPUs)."""
    if gpu is not None and config.device is None:
        config = config.with_(device=f"cuda:{gpu}")
    worker = RemovalWorker(source, config)
    worker.pipeline  # noqa: B018 - load before the first clip, so a bad model stops the batch with its error
    try:
        for task in tasks:
            if on_start:
                on_start(task, where())
            on_done(task, run_clip(worker, task))
    finally:
        worker.close()


def visible_gpu_ids(indices: Sequence[int]) -> list[str]:
    """CUDA_VISIBLE_DEVICES values for indices of the GPUs this process sees (it may itself be limited to some)."""
    visible = visible_cuda_devices()
    if visible is None or not visible.strip():
        return [str(i) for i in indices]
    names = [v.strip() for v in visible.split(",") if v.strip()]
    return [names[i] for i in indices]


def run_pool(tasks: Sequence[ClipTask], source: ModelSource, config: EngineConfig, slots: Sequence[int | None],
             on_done: OnDone, on_start: OnStart | None = None) -> None:
    """Run ``tasks`` on one spawned worker process per slot (the index of a GPU this process sees, or None for a CPU
    worker); each GPU worker sees only its GPU.

    Tasks are queued in the given order (the caller sorts them longest-first); each idle worker takes the next.
    ``on_done`` is called in the driver for every task exactly once. Returns when all are done; on an exception
    (KeyboardInterrupt included) the workers are stopped before it propagates.
    """
    if not tasks:
        return
    gpus = [None if s is None else visible_gpu_ids([int(s)])[0] for s in slots]
    ctx = mp.get_context("spawn")
    by_index = {task.index: task for task in tasks}
    queued = collections.deque(tasks)  # handed out in this order, one clip per idle worker
    handed: dict[int, ClipTask | None] = {}  # slot -> the clip last handed to its process (started or not)
    parent = os.getpid()
    procs: dict[int, mp.process.BaseProcess] = {}
    conns: dict[int, Connection] = {}  # slot -> the driver's end of its current process's pipe

    def start(slot: int) -> None:
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(slot, gpus[slot], source, config, theirs, parent),
                           name=f"fastremover-batch-{slot}")
        with _cuda_visible(gpus[slot]):  # inherited from the start: nothing the child imports can see other GPUs
            proc.start()
        theirs.close()  # the child holds its end: when it exits, ours reads EOF
        procs[slot], conns[slot] = proc, ours

    def hand_out(slot: int) -> None:
        """The next clip to an idle worker, or its end marker when none are left."""
        task = queued.popleft() if queued else None
        handed[slot] = task
        try:
            conns[slot].send(task)
        except OSError:  # it died meanwhile: the check below puts the clip back
            pass

    for slot in range(len(slots)):
        start(slot)
    running: dict[int, int] = {}  # slot -> task index
    remaining = set(by_index)
    ready: set[int] = set()  # slots whose current process has loaded the model
    restarts = 0

    def handle(event) -> None:
        kind, slot = event[0], event[1]
        if kind == "init_failed":
            _raise_init_error(event[2], event[3])
        elif kind == "ready":
            ready.add(slot)
            hand_out(slot)
        elif kind == "start":
            running[slot] = event[2]
            if on_start:
                on_start(by_index[event[2]], event[3])
        elif kind == "done":
            running.pop(slot, None)
            if event[2] in remaining:
                remaining.discard(event[2])
                on_done(by_index[event[2]], event[3])
            hand_out(slot)

    def drain(slot: int) -> None:
        """Every message of ``slot``'s process that has arrived; its end of the pipe is closed once it is gone."""
        conn = conns.get(slot)
        while conn is not None and not conn.closed:
            try:
                if not conn.poll():
                    return
                event = conn.recv()
            except (EOFError, OSError):  # the process exited (maybe half-way through a message)
                conn.close()
                return
            handle(event)

    checked = time.monotonic()
    try:
        while remaining:
            live = [conn for conn in conns.values() if not conn.closed]
            for conn in wait(live, timeout=POLL_S) if live else ():
                drain(next(slot for slot, c in conns.items() if c is conn))
            if not live:
                time.sleep(POLL_S)
            if time.monotonic() - checked < POLL_S:
                continue
            checked = time.monotonic()
            for slot, proc in list(procs.items()):
                if proc.is_alive():
                    continue
                drain(slot)  # messages the worker sent before it exited come first
                conns.pop(slot).close()
                index = running.pop(slot, None)
                if index is not None and index in remaining:
                    remaining.discard(index)
                    on_done(by_index[index], failed(by_index[index], f"the worker process died (exit code "
                                                    f"{proc.exitcode}) while running this clip"))
                task = handed.pop(slot, None)
                if task is not None and task.index in remaining and task.index != index:
                    queued.appendleft(task)  # handed but never started: the next process takes it
                del procs[slot]
                if slot not in ready and proc.exitcode != 0:
                    raise RuntimeError(f"a batch worker exited (code {proc.exitcode}) before it loaded the model; "
                                       "its error is above")
                ready.discard(slot)
                if (proc.exitcode != 0 or task is not None) and queued and restarts < len(by_index):
                    restarts += 1
                    start(slot)
            if remaining and not procs:
                raise RuntimeError(f"every batch worker exited with {len(remaining)} clips left")
        for proc in procs.values():  # each got its end marker and is closing its worker
            proc.join(timeout=30)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns.values():
            conn.close()
        remove_leftovers(tasks)


def remove_leftovers(tasks: Sequence[ClipTask]) -> None:
    """The temporary outputs that stopped or killed workers left beside the clips' outputs (their processes are
    gone now; a live process's files are never touched)."""
    for task in tasks:
        output = Path(task.job.output.rstrip("/" + os.sep))
        remove_stale_temps(output.parent, output.name)
