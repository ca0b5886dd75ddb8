"""The fast VAE against diffusers' AutoencoderKLWan (the reference), in one process on one CUDA GPU, random weights.

    python tools/bench_vae.py [--out PATH] [--frames 81 --height 480 --width 832] [variant options; --help]

Per run: encode (both removal inputs) and decode time (CUDA events, medians of --repeats after a warm-up), peak memory
per stage (absolute and above the stage's start), PSNR of the decoded video against the reference's (decode of the
same latents, and the round trip through each VAE's own encoder), cosine of the latents; variants of FastWanVAE's
switches as requested. `--device cpu --preset tiny` is a smoke run. (`--bench` is accepted and ignored: the
flag of this bench's first home, inside the package.)
"""

from __future__ import annotations

import sys

import torch

from fastremover.config import VAE_PRECISIONS, FastVAEOptions, option_table
from fastremover.fast.vae import FastWanVAE
from fastremover.models.vae import WanVAE

CHOICES = {row["option"]: row["choices"] for row in option_table()}


def _stage(fn, device: torch.device) -> tuple[object, float, float, float]:
    """Run fn() as one timed stage: (result, seconds by CUDA events, peak GiB, peak above the start GiB).
    On the CPU (smoke runs): wall-clock seconds, peaks 0."""
    if device.type != "cuda":
        import time

        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t, 0.0, 0.0
    torch.cuda.synchronize(device)
    start_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    out = fn()
    t1.record()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return out, t0.elapsed_time(t1) / 1e3, peak / 2**30, (peak - start_bytes) / 2**30


def _measure(name: str, encode_fn, decode_fn, z_dec, device, repeats: int) -> dict:
    """Warm-up, then `repeats` runs of encode (both inputs) + decode; medians of time, max of peaks."""
    import statistics

    runs = []
    for i in range(1 + repeats):
        (za, zb), t_enc, pk_enc, dpk_enc = _stage(encode_fn, device)
        video, t_dec, pk_dec, dpk_dec = _stage(lambda: decode_fn(z_dec), device)
        if i:
            runs.append((t_enc, t_dec, pk_enc, pk_dec, dpk_enc, dpk_dec))
        if i < repeats:
            del za, zb, video
    col = list(zip(*runs))
    r = {
        "name": name,
        "vae_encode_s": round(statistics.median(col[0]), 4),
        "vae_decode_s": round(statistics.median(col[1]), 4),
        "stage_peak_gib": {"vae_encode": round(max(col[2]), 3), "vae_decode": round(max(col[3]), 3)},
        "stage_peak_delta_gib": {"vae_encode": round(max(col[4]), 3), "vae_decode": round(max(col[5]), 3)},
    }
    r["vae_total_s"] = round(r["vae_encode_s"] + r["vae_decode_s"], 4)
    return r, (za, zb, video)


def _ratio(a: dict, b: dict) -> dict | None:
    return {k: round(a[k] / b[k], 4) for k in a if b.get(k)} or None


def _frames_arg(text: str) -> int | None | str:
    """--encode-frames / --decode-frames: "auto", "all" (whole chunks: None) or a positive int."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def bench(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import math
    import time

    p = argparse.ArgumentParser(prog="python tools/bench_vae.py",
                                description="FastWanVAE vs diffusers' AutoencoderKLWan on one GPU (random weights)")
    p.add_argument("--bench", action="store_true", help="accepted and ignored (the old form)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--vae-precision", choices=list(VAE_PRECISIONS), default="auto")
    p.add_argument("--encode-frames", type=_frames_arg, default="auto", help="'auto' (default), 'all' or N")
    p.add_argument("--decode-frames", type=_frames_arg, default="auto", help="'auto' (default), 'all' or N")
    p.add_argument("--pair", choices=["auto", "on", "off", "both"], default="both",
                   help="batch-2 encode of the two inputs: measure auto/on/off, or both on and off (default)")
    p.add_argument("--cudnn-benchmark", action="store_true", help="also measure with torch.backends.cudnn.benchmark")
    p.add_argument("--no-tap-head", action="store_true")
    p.add_argument("--stripe-mib", type=float, default=None,
                   help="also measure a variant with 1-frame convs/upsamplings in row stripes of about this size")
    p.add_argument("--no-pad-rgb", action="store_true")
    p.add_argument("--pad-encoder", action="store_true", help="pad the encoder's channels too (pad_encoder=True)")
    p.add_argument("--fp8-precise-acc", action="store_true",
                   help="with --vae-precision fp8: also measure every variant with fp8_precise_acc=True")
    p.add_argument("--fp8-max-channels", type=int, nargs="+", default=None,
                   help="with --vae-precision fp8: measure every variant with each of these fp8_max_channels values")
    p.add_argument("--fp8-encoder-max-channels", type=int, nargs="+", default=None,
                   help="with --vae-precision fp8: measure every variant with each of these fp8_encoder_max_channels")
    p.add_argument("--conv-plans", choices=["auto", "off", "both"], default="auto",
                   help="the convs on cuDNN plans with torch's bits (fast/cudnn_conv.py; auto: where they can run), "
                        "torch's convs (off), or each variant both ways")
    p.add_argument("--upsample-conv", nargs="+", choices=list(CHOICES["vae.fast.upsample_conv"]), default=None,
                   help="measure every variant with each of these upsample_conv values")
    p.add_argument("--fp8-scales", nargs="+", choices=list(CHOICES["vae.fast.fp8_scales"]), default=None,
                   help="with --vae-precision fp8: measure every variant with each of these fp8_scales values")
    p.add_argument("--pad-channels", type=int, nargs="+", default=None,
                   help="measure every variant at each of these pad_channels values (default: the VAE's default "
                        "only; 0 = no channel padding)")
    p.add_argument("--fuse-bias", action="store_true",
                   help="also measure every variant with fuse_bias=True (deferred conv biases) and check that its "
                        "latents and video are bit-identical (torch.equal) to the variant without")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run: use --preset tiny)")
    p.add_argument("--preset", default="minimax-remover", help="VAE config: minimax-remover (real) or tiny")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.fp8_precise_acc and args.vae_precision != "fp8":
        p.error("--fp8-precise-acc needs --vae-precision fp8")
    if (args.fp8_max_channels or args.fp8_encoder_max_channels or args.fp8_scales) and args.vae_precision != "fp8":
        p.error("--fp8-max-channels / --fp8-scales need --vae-precision fp8")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("the VAE bench needs a CUDA GPU (or --device cpu --preset tiny for a smoke run)", flush=True)
        return 2
    from fastremover import media
    from fastremover.bench.metrics import cosine, psnr_per_frame
    from fastremover.models.loading import PRESETS, random_init_
    from fastremover.models.vae import WanVAEConfig

    t_start = time.time()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    if device.type == "cpu":
        dtype = torch.float32  # smoke runs: CPU half-precision conv3d is impractically slow
    cfg = WanVAEConfig.from_dict(PRESETS[args.preset]["vae"])
    vae = random_init_(WanVAE(cfg), 1).eval()

    video, mask = media.synthetic_clip(args.frames, args.height, args.width, seed=0)
    x = torch.from_numpy(video.frames).to(device).permute(3, 0, 1, 2)[None].float().div_(127.5).sub_(1.0).to(dtype)
    m = torch.from_numpy(mask).to(device)[None, None].expand(1, 3, -1, -1, -1).to(dtype).contiguous()
    del video, mask
    results = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__,
               "shape": [1, 3, args.frames, args.height, args.width], "precision": str(dtype).replace("torch.", ""),
               "vae_precision": args.vae_precision, "repeats": args.repeats, "runs": []}

    # reference: diffusers, as the upstream pipeline calls it
    from diffusers import AutoencoderKLWan
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    ref = AutoencoderKLWan(**{k: v for k, v in cfg.to_dict().items() if not k.startswith("_")})
    ref.load_state_dict(vae.state_dict(), strict=True)
    ref = ref.eval().to(device, dtype)

    masked = x * (1 - m)  # the upstream pipeline forms this before its encode stage (2*mask-1 inside it)

    def ref_encode():
        with torch.no_grad():
            za = ref.encode(masked).latent_dist.mode()
            zb = ref.encode(2 * m - 1.0).latent_dist.mode()
        return za, zb

    def ref_decode(z):
        with torch.no_grad():
            return ref.decode(z).sample

    z_dec = ref_encode()[0]  # the decode input of both VAEs: the latents of the masked video (warms up encode)
    r_ref, (za_ref, zb_ref, video_ref) = _measure("reference (diffusers AutoencoderKLWan)", ref_encode, ref_decode,
                                                  z_dec, device, args.repeats)
    video_ref = video_ref.float().cpu()
    za_ref, zb_ref, z_dec = za_ref.float().cpu(), zb_ref.float().cpu(), z_dec.cpu()
    results["runs"].append(r_ref)
    ref.to("cpu")
    ref = masked = None  # (not del: the closures above name them)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    variants = []
    pairs = {"auto": ["auto"], "on": [True], "off": [False], "both": [True, False]}[args.pair]
    for pair in pairs:
        variants.append(dict(pair=pair, cudnn_benchmark=None))
    if args.cudnn_benchmark:
        variants.append(dict(pair=pairs[0], cudnn_benchmark=True))
    if args.stripe_mib:
        variants.append(dict(pair=pairs[-1], cudnn_benchmark=None, stripe_mib=args.stripe_mib))
    if args.fuse_bias:  # each variant, then its fuse_bias twin (compared with it bit for bit)
        variants = [w for v in variants for w in ({**v, "fuse_bias": False}, {**v, "fuse_bias": True})]
    if args.pad_channels:
        variants = [{**v, "pad_channels": pc} for pc in args.pad_channels for v in variants]  # fuse_bias twins adjacent
    if args.fp8_precise_acc:
        variants = [w for v in variants for w in (v, {**v, "fp8_precise_acc": True})]
    if args.fp8_max_channels:
        variants = [{**v, "fp8_max_channels": mc} for mc in args.fp8_max_channels for v in variants]
    if args.fp8_encoder_max_channels:
        variants = [{**v, "fp8_encoder_max_channels": mc} for mc in args.fp8_encoder_max_channels for v in variants]
    if args.fp8_scales:
        variants = [{**v, "fp8_scales": fs} for fs in args.fp8_scales for v in variants]
    if args.upsample_conv:
        variants = [{**v, "upsample_conv": uc} for uc in args.upsample_conv for v in variants]
    plans = {"auto": ["auto"], "off": [False], "both": [False, "auto"]}[args.conv_plans]
    variants = [{**v, "conv_plans": cp} for v in variants for cp in plans]
    z_gpu = z_dec.to(device)
    unfused = runs_unfused = None  # the last variant without fuse_bias: its outputs (CPU) and timings
    for v in variants:
        fast = FastWanVAE(vae, device=device, dtype=dtype, precision=args.vae_precision,
                          options=FastVAEOptions(encode_frames=args.encode_frames, decode_frames=args.decode_frames,
                                                 pad_rgb=not args.no_pad_rgb, tap_head=not args.no_tap_head,
                                                 pad_encoder=args.pad_encoder, **v))
        name = (f"fast ({fast.describe()}, pair={v['pair']}, cudnn.benchmark={v['cudnn_benchmark']}, "
                f"pad {fast.options.pad_channels}"
                + (f", stripes {v['stripe_mib']} MiB)" if v.get("stripe_mib") else ")"))
        r, (za, zb, vid) = _measure(name, lambda: fast.encode_removal_inputs(x, m), fast.decode, z_gpu, device,
                                    args.repeats)
        psnr = psnr_per_frame(vid.float().cpu(), video_ref)
        mse = ((vid.float().cpu() - video_ref) / 2).pow(2).mean().item()
        # round trip: this VAE's decode of its own latents of the masked video vs the reference's decode of its own
        # (the decode-only PSNR above feeds both decoders the reference latents, so it does not see encoder error)
        with torch.no_grad():
            vid_rt = fast.decode(za).float().cpu()
        mse_rt = ((vid_rt - video_ref) / 2).pow(2).mean().item()
        psnr_rt = psnr_per_frame(vid_rt, video_ref)
        vid_rt = None
        r.update({
            "roundtrip_psnr_db": round(10 * math.log10(1 / mse_rt), 3) if mse_rt > 0 else math.inf,
            "roundtrip_psnr_min_frame_db": round(float(psnr_rt.min()), 3),
            "pair_batch": fast.pair_fits(1, args.frames, args.height, args.width),
            "encode_frames": fast.frames_per_step("encode", args.height, args.width),  # None: whole chunks
            "decode_frames": fast.frames_per_step("decode", args.height, args.width),
            "frames_setting": [args.encode_frames, args.decode_frames],
            "fp8_convs": fast.weights.fp8_convs,
            "psnr_db": round(10 * math.log10(1 / mse), 3) if mse > 0 else math.inf,
            "psnr_min_frame_db": round(float(psnr.min()), 3),
            "latent_cos_masked": round(cosine(za.float().cpu(), za_ref), 7),
            "latent_cos_mask": round(cosine(zb.float().cpu(), zb_ref), 7),
            "latent_max_abs_diff": round(max((za.float().cpu() - za_ref).abs().max().item(),
                                             (zb.float().cpu() - zb_ref).abs().max().item()), 5),
            "speedup_vs_reference": round(r_ref["vae_total_s"] / r["vae_total_s"], 3),
            "peak_ratio_vs_reference": _ratio(r["stage_peak_gib"], r_ref["stage_peak_gib"]),
            "working_memory_ratio_vs_reference": _ratio(r["stage_peak_delta_gib"], r_ref["stage_peak_delta_gib"]),
            **{k: getattr(fast.options, k) for k in ("fuse_bias", "pad_channels", "pad_encoder", "fp8_precise_acc",
                                                     "fp8_max_channels", "fp8_encoder_max_channels", "fp8_scales",
                                                     "upsample_conv")},
            "conv_plans": fast.convs.plans.report() if fast.convs.plans is not None else None,
        })
        if args.fuse_bias:
            outs = tuple(t.cpu() for t in (za, zb, vid))
            if v.get("fuse_bias"):
                r["bit_exact_vs_unfused"] = all(torch.equal(a, b) for a, b in zip(outs, unfused))
                r["speedup_vs_unfused"] = round(runs_unfused["vae_total_s"] / r["vae_total_s"], 4)
            else:
                unfused, runs_unfused = outs, r
            outs = None
        results["runs"].append(r)
        fast = za = zb = vid = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["wall_s"] = round(time.time() - t_start, 1)

    print(f"{results['gpu']}, {results['shape']}, {args.precision}, repeats {args.repeats}, wall {results['wall_s']} s")
    print(f"{'run':<72}{'encode s':>9}{'decode s':>9}{'total s':>9}{'enc GiB':>9}{'dec GiB':>9}{'PSNR':>8}{'cos':>11}")
    for r in results["runs"]:
        pk = r["stage_peak_gib"]
        extra = (f"{r['psnr_db']:>8.2f}{min(r['latent_cos_masked'], r['latent_cos_mask']):>11.7f}"
                 if "psnr_db" in r else "")
        print(f"{r['name']:<72}{r['vae_encode_s']:>9.3f}{r['vae_decode_s']:>9.3f}{r['vae_total_s']:>9.3f}"
              f"{pk['vae_encode']:>9.2f}{pk['vae_decode']:>9.2f}{extra}")
        if "bit_exact_vs_unfused" in r:
            print(f"{'':<6}fuse_bias: bit-exact vs the run above: {r['bit_exact_vs_unfused']}, speedup "
                  f"{r['speedup_vs_unfused']}x")
        if "peak_ratio_vs_reference" in r:
            print(f"{'':<6}peak ratio {r['peak_ratio_vs_reference']}, working-memory ratio "
                  f"{r['working_memory_ratio_vs_reference']}, speedup {r['speedup_vs_reference']}x, batch-2 encode "
                  f"{r['pair_batch']}, min-frame PSNR {r['psnr_min_frame_db']} dB, round-trip PSNR "
                  f"{r['roundtrip_psnr_db']} dB (min frame {r['roundtrip_psnr_min_frame_db']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(bench(sys.argv[1:]))
