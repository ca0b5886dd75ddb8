"""The `fastremover` command: real files in, real files out, one-line errors for bad input."""

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np

from fastremover import media
from fastremover.cli import main
from fastremover.models.loading import random_models, save_checkpoint


def write_clip(tmp_path, frames=9, h=48, w=64, fps=30, mask_fps=24, seed=0):
    video, mask = media.synthetic_clip(frames, h, w, seed=seed)
    v, m = tmp_path / "in.mp4", tmp_path / "mask.mp4"
    media.write_video(v, video.frames, fps)
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), mask_fps)
    return v, m, video, mask


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("fastremover: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_remove_classic_keeps_fps_size_and_outside_pixels(tmp_path, capsys):
    v, m, video, mask = write_clip(tmp_path, fps=30, mask_fps=24)
    out = tmp_path / "out.mp4"
    code, stdout, err = run_cli(["remove", v, "--mask", m, "-o", out, "--dilate", "2", "--quiet"], capsys)
    assert code == 0, err
    assert "classic" in err  # says on stderr that the weightless remover was used
    result = media.read_video(out)
    assert result.fps == Fraction(30) and result.frames.shape == video.frames.shape
    src = media.read_video(v).frames
    from fastremover.masks import dilate_masks

    outside = ~dilate_masks(media.match_mask_to_video(media.read_mask(m), media.read_video(v)), 2)
    assert np.abs(result.frames[outside].astype(int) - src[outside].astype(int)).mean() < 3  # codec error only
    assert "timing:" in stdout


def test_remove_random_tiny_model(tmp_path, capsys):
    v, m, video, _ = write_clip(tmp_path, frames=6, h=40, w=56)
    out = tmp_path / "out.mp4"
    code, _, err = run_cli(
        ["remove", v, "--mask", m, "-o", out, "--model", "random", "--preset", "tiny", "--steps", "2", "--quiet"], capsys
    )
    assert code == 0, err
    assert media.read_video(out).frames.shape == video.frames.shape


def test_remove_from_checkpoint_folder(tmp_path, capsys):
    ckpt = save_checkpoint(random_models("tiny", seed=1), tmp_path / "ckpt")
    v, m, video, _ = write_clip(tmp_path, frames=5, h=32, w=32)
    out = tmp_path / "frames_out/"
    code, _, err = run_cli(["remove", v, "--mask", m, "-o", str(out) + "/", "--model", ckpt, "--steps", "1", "--quiet"], capsys)
    assert code == 0, err
    assert len(list(out.glob("*.png"))) == 5


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    v, m, _, _ = write_clip(tmp_path)
    out = tmp_path / "o.mp4"
    # missing file
    assert_one_line_error(*run_cli(["remove", tmp_path / "nope.mp4", "--mask", m, "-o", out], capsys)[::2], "nope.mp4")
    # corrupt file
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(np.random.default_rng(0).bytes(5000))
    assert_one_line_error(*run_cli(["remove", bad, "--mask", m, "-o", out], capsys)[::2], "bad.mp4")
    # mismatched frame count
    short_mask = tmp_path / "short.mp4"
    media.write_video(short_mask, np.zeros((4, 48, 64, 3), np.uint8), 24)
    assert_one_line_error(*run_cli(["remove", v, "--mask", short_mask, "-o", out], capsys)[::2], "4")
    # unwritable output: the parent is a regular file
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", blocker / "o.mp4"], capsys)[::2], "output")
    # bad size
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--size", "1920x1080"], capsys)[::2], "16")
    assert not out.exists()


def test_mismatched_resolution_mask_is_resized(tmp_path, capsys):
    video, mask = media.synthetic_clip(5, 48, 64, seed=1)
    v, m = tmp_path / "v.mp4", tmp_path / "m.mp4"
    media.write_video(v, video.frames, 25)
    big = np.repeat(np.repeat(mask, 2, axis=1), 2, axis=2)
    media.write_video(m, np.repeat(big[..., None].astype(np.uint8) * 255, 3, axis=-1), 25)
    code, _, err = run_cli(["remove", v, "--mask", m, "-o", tmp_path / "o.mp4", "--quiet"], capsys)
    assert code == 0, err


def test_zero_mask_copies_input(tmp_path, capsys):
    video, _ = media.synthetic_clip(5, 32, 32, seed=1)
    v, m = tmp_path / "v.mp4", tmp_path / "m.png"
    media.write_video(v, video.frames, 25)
    media.write_image(m, np.zeros((32, 32, 3), np.uint8))
    code, _, err = run_cli(["remove", v, "--mask", m, "-o", tmp_path / "o.mp4", "--model", "random", "--preset", "tiny"], capsys)
    assert code == 0 and "empty" in err


def test_checkpoint_problems(tmp_path, capsys):
    v, m, _, _ = write_clip(tmp_path, frames=5, h=32, w=32)
    out = tmp_path / "o.mp4"
    ckpt = save_checkpoint(random_models("tiny", seed=1), tmp_path / "ckpt")
    # missing a part
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    shutil.rmtree(broken / "vae")
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--model", broken], capsys)[::2], "vae/")
    # config with an unknown key
    shutil.rmtree(broken)
    shutil.copytree(ckpt, broken)
    cfg = json.loads((broken / "transformer" / "config.json").read_text())
    cfg["mystery"] = 1
    (broken / "transformer" / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--model", broken], capsys)[::2], "mystery")
    # config with a missing key that changes shapes -> weights do not match
    cfg.pop("mystery")
    cfg["num_layers"] += 1
    (broken / "transformer" / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--model", broken], capsys)[::2], "missing")
    # truncated weights file
    (broken / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 10)
    cfg["num_layers"] -= 1
    (broken / "transformer" / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--model", broken], capsys)[::2], "vae")
    # not a folder at all
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", out, "--model", tmp_path / "none"], capsys)[::2], "exist")


def test_info_and_demo(tmp_path, capsys):
    code, out, _ = run_cli(["info"], capsys)
    assert code == 0 and "torch" in out and "eager" in out
    code, out, err = run_cli(["demo", "-o", tmp_path / "demo", "--frames", "9", "--width", "64", "--height", "48", "--quiet"], capsys)
    assert code == 0, err
    for name in ("input.mp4", "mask.mp4", "output.mp4", "preview.mp4"):
        assert (tmp_path / "demo" / name).exists()
    assert media.read_video(tmp_path / "demo" / "preview.mp4").width == 128


def test_console_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fastremover.cli", "remove", str(tmp_path / "x.mp4"), "--mask", "y", "-o", "z.mp4"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "x.mp4" in proc.stderr


def test_mask_command_and_remove_with_a_box(tmp_path, capsys):
    """`fastremover mask` and `remove --box` through main(): the object in the synthetic clip is found from a box on
    one frame, and the removal replaces it."""
    video, truth = media.synthetic_clip(9, 96, 128, seed=4, object_fraction=0.08, travel=0.3)
    src = tmp_path / "in.mp4"
    media.write_video(src, video.frames, 24)
    ys, xs = np.nonzero(truth[0])
    x0, y0 = max(0, xs.min() - 2), max(0, ys.min() - 2)
    box = f"{x0},{y0},{min(128, xs.max() + 3) - x0},{min(96, ys.max() + 3) - y0}"
    code, out, err = run_cli(["mask", src, "--box", box, "-o", tmp_path / "mask.mp4", "--quiet"], capsys)
    assert code == 0, err
    built = media.read_mask(tmp_path / "mask.mp4")
    iou = (built & truth).sum() / (built | truth).sum()
    assert iou > 0.8, iou
    code, _, err = run_cli(["remove", src, "--box", box, "-o", tmp_path / "out.mp4", "--quiet"], capsys)
    assert code == 0, err
    result = media.read_video(tmp_path / "out.mp4").frames.astype(int)
    diff = np.abs(result - video.frames.astype(int)).mean(axis=-1)
    assert diff[truth].mean() > 10 and diff[~truth].mean() < 6  # the object changed, the rest is the input
    assert_one_line_error(*run_cli(["remove", src, "-o", tmp_path / "o2.mp4"], capsys)[::2], "--mask", "--box")
    assert_one_line_error(*run_cli(["remove", src, "--mask", tmp_path / "mask.mp4", "--box", box, "-o",
                                    tmp_path / "o3.mp4"], capsys)[::2], "not both")


def test_nvfp4_weights_end_to_end_on_the_tiny_model(tmp_path, capsys):
    """--weights nvfp4 packs the transformer's block linears to NVFP4 (W4A16): the output is close to the dense
    run's but not equal (the quantized layers ran); W4A4 is refused on full frames unless forced; the fused modes
    are refused."""
    v, m, _, _ = write_clip(tmp_path)
    base = ["--model", "random", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--quiet", "--crop", "off"]
    runs = {}
    for weights in ("dense", "nvfp4"):
        out = tmp_path / f"{weights}.mp4"
        code, stdout, err = run_cli(["remove", v, "--mask", m, "-o", out, "--weights", weights, *base], capsys)
        assert code == 0, err
        runs[weights] = media.read_video(out).frames.astype(np.float64)
    assert "NVFP4" in err or "nvfp4" in err  # the packing report is printed as a note
    mse = ((runs["dense"] - runs["nvfp4"]) ** 2).mean()
    psnr = 10 * np.log10(255**2 / max(mse, 1e-12))
    print(f"tiny model, nvfp4 vs dense: PSNR {psnr:.1f} dB")
    assert 0 < mse and psnr > 30
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", tmp_path / "w4.mp4", "--weights", "nvfp4-w4a4",
                                    *base], capsys)[::2], "full")
    code, _, err = run_cli(["remove", v, "--mask", m, "-o", tmp_path / "w4.mp4", "--weights", "nvfp4-w4a4", "--force-w4a4",
                            *base], capsys)
    assert code == 0, err
    assert_one_line_error(*run_cli(["remove", v, "--mask", m, "-o", tmp_path / "f.mp4", "--weights", "nvfp4",
                                    "--mode", "fast", *base], capsys)[::2], "eager")
