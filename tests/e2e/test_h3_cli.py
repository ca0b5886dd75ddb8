"""`fastremover h3-decode` on random weights at the tiny config: exit codes, one-line errors, atomic output."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastremover import media
from fastremover.h3 import cli as h3cli
from fastremover.h3.__main__ import main as h3_main
from fastremover.models import h3_decoder as h3


@pytest.fixture
def latents(tmp_path):
    path = tmp_path / "lat.safetensors"
    save_file({"latents": torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(0))}, path)
    return path


def _run(*argv):
    return h3_main([str(a) for a in argv])


def test_decode_writes_video(tmp_path, latents, capsys):
    out = tmp_path / "out.mp4"
    assert _run(latents, "-o", out, "--preset", "tiny", "--tier", "8L", "--tiles-per-call", "2") == 0
    assert out.is_file() and "wrote" in capsys.readouterr().out
    video = media.read_video(out)
    frames = h3.temporal_plan(h3.preset("tiny"), 2)[2]
    assert video.frames.shape == (frames, 16, 16, 3)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_decode_matches_the_python_api(tmp_path, latents):
    out = tmp_path / "frames/"
    assert _run(latents, "-o", f"{out}/", "--preset", "tiny", "--tier", "8L") == 0
    got = np.stack([media.read_video(p).frames[0] for p in sorted(out.glob("*.png"))])
    model = h3.random_decoder(h3.preset("tiny"), seed=0)
    from safetensors.torch import load_file

    z = load_file(latents)["latents"][None]
    px = model.to_pixels(model.decode(z, tier="8L"))[0]
    want = (px.permute(1, 2, 3, 0) * 255).round().to(torch.uint8).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("case,words", [
    ("missing", "no such file"),
    ("junk", "cannot read"),
    ("shape", "must be [C, T, h, w]"),
    ("channels", "channels"),
    ("tiles", "--tiles-per-call"),
    ("graphs", "--cuda-graphs"),
    ("same", "is the input"),
    ("two", "--key"),
    ("weights", "--weights"),
    ("big", "--max-decoded-gib"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, latents, capsys, case, words):
    out = tmp_path / "out.mp4"
    args = [latents, "-o", out, "--preset", "tiny"]
    if case == "same":
        out = tmp_path / "never.mp4"
    if case == "missing":
        args[0] = tmp_path / "nope.safetensors"
    elif case == "junk":
        args[0] = tmp_path / "junk.safetensors"
        args[0].write_bytes(b"garbage")
    elif case == "shape":
        save_file({"z": torch.zeros(4, 4)}, tmp_path / "s.safetensors")
        args[0] = tmp_path / "s.safetensors"
    elif case == "channels":
        save_file({"z": torch.zeros(5, 1, 2, 2)}, tmp_path / "c.safetensors")
        args[0] = tmp_path / "c.safetensors"
    elif case == "tiles":
        args += ["--tiles-per-call", "0"]
    elif case == "graphs":
        args += ["--cuda-graphs"]
    elif case == "same":  # a latents file that happens to end in .mp4, given as -o too
        save_file({"z": torch.zeros(4, 1, 2, 2)}, tmp_path / "in.mp4")
        args[0] = args[2] = tmp_path / "in.mp4"
    elif case == "weights":
        args += ["--weights", tmp_path / "no-such-vae"]
    elif case == "big":  # refused before any weights are made: the full preset would take minutes to build
        save_file({"z": torch.zeros(24, 20, 32, 32)}, tmp_path / "b.safetensors")  # 77 frames of 512 x 512
        args = [tmp_path / "b.safetensors", "-o", out, "--preset", "full", "--max-decoded-gib", "0.01"]
    elif case == "two":
        save_file({"a": torch.zeros(4, 1, 2, 2), "b": torch.zeros(4, 1, 2, 2)}, tmp_path / "t.safetensors")
        args[0] = tmp_path / "t.safetensors"
    assert _run(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("fastremover: error:")]) == 1
    assert words in err[-1]
    assert not out.exists()


def test_existing_output_survives_a_failed_run(tmp_path, latents):
    out = tmp_path / "out.mp4"
    out.write_bytes(b"old")
    save_file({"z": torch.zeros(5, 1, 2, 2)}, tmp_path / "c.safetensors")
    assert _run(tmp_path / "c.safetensors", "-o", out, "--preset", "tiny") == 2
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors", "lat.safetensors", "out.mp4"]


def test_parser_registration():
    import argparse

    parser = argparse.ArgumentParser()
    h3cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["h3-decode", "x.safetensors", "-o", "y.mp4", "--tier", "8L", "--tiles-per-call", "4"])
    assert args.func is h3cli.run and args.tier == "8L" and args.tiles_per_call == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["h3-decode", "x", "-o", "y.mp4", "--tier", "9L"])


def test_nvfp4_tile_batching_through_the_cli(tmp_path):
    """--blocks nvfp4: 1 x 2 tiles decoded one per call and both in one call give the same pixels."""
    lat = tmp_path / "lat.safetensors"
    save_file({"latents": torch.randn(4, 1, 4, 6, generator=torch.Generator().manual_seed(3))}, lat)
    frames = {}
    for n in (1, 2):
        out = tmp_path / f"t{n}/"
        assert _run(lat, "-o", f"{out}/", "--preset", "tiny", "--tier", "8L", "--blocks", "nvfp4",
                    "--tiles-per-call", n) == 0
        frames[n] = np.stack([media.read_video(p).frames[0] for p in sorted(out.glob("*.png"))])
    assert frames[1].shape[1:] == (16, 24, 3)
    assert np.array_equal(frames[1], frames[2])
