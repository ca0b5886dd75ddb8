"""A cluster: the batch's workers as Ray actors, fed longest-first by the driver.

Each actor owns one `RemovalWorker` (one model load) and reserves one GPU (``num_gpus=1``: Ray sets its
``CUDA_VISIBLE_DEVICES``) or, on a cluster without GPUs, one CPU. The driver keeps every actor busy with one clip
at a time, taking the longest clip left whenever an actor finishes — the same shared-queue order as the local pool —
and writes the report and resume records itself. Inputs and outputs travel as paths, so they must be on a filesystem
every node sees at the same path (the plan's paths are absolute). An actor that dies costs its clip (reported
failed) and is replaced.

``ray`` is imported only here, and only when the batch runs with ``--ray`` (``pip install 'fastremover[cluster]'``).
"""

from __future__ import annotations

import collections
import traceback
from typing import Sequence

from fastremover.batch.execute import failed, run_clip, where
from fastremover.batch.local import OnDone, OnStart, _raise_init_error
from fastremover.batch.plan import ClipTask
from fastremover.config import EngineConfig, ModelSource
from fastremover.errors import FastRemoverError
from fastremover.log import setup_cli
from fastremover.worker import RemovalWorker


class ClipActor:
    """The Ray actor's class (wrapped with ``ray.remote`` at run time): one worker, one clip per call."""

    def __init__(self, source: ModelSource, config: EngineConfig):
        self.init_error: tuple[str, bool] | None = None
        self.worker = None
        setup_cli(0)  # the actor's notes on its stderr (Ray forwards it to the driver)
        try:
            self.worker = RemovalWorker(source, config)
            self.worker.pipeline  # noqa: B018 - one model load per actor, before the first clip
        except FastRemoverError as exc:
            self.init_error = (str(exc), True)
        except Exception:  # noqa: BLE001 - returned to the driver with its traceback
            self.init_error = (traceback.format_exc(), False)

    def ready(self) -> tuple[str, tuple[str, bool] | None]:
        """(where this actor runs, its model-load error or None)."""
        return where(), self.init_error

    def run(self, task: ClipTask) -> dict:
        return run_clip(self.worker, task)


def import_ray():
    try:
        import ray
    except ImportError:
        raise FastRemoverError(
            "--ray needs the ray package on every node: pip install 'fastremover[cluster]' (or pip install ray)"
        ) from None
    return ray


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to Ray unless this process already is: ``address`` None or "local" starts a local cluster, anything
    else (host:port, "auto", ray://...) joins that one. Returns whether this call connected (so it shuts down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": True}
    if address in (None, "local"):
        kwargs["address"] = "local"
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    else:
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        raise FastRemoverError(
            f"--ray {address}: cannot join the Ray cluster ({exc}); start it with `ray start --head` and pass the "
            "address it prints"
        ) from None
    return True


def actor_layout(workers: int | None, use_gpus: bool | None) -> tuple[int, dict]:
    """How many actors and what each reserves: one GPU each where the cluster has GPUs (unless ``use_gpus`` is
    False), else one CPU each; by default as many actors as the cluster has of that resource."""
    ray = import_ray()
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if use_gpus is None:
        use_gpus = gpus > 0
    if use_gpus:
        if gpus == 0:
            raise FastRemoverError("the Ray cluster has no GPUs; run without --device cuda, or add GPU nodes")
        return (workers or gpus), {"num_gpus": 1}
    cpus = int(resources.get("CPU", 0))
    return (workers or max(1, cpus)), {"num_cpus": 1}


def run_ray(tasks: Sequence[ClipTask], source: ModelSource, config: EngineConfig, on_done: OnDone,
            on_start: OnStart | None = None, *, workers: int | None = None) -> None:
    """Run ``tasks`` (sorted by the caller, longest first) on Ray actors of the connected cluster; ``on_done`` is called
    in the driver once per task. Actors are killed when this returns or raises."""
    if not tasks:
        return
    ray = import_ray()
    use_gpus = None if config.device is None else config.device.startswith("cuda")
    count, reserve = actor_layout(workers, use_gpus)
    actor_config = config
    if reserve.get("num_gpus"):
        actor_config = config.with_(device="cuda")  # Ray sets the actor's CUDA_VISIBLE_DEVICES to its GPU
    remote = ray.remote(**reserve)(ClipActor)
    pending = collections.deque(tasks)
    actors: list = []
    starting: dict = {}  # ready() ObjectRef -> actor (an actor is used as soon as it has loaded the model)
    running: dict = {}  # run() ObjectRef -> (actor, task)
    places: dict = {}  # actor -> where it runs

    def launch() -> None:
        actor = remote.remote(source, actor_config)
        actors.append(actor)
        starting[actor.ready.remote()] = actor

    def submit(actor) -> None:
        if not pending:
            return
        task = pending.popleft()
        running[actor.run.remote(task)] = (actor, task)
        if on_start:
            on_start(task, places[actor])

    try:
        for _ in range(min(count, len(tasks))):
            launch()
        while running or (pending and starting):
            ref = ray.wait([*starting, *running], num_returns=1)[0][0]
            if ref in starting:
                actor = starting.pop(ref)
                places[actor], error = ray.get(ref)
                if error is not None:
                    _raise_init_error(*error)
                submit(actor)
                continue
            actor, task = running.pop(ref)
            try:
                entry = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                entry = failed(task, f"the Ray actor died while running this clip ({type(exc).__name__})",
                               worker=places.get(actor))
                ray.kill(actor)
                launch()  # its replacement takes the next clip once it is ready
                actor = None
            except ray.exceptions.RayTaskError as exc:  # run_clip records errors itself: this is a bug in it
                entry = failed(task, f"internal error: {exc}", worker=places.get(actor))
            on_done(task, entry)
            if actor is not None:
                submit(actor)
        if pending:
            raise RuntimeError(f"no Ray actor is left to run the {len(pending)} remaining clips")
    finally:
        for actor in actors:
            ray.kill(actor)
