"""Where the streamed output and remove()'s output part (a GPU diagnosis for the streaming issue).

    python tools/stream_identity_check.py [--workload w1] [--modes exact,fast] [--steps 12] [--json OUT.json]
                                          [--device cuda] [--preset minimax-remover|tiny] [--files]

One random-weight pipeline per mode on the bench's synthetic clip with the bench's fidelity options. Each request
records sha256 digests of its stage outputs (the encoded latents, the denoised latents, the decoded chunks, the
emitted frames), taken by wrapping the pipeline's own methods:

    remove_sync     remove() with a synchronizing stage timer and keep_pixels (as the bench's timed runs)
    remove_async    remove() without synchronization (as the bench's hash runs)
    stream          remove_stream() into a list
    stream_writer   remove_stream() into stream.OrderedWriter (the encoder thread of `fastremover remove`)
    remove_again    remove_async once more

and prints, per mode, which stage first differs between any two of them (with the largest frame difference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from fastremover.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _digest(t) -> str:
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().cpu()
        return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.dtype.itemsize else b"").hexdigest()[:16]
    return hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()[:16]


def run_mode(models, inputs, mode: str, steps: int, workdir: str, device: str = "cuda") -> dict:
    import numpy as np

    from fastremover import media
    from fastremover.bench.harness import fidelity_options
    from fastremover.pipeline import RemovalPipeline, StageTimer
    from fastremover.stream import OrderedWriter

    pipe = RemovalPipeline(models, EngineConfig(device=device, mode=mode))  # fp16 on a GPU, fp32 on the CPU
    options = fidelity_options(inputs, steps, 42)
    log: dict[str, list] = {}
    current: list = []
    orig_encode, orig_denoise, orig_decode_iter = pipe.encode, pipe.denoise, pipe.decode_iter

    def encode(prep, progress=None):
        out = orig_encode(prep, progress)
        current.append(("encode", [_digest(t) for t in out]))
        return out

    def denoise(*a, **k):
        out = orig_denoise(*a, **k)
        current.append(("denoise", _digest(out)))
        return out

    def decode_iter(latents, progress=None):
        chunks = []
        for chunk in orig_decode_iter(latents, progress):
            chunks.append(_digest(chunk))
            yield chunk
        current.append(("decode", chunks))

    pipe.encode, pipe.denoise, pipe.decode_iter = encode, denoise, decode_iter
    frames_of: dict[str, np.ndarray] = {}

    def record(name, frames):
        log[name] = list(current) + [("frames", _digest(frames))]
        frames_of[name] = frames
        current.clear()

    pipe.remove(inputs.frames, inputs.mask, options)  # warm-up (graphs captured, kernels tuned)
    current.clear()
    r = pipe.remove(inputs.frames, inputs.mask, options, timer=StageTimer(pipe.device, sync=True), keep_pixels=True)
    record("remove_sync", r.frames)
    r = pipe.remove(inputs.frames, inputs.mask, options, timer=StageTimer(pipe.device, sync=False))
    record("remove_async", r.frames)
    got: list = []
    pipe.remove_stream(zip(inputs.frames, inputs.mask), got.append, options)
    record("stream", np.stack(got))
    path = os.path.join(workdir, f"{mode}.mp4")
    writer = OrderedWriter(lambda fr: media.write_frames(path, fr, inputs.fps))
    got = []

    def emit(frame):
        got.append(frame.copy())
        writer.put(frame)

    pipe.remove_stream(zip(inputs.frames, inputs.mask), emit, options)
    writer.close()
    record("stream_writer", np.stack(got))
    r = pipe.remove(inputs.frames, inputs.mask, options, timer=StageTimer(pipe.device, sync=False))
    record("remove_again", r.frames)

    names = list(log)
    base = log[names[0]]
    first_diff = {}
    for name in names[1:]:
        diff = None
        for (stage, a), (_, b) in zip(base, log[name]):
            if a != b:
                diff = stage
                break
        entry = {"first_differing_stage": diff}
        if diff is not None:
            x, y = frames_of[names[0]].astype(int), frames_of[name].astype(int)
            per = np.abs(x - y).reshape(len(x), -1).max(axis=1)
            entry.update(max_abs=int(per.max()), frames_differing=int((per > 0).sum()),
                         first_frame=int(np.argmax(per > 0)))
        first_diff[name] = entry
    return {"mode": mode, "digests": log, "against_remove_sync": first_diff}


def file_check(models, inputs, mode: str, steps: int, workdir: str, device: str = "cuda") -> dict:
    """The written files: sha256 of the serial write of remove()'s frames (twice), of the streamed write as the
    bench does it (emit hands the pipeline's own arrays to the writer thread), of the streamed write with a copy per
    frame, and of a serial write made while the GPU runs another request in a thread."""
    import threading

    import numpy as np

    from fastremover import media
    from fastremover.bench.harness import fidelity_options
    from fastremover.pipeline import RemovalPipeline
    from fastremover.stream import OrderedWriter

    pipe = RemovalPipeline(models, EngineConfig(device=device, mode=mode))  # fp16 on a GPU, fp32 on the CPU
    options = fidelity_options(inputs, steps, 42)
    pipe.remove(inputs.frames, inputs.mask, options)  # warm-up
    ref = pipe.remove(inputs.frames, inputs.mask, options).frames

    def sha(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]

    out = {}
    for name in ("serial_1", "serial_2"):
        path = os.path.join(workdir, f"{name}.mp4")
        media.write_video(path, ref, inputs.fps)
        out[name] = sha(path)
    for name, copy in (("streamed_views", False), ("streamed_copies", True)):
        path = os.path.join(workdir, f"{name}.mp4")
        writer = OrderedWriter(lambda fr, path=path: media.write_frames(path, fr, inputs.fps))
        emitted = []

        def emit(frame, copy=copy, writer=writer, emitted=emitted):
            emitted.append(frame.copy())
            writer.put(frame.copy() if copy else frame)

        pipe.remove_stream(zip(inputs.frames, inputs.mask), emit, options)
        writer.close()
        out[name] = sha(path)
        out[name + "_frames_equal"] = bool(np.array_equal(np.stack(emitted), ref))
        path2 = os.path.join(workdir, f"{name}_rewritten.mp4")
        media.write_video(path2, np.stack(emitted), inputs.fps)
        out[name + "_rewritten"] = sha(path2)
    busy = threading.Thread(target=lambda: pipe.remove(inputs.frames, inputs.mask, options))
    busy.start()
    path = os.path.join(workdir, "serial_busy.mp4")
    media.write_video(path, ref, inputs.fps)
    busy.join()
    out["serial_while_busy"] = sha(path)
    return {"mode": mode, **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="w1", choices=["w1", "w2", "w3"])
    p.add_argument("--modes", default="exact,fast")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="minimax-remover", help="tiny: a CPU smoke run")
    p.add_argument("--files", action="store_true", help="instead: the written files' hashes (file_check)")
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    from fastremover.bench.harness import script_environment, synthetic_inputs
    from fastremover.models.loading import random_models

    inputs = synthetic_inputs(args.workload)
    models = random_models(args.preset, 0)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for mode in [m for m in args.modes.split(",") if m]:
            if args.files:
                row = file_check(models, inputs, mode, args.steps, workdir, args.device)
                print(json.dumps(row), flush=True)
            else:
                row = run_mode(models, inputs, mode, args.steps, workdir, args.device)
                print(json.dumps({"mode": mode, **row["against_remove_sync"]}), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            env = script_environment()
            json.dump({**env, "workload": args.workload, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
