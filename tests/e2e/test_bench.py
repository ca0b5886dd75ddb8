"""The side-by-side harness itself (CPU, tiny preset, fp32): fidelity numbers, JSON fields, verify on files."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastremover import media
from fastremover.bench.harness import BenchInputs, compare, dit_flops_per_step, format_table, save_results
from fastremover.bench.metrics import fidelity, psnr_per_frame, ssim_per_frame
from fastremover.cli import main
from fastremover.config import EngineConfig
from fastremover.models.loading import PRESETS, random_models
from fastremover.models.transformer import RemoverTransformerConfig

CPU32 = EngineConfig(device="cpu", precision="fp32")

REQUIRED = ["gpu", "torch", "commit", "command", "workload", "steps", "reference", "engine", "speedup_total",
            "speedup_denoise", "speedup_vae", "psnr_mean_db", "psnr_min_db", "ssim_mean", "latent_cos"]


def test_harness_eager_vs_reference(tmp_path):
    video, mask = media.synthetic_clip(9, 32, 48, seed=1)
    inputs = BenchInputs("tiny-clip", video.frames, mask, 24.0)
    results = compare(random_models("tiny", seed=3), inputs, CPU32, modes=["eager"], steps=3, repeats=1, hash_repeats=2)
    (r,) = results
    assert r["psnr_mean_db"] >= 60 and r["psnr_min_db"] >= 60 and r["psnr_mask_db"] >= 60
    assert r["ssim_mean"] > 0.9999 and r["latent_cos"] > 0.999999
    assert r["hashes_identical"] is True
    paths = save_results(results, tmp_path)
    data = json.loads(paths[0].read_text())
    for key in REQUIRED:
        assert key in data, key
    # the host beside the GPU: two leases of one GPU kind differ by it (their imports and launches are Python)
    assert data["host"]["cores"] >= 1 and data["host"]["python_loop_mops"] > 0 and data["host"]["cpu"]
    for side in ("reference", "engine"):
        assert set(data[side]) >= {"stages_s", "total_s", "peak_gib"}
        assert set(data[side]["stages_s"]) == {"preprocess", "vae_encode", "denoise", "vae_decode", "composite_write"}
    assert data["dit_tokens"] == 3 * 2 * 3  # (9-1)/4+1 latent frames x (32/16) x (48/16)
    assert "tiny-clip" in format_table(results)
    # what ran is in the console table too (a device log shows which attention / GEMM path a number came from)
    assert f"engine [{r['mode']}]: attention {r['engine_config']['attention']}" in format_table(results)
    again = save_results(results, tmp_path)  # a second run of the same workload/mode/commit keeps the first file
    assert again[0] != paths[0] and again[0].name.endswith("-run2.json") and paths[0].exists()


def test_one_hash_gives_no_determinism_verdict():
    """hash_repeats=1: the hash is recorded but hashes_identical is None, not True (one hash proves nothing), and the
    table says determinism was not checked. (The tiny setup of the test above, cut to 1 step and no extra repeats.)"""
    video, mask = media.synthetic_clip(9, 32, 48, seed=1)
    inputs = BenchInputs("tiny-clip", video.frames, mask, 24.0)
    (r,) = compare(random_models("tiny", seed=3), inputs, CPU32, modes=["eager"], steps=1, repeats=0, hash_repeats=1,
                   count_flops=False)
    assert r["hash_repeats"] == 1 and r["hashes_identical"] is None
    assert len(r["output_sha256"]) == 64
    table = format_table([r])
    assert "determinism not checked" in table and "runs identical" not in table


def test_metrics_detect_differences():
    a = torch.rand(1, 3, 4, 24, 24) * 2 - 1
    b = a.clone()
    b[:, :, 2] += 0.1  # one frame off
    mask = torch.zeros(4, 24, 24, dtype=torch.bool)
    mask[:, 4:10, 4:10] = True
    psnr = psnr_per_frame(b, a)
    assert torch.isinf(psnr[0]) and psnr[2] < 40
    f = fidelity(b, a, mask, torch.ones(5), torch.ones(5))
    # identical frames (infinite PSNR) are left out of the mean: it is the mean over frames that differ
    assert f["psnr_min_db"] < 40 and f["psnr_mean_db"] == pytest.approx(float(psnr[2])) and not f["identical"]
    assert f["psnr_mask_db"] < 40
    assert ssim_per_frame(a, a).min() > 0.9999 and ssim_per_frame(b, a)[2] < 0.999


def test_dit_flops_at_real_config():
    cfg = RemoverTransformerConfig.from_dict(PRESETS["minimax-remover"]["transformer"])
    fake = SimpleNamespace(transformer=SimpleNamespace(config=cfg))
    w2 = dit_flops_per_step(fake, 81, 480, 832)
    assert w2["tokens"] == 21 * 30 * 52
    # REFERENCE §6: W2 ~270 TFLOP per step, ~73 % of it attention.
    assert 250 < w2["total_tflop"] < 290
    assert 0.68 < w2["attention_tflop"] / w2["total_tflop"] < 0.78


def test_verify_command_on_files(tmp_path, capsys):
    video, mask = media.synthetic_clip(11, 40, 56, seed=2)  # trimmed to 9 frames, cropped to 48x32 by verify
    media.write_video(tmp_path / "v.mp4", video.frames, 24)
    media.write_video(tmp_path / "m.mp4", np.repeat(mask[..., None].astype(np.uint8) * 255, 3, -1), 24)
    code = main(["verify", str(tmp_path / "v.mp4"), "--mask", str(tmp_path / "m.mp4"), "--model", "random",
                 "--preset", "tiny", "--steps", "2", "--json", str(tmp_path / "v.json"), "--no-flops"])
    out = capsys.readouterr().out
    assert code == 0
    assert "eager" in out and "PSNR" in out
    (r,) = json.loads((tmp_path / "v.json").read_text())
    assert r["size"] == "48x32" and r["frames"] == 9 and r["psnr_mean_db"] >= 60


def test_verify_needs_model(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "v.mp4", "--mask", "m.mp4"])


@pytest.mark.parametrize("version, ok", [("0.36.0", False), ("0.37.1", False), ("0.38.0", True), ("0.42.1", True),
                                         ("1.0.0.dev0", True)])
def test_reference_refuses_a_diffusers_whose_unipc_schedule_differs(monkeypatch, version, ok):
    """diffusers 0.36 and older build UniPC's flow schedule differently: the reference would compare schedules, not
    the engine; bench / verify say so in one line instead of reporting a PSNR gap."""
    import diffusers

    from fastremover.bench import reference
    from fastremover.errors import FastRemoverError

    monkeypatch.setattr(diffusers, "__version__", version)
    if ok:
        reference._require_diffusers()
    else:
        with pytest.raises(FastRemoverError, match=r"needs diffusers >= 0\.38 \(installed: ") as err:
            reference._require_diffusers()
        assert version in str(err.value)
