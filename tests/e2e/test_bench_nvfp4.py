"""`bench`'s NVFP4 fidelity rows (fastremover/bench/harness.py: nvfp4_fidelity, compare(nvfp4_rows=...)) on the tiny
preset, CPU fp32: `--weights nvfp4` end to end with its PSNR against the dense run reported in the bench JSON."""

import json
import math

from fastremover import media
from fastremover.bench.harness import BenchInputs, compare, format_table, nvfp4_fidelity, save_results
from fastremover.config import EngineConfig
from fastremover.models.loading import random_models

CPU32 = EngineConfig(device="cpu", precision="fp32")


def test_nvfp4_fidelity_rows_end_to_end():
    video, mask = media.synthetic_clip(1, 32, 32, seed=0)
    inputs = BenchInputs("tiny-nvfp4", video.frames, mask, 24.0)
    # the crop rows on a larger frame with a small object, so the crop (>= 256 px) is smaller than the frame
    cvideo, cmask = media.synthetic_clip(1, 288, 288, seed=1, object_fraction=0.003, travel=0.2)
    crop = BenchInputs("tiny-nvfp4-crop", cvideo.frames, cmask, 24.0)
    steps = 2
    fid = nvfp4_fidelity(random_models("tiny", seed=3), inputs, steps=steps, device="cpu", crop_inputs=crop,
                         vae_min_in_channels=16)  # the tiny VAE has 8..32 channels
    assert fid["baseline"] == "dense, eager, fp32" and fid["steps"] == steps
    rows = {(row["weights"], row["pass"]): row for row in fid["rows"]}
    assert set(rows) == {("dense", "full frame"), ("nvfp4", "full frame"), ("nvfp4+vae", "full frame"),
                         ("dense", "crop"), ("nvfp4-w4a4", "crop")}
    dense, w4a16, vae = rows["dense", "full frame"], rows["nvfp4", "full frame"], rows["nvfp4+vae", "full frame"]
    for row in (w4a16, vae):
        # the NVFP4 layers ran (6 block linears x steps) and changed the output by a little, not by a lot
        assert row["nvfp4_calls"] == 6 * steps and not row["identical"]
        assert 25 < row["psnr_mean_db"] < math.inf and row["psnr_min_db"] <= row["psnr_mean_db"] + 1e-9
        assert 0.99 < row["latent_cos"] < 1 and math.isfinite(row["psnr_mask_db"])
        assert row["transformer_bytes"] < dense["transformer_bytes"]
        assert row["packed"]["transformer"]["layers"] == 6
    assert dense["nvfp4_calls"] == 0 and dense["vae_nvfp4_convs"] == 0
    # the VAE convs: packed, smaller, and a further loss on top of the DiT's
    assert vae["vae_nvfp4_convs"] == vae["packed"]["vae"]["layers"] > 0 and w4a16["vae_nvfp4_convs"] == 0
    assert vae["vae_bytes"] < w4a16["vae_bytes"] == dense["vae_bytes"]
    assert vae["psnr_mean_db"] < w4a16["psnr_mean_db"]
    w4a4 = rows["nvfp4-w4a4", "crop"]
    assert w4a4["nvfp4_calls"] == 6 * steps and w4a4["packed"]["transformer"]["mode"] == "w4a4"
    (box,) = w4a4["crop_boxes"]
    y0, y1, x0, x1 = box
    assert (y1 - y0) * (x1 - x0) < 288 * 288  # a real crop
    assert 25 < w4a4["psnr_mask_db"] < math.inf
    print(json.dumps([{k: v for k, v in row.items() if k != "packed"} for row in fid["rows"]], indent=1))


def test_compare_puts_the_rows_in_the_bench_json(tmp_path):
    video, mask = media.synthetic_clip(1, 32, 32, seed=2)
    inputs = BenchInputs("tiny-nvfp4-json", video.frames, mask, 24.0)
    results = compare(random_models("tiny", seed=4), inputs, CPU32, modes=["eager"], steps=1, repeats=0,
                      count_flops=False, nvfp4_rows={"options": ("nvfp4",)})
    (r,) = results
    rows = r["nvfp4_fidelity"]["rows"]
    assert [row["weights"] for row in rows] == ["dense", "nvfp4"] and rows[1]["nvfp4_calls"] == 6
    assert 20 < rows[1]["psnr_mean_db"] < math.inf
    table = format_table(results)
    assert "NVFP4 fidelity against dense, eager, fp32" in table and "\nnvfp4 " in table
    (path,) = save_results(results, tmp_path)
    assert json.loads(path.read_text())["nvfp4_fidelity"]["rows"][1] == json.loads(json.dumps(rows[1]))
