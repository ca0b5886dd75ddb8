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
    p.add_argument("--x264-params", nargs="*", default=None,
                   help="with --isolate: also encode the one conversion with each of these x264-params strings "
                        "(e.g. asm=AVX2; '' for none) instead of media's own, --repeats times each")
    p.add_argument("--isolate", action="store_true",
                   help="instead: convert the frames to YUV several times (hashes of the visible and padded plane "
                        "bytes), then encode ONE set of converted frames several times at ENCODER_THREADS and 1 "
                        "thread: tells a conversion difference from an encoder one")
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

    if args.isolate:
        return isolate(args, frames, tmp, digest)

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


def isolate(args, frames, tmp, digest) -> int:
    import av
    import numpy as np

    from fastremover import media

    def plane_hashes(yuv_frames):
        visible, padded = hashlib.sha256(), hashlib.sha256()
        for f in yuv_frames:
            for plane in f.planes:
                rows = np.asarray(memoryview(plane)).reshape(plane.height, plane.line_size)
                visible.update(np.ascontiguousarray(rows[:, : plane.width]).tobytes())
                padded.update(rows.tobytes())
        return visible.hexdigest()[:16], padded.hexdigest()[:16]

    conversions = []
    kept = None
    for r in range(args.repeats):
        yuv = [media._to_yuv(f, "yuv420p") for f in frames]
        conversions.append(plane_hashes(yuv))
        kept = kept or yuv
    line_sizes = [[p.line_size, p.width] for p in kept[0].planes]
    original = media._yuv_frames
    media._yuv_frames = lambda _frames, _fmt: (f for f, _ in zip(kept, _frames))  # the rgb frames still drive it
    encodes, first_diff, params = {}, {}, {}
    threads_default, x264_default = media.ENCODER_THREADS, media._X264_PARAMS
    try:
        for threads in (media.ENCODER_THREADS, 1):
            media.ENCODER_THREADS = threads
            paths = []
            for i in range(args.repeats):
                path = os.path.join(tmp, f"iso{threads}-{i}.mp4")
                media.write_video(path, frames, 24)
                paths.append(path)
            encodes[threads] = [digest(q) for q in paths]
            base = media.read_video(paths[0]).frames
            first_diff[threads] = []
            for q in paths[1:]:
                other = media.read_video(q).frames
                diff = [j for j in range(len(base)) if not np.array_equal(base[j], other[j])]
                first_diff[threads].append(diff[:1] + [len(diff)] if diff else None)
        media.ENCODER_THREADS = threads_default
        for text in args.x264_params or []:  # media's writer with these x264-params instead of its own
            media._X264_PARAMS = {"x264-params": text} if text else {}
            hashes = []
            for i in range(args.repeats):
                path = os.path.join(tmp, f"par{len(params)}-{i}.mp4")
                media.write_video(path, frames, 24)
                hashes.append(digest(path))
            params[text] = hashes
    finally:
        media._yuv_frames, media._X264_PARAMS, media.ENCODER_THREADS = original, x264_default, threads_default
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    out = {"frames": args.frames, "size": args.size, "cpus": os.cpu_count(), "cpu": cpu,
           "avx512": sorted(f for f in flags if f.startswith("avx512")), "av": av.__version__,
           "libraries": {k: list(v) for k, v in av.library_versions.items()},
           "plane_line_size_width": line_sizes,
           "conversions_visible_padded": conversions,
           "conversions_distinct_visible": len({c[0] for c in conversions}),
           "encodes_of_one_conversion": {str(k): v for k, v in encodes.items()},
           "decoded_first_differing_frame_and_count_vs_first": {str(k): v for k, v in first_diff.items()},
           "encodes_with_x264_params": params}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
