"""Is an H.264 write of the same frames the same file every time? (the streamed bench's `identical` flipped between
repeats at W2 on the H200 machine while the frames were equal).

    python experiments/x264_determinism.py [--frames 81] [--size 832x480] [--out FILE.json]

Writes one synthetic clip's frames repeatedly through fastremover.media: from the main thread, from a thread, through
stream.OrderedWriter (as `fastremover remove` does), each also while the GPU (if any) and CPU threads are busy, at
media.ENCODER_THREADS and at 1 thread; prints the distinct file hashes per way of writing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--size", default="832x480")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from fastremover import media
    from fastremover.stream import OrderedWriter

    w, h = (int(v) for v in args.size.split("x"))
    frames = media.synthetic_clip(args.frames, h, w, seed=0)[0].frames
    tmp = tempfile.mkdtemp()

    def digest(path):
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

    def serial(i):
        path = os.path.join(tmp, f"s{i}.mp4")
        media.write_video(path, frames, 24)
        return digest(path)

    def threaded(i):
        box = {}
        t = threading.Thread(target=lambda: box.update(d=serial(f"t{i}")))
        t.start()
        t.join()
        return box["d"]

    def ordered(i):
        path = os.path.join(tmp, f"o{i}.mp4")
        writer = OrderedWriter(lambda fr: media.write_frames(path, fr, 24))
        for f in frames:
            writer.put(f)
        writer.close()
        return digest(path)

    stop = threading.Event()

    def busy():
        if torch.cuda.is_available():
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
            while not stop.is_set():
                for _ in range(50):
                    a = (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize()
        else:
            x = np.random.rand(512, 512)
            while not stop.is_set():
                x = np.tanh(x @ x)

    res = {}
    for threads in (media.ENCODER_THREADS, 1):
        media.ENCODER_THREADS = threads
        for name, fn in (("serial", serial), ("thread", threaded), ("ordered_writer", ordered)):
            for load in (False, True):
                loaders = []
                if load:
                    stop.clear()
                    loaders = [threading.Thread(target=busy, daemon=True) for _ in range(3)]
                    for t in loaders:
                        t.start()
                hashes = [fn(f"{threads}{name}{load}{i}") for i in range(args.repeats)]
                stop.set()
                for t in loaders:
                    t.join()
                res[f"x264 threads {threads}, {name}{', under load' if load else ''}"] = hashes
    distinct = sorted({d for v in res.values() for d in v})
    out = {"frames": args.frames, "size": args.size, "cpus": os.cpu_count(), "runs": res,
           "distinct_files": len(distinct), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for k, v in res.items():
        print(f"{k:50s} {len(set(v))} distinct of {len(v)}: {sorted(set(v))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
