"""Why is the engine's VAE decode stage slower inside the W1 pipeline (0.41-0.55 s, bench/results/w1-*-bb48b17.json)
than the same fast VAE alone (0.24-0.27 s, vae-w1-pad-*.json)? One process, exact mode, W1 synthetic inputs:

  pipe.decode(latents)                   the pipeline's decode stage (denormalize + decode_auto)
  vae.decode(denormalize(latents))       the fast VAE directly, same latents (its default decode_frames: "auto"
                                         since 406c55c, i.e. whole chunks at W1; 1 when this was first run)
  the same with decode_frames 1 / 2 / None   1-frame steps vs fewer, larger kernels (a CPU-bound loop gains)
  CPU time per call                      process time of the Python thread; near the wall time = CPU-bound

    python experiments/w1_decode_gap.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fastremover.config import EngineConfig, FastVAEOptions


def timed(fn, repeats=3):
    walls, cpus = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        c1 = time.process_time()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(c1 - c0)
    return {"wall_s": round(statistics.median(walls), 4), "cpu_s_until_last_launch": round(statistics.median(cpus), 4),
            "walls": [round(w, 4) for w in walls]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--mode", default="exact")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from fastremover.bench.harness import fidelity_options, synthetic_inputs
    from fastremover.fast.vae import FastWanVAE
    from fastremover.models.loading import random_models
    from fastremover.pipeline import RemovalPipeline

    models = random_models("minimax-remover", seed=0)
    inputs = synthetic_inputs(args.workload)
    pipe = RemovalPipeline(models, EngineConfig(device="cuda", precision="fp16", mode=args.mode))
    options = fidelity_options(inputs, 12, 0)
    pipe.remove(inputs.frames, inputs.mask, options)  # warm-up: compiles, graph capture
    prep = pipe.prepare(inputs.frames, inputs.mask, inputs.size)
    masked, mask = pipe.encode(prep)
    latents = pipe.denoise(masked, mask, 12, 0)
    torch.cuda.synchronize()
    vae = pipe.vae
    z = vae.denormalize(latents.to(pipe.dtype))
    res = {"gpu": torch.cuda.get_device_name(), "workload": args.workload, "mode": args.mode,
           "vae": type(vae).__name__, "latents": list(latents.shape)}
    res["pipeline_decode"] = timed(lambda: pipe.decode(latents))
    res["vae_decode_direct"] = timed(lambda: vae.decode(z))  # the pipeline's VAE with its own (default) steps
    if isinstance(vae, FastWanVAE):
        res["vae_decode_frames_setting"] = str(vae.options.decode_frames)
        for frames in (1, 2, None):
            other = FastWanVAE(models.vae, device=vae.device, dtype=vae.dtype,
                               options=FastVAEOptions(decode_frames=frames))
            other.decode(z)
            res[f"vae_decode_frames_{frames}"] = timed(lambda: other.decode(z))
            res[f"vae_decode_frames_{frames}_equal_to_default"] = bool(torch.equal(other.decode(z), vae.decode(z)))
    pipe.remove(inputs.frames, inputs.mask, options)
    res["pipeline_decode_after_another_request"] = timed(lambda: pipe.decode(latents))
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
