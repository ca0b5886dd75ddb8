"""Issue acceptance at full size on the CPU: 854x480, 152 frames (3 windows), 30 fps video with a 24 fps mask, through
the CLI. The tiny model runs at --size 224x128 (resized back to 854x480) so that the test stays within about a minute
on 2 cores; the full-resolution tiny-model path is covered at small sizes elsewhere."""

from fractions import Fraction

import numpy as np
import pytest

from fastremover import media
from fastremover.cli import main
from fastremover.masks import dilate_masks


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("acceptance")
    video, mask = media.synthetic_clip(152, 480, 854, seed=11, fps=30)
    media.write_video(d / "in.mp4", video.frames, 30)
    media.write_video(d / "mask.mp4", np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("model_args", [["--model", "classic"],
                                        ["--model", "random", "--preset", "tiny", "--size", "224x128"]],
                         ids=["classic", "tiny"])
def test_remove_854x480_152_frames(clip, model_args, capsys):
    out = clip / f"out-{model_args[1]}.mp4"
    code = main(["remove", str(clip / "in.mp4"), "--mask", str(clip / "mask.mp4"), "-o", str(out), "--quiet", *model_args])
    assert code == 0, capsys.readouterr().err
    result = media.read_video(out)
    assert (result.width, result.height, result.num_frames, result.fps) == (854, 480, 152, Fraction(30))
    source = media.read_video(clip / "in.mp4")
    mask = media.match_mask_to_video(media.read_mask(clip / "mask.mp4"), source)
    assert media.read_video(clip / "mask.mp4").fps == Fraction(24)
    outside = ~dilate_masks(mask, 6)
    diff = np.abs(result.frames.astype(np.int16) - source.frames.astype(np.int16))
    assert diff[outside].mean() < 2.0  # re-encoding error only
    assert diff[~outside].mean() > 2.0  # and the masked object really was replaced
