"""fastremover.media: reading, writing, mask alignment, atomic output, synthetic clips."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from fastremover import media
from fastremover.errors import FastRemoverError
from fastremover.media import Video


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip() -> tuple[Video, np.ndarray]:
    return media.synthetic_clip(num_frames=24, height=96, width=160, seed=3)


def _write_png(path: Path, rgb: np.ndarray) -> None:
    assert cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))


def _make_av_file(
    path: Path,
    *,
    num_frames: int = 24,
    fps: int | Fraction = 24,
    size: tuple[int, int] = (48, 64),
    audio: str | None = None,
    audio_seconds: float = 2.5,
    frames: np.ndarray | None = None,
) -> None:
    """Write a small test file with PyAV: H.264 video and optionally an 'aac' or 'pcm_s16le' sine track."""
    h, w = size
    out = av.open(str(path), "w")
    vs = out.add_stream("libx264", rate=fps)
    vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
    astream = None
    if audio is not None:
        astream = out.add_stream(audio, rate=44100)
        astream.layout = "stereo"
    for i in range(num_frames):
        img = frames[i] if frames is not None else np.full((h, w, 3), (i * 9) % 256, np.uint8)
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))
    if astream is not None:
        t = np.arange(int(44100 * audio_seconds)) / 44100
        tone = 0.3 * np.sin(2 * np.pi * 440 * t)
        step = 1024
        for k in range(0, len(tone), step):
            chunk = np.stack([tone[k : k + step]] * 2)
            if audio == "aac":
                af = av.AudioFrame.from_ndarray(chunk.astype(np.float32), format="fltp", layout="stereo")
            else:
                interleaved = (chunk.T.reshape(1, -1) * 32767).astype(np.int16)
                af = av.AudioFrame.from_ndarray(interleaved, format="s16", layout="stereo")
            af.sample_rate = 44100
            af.pts = k
            out.mux(astream.encode(af))
        out.mux(astream.encode(None))
    out.close()


def _audio_info(path: Path) -> tuple[str, float]:
    """(codec name, decoded duration in seconds) of the first audio stream."""
    with av.open(str(path)) as c:
        stream = c.streams.audio[0]
        rate = stream.codec_context.sample_rate
        samples = sum(f.samples for f in c.decode(stream))
        return stream.codec_context.name, samples / rate


# ----------------------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [Fraction(30), Fraction(30000, 1001), Fraction(24)])
def test_mp4_round_trip_keeps_fps_count_size(tmp_path, clip, fps):
    video, _ = clip
    out = tmp_path / "out.mp4"
    media.write_video(out, video.frames, fps)
    back = media.read_video(out)
    assert back.fps == fps and isinstance(back.fps, Fraction)
    assert back.frames.shape == video.frames.shape and back.frames.dtype == np.uint8
    assert back.source == str(out) and back.has_audio is False
    error = np.abs(back.frames.astype(np.int16) - video.frames).mean()
    assert error < 3.0, error
    info = media.probe(out)
    assert (info["kind"], info["num_frames"], info["fps"]) == ("video", video.num_frames, fps)
    assert (info["height"], info["width"], info["has_audio"]) == (video.height, video.width, False)


def test_float_fps_and_mov_mkv_containers(tmp_path, clip):
    video, _ = clip
    for name in ("a.mov", "a.mkv"):
        media.write_video(tmp_path / name, video.frames[:5], 25.0)
        back = media.read_video(tmp_path / name)
        assert back.fps == 25 and back.num_frames == 5
    # Matroska keeps millisecond timestamps; NTSC rates must still come back exact.
    for fps in (Fraction(60000, 1001), Fraction(120000, 1001)):
        media.write_video(tmp_path / "n.mkv", video.frames[:5], fps)
        assert media.read_video(tmp_path / "n.mkv").fps == fps


def test_colours_survive_round_trip(tmp_path):
    # Flat saturated colours: checks the BT.709 tagging is read back with the same matrix (no hue shift).
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [200, 150, 30]], np.uint8)
    frames = np.repeat(colours[:, None, None, :], 32, axis=1).repeat(32, axis=2)
    media.write_video(tmp_path / "c.mp4", frames, 24)
    back = media.read_video(tmp_path / "c.mp4").frames
    assert np.abs(back[:, 8:24, 8:24].astype(int) - frames[:, 8:24, 8:24]).max() <= 4


def test_max_frames(tmp_path, clip):
    video, _ = clip
    media.write_video(tmp_path / "o.mp4", video.frames, 24)
    assert media.read_video(tmp_path / "o.mp4", max_frames=5).num_frames == 5
    assert media.read_mask(tmp_path / "o.mp4", max_frames=7).shape == (7, video.height, video.width)


def test_odd_size_is_kept_exactly_with_a_warning(tmp_path, clip):
    video, _ = clip
    frames = np.ascontiguousarray(video.frames[:4, :95, :157])
    with pytest.warns(UserWarning, match="odd"):
        media.write_video(tmp_path / "odd.mp4", frames, 24)
    back = media.read_video(tmp_path / "odd.mp4")
    assert back.frames.shape == frames.shape
    assert np.abs(back.frames.astype(np.int16) - frames).mean() < 3.0


def test_rotated_video_is_read_upright(tmp_path):
    # Phones store portrait video as landscape + a display rotation; players (and we) show it upright.
    img = np.zeros((48, 64, 3), np.uint8)
    img[:8, :8] = 255  # marker in the top-left corner of the stored frame
    out = av.open(str(tmp_path / "rot.mp4"), "w")
    vs = out.add_stream("libx264", rate=24)
    vs.width, vs.height, vs.pix_fmt = 64, 48, "yuv420p"
    vs.set_display_rotation(-90)  # i.e. rotate 90 degrees clockwise for display
    for i in range(3):
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))
    out.close()
    back = media.read_video(tmp_path / "rot.mp4")
    assert back.frames.shape == (3, 64, 48, 3)
    assert back.frames[0, :8, -8:].mean() > 200  # clockwise turn moves top-left to top-right
    info = media.probe(tmp_path / "rot.mp4")
    assert (info["height"], info["width"]) == (64, 48)


# ----------------------------------------------------------------------------------------------------------
# audio
# ----------------------------------------------------------------------------------------------------------


def test_audio_is_copied_without_reencoding_and_cut_to_video(tmp_path, clip):
    video, _ = clip
    src = tmp_path / "src.mp4"
    _make_av_file(src, num_frames=48, fps=24, audio="aac", audio_seconds=2.5)
    assert media.read_video(src).has_audio and media.probe(src)["has_audio"]
    out = tmp_path / "out.mp4"
    media.write_video(out, video.frames, 24, audio_from=src)  # 24 frames = 1.0 s
    codec, seconds = _audio_info(out)
    assert codec == "aac"
    assert 0.95 <= seconds <= 1.1, seconds  # cut to the video, within one AAC packet (~23 ms) + priming
    # Copied, not re-encoded: the audio packets are byte-identical to the source's.
    with av.open(str(src)) as a, av.open(str(out)) as b:
        src_packets = [bytes(p) for p in a.demux(a.streams.audio[0]) if p.size][:10]
        out_packets = [bytes(p) for p in b.demux(b.streams.audio[0]) if p.size][:10]
    assert src_packets == out_packets
    assert media.read_video(out).num_frames == video.num_frames


def test_audio_that_mp4_cannot_hold_is_transcoded_to_aac(tmp_path, clip):
    video, _ = clip
    src = tmp_path / "pcm.mkv"
    _make_av_file(src, num_frames=48, fps=24, audio="pcm_s16le", audio_seconds=2.0)
    media.write_video(tmp_path / "out.mp4", video.frames, 24, audio_from=src)
    codec, seconds = _audio_info(tmp_path / "out.mp4")
    assert codec == "aac" and 0.95 <= seconds <= 1.1, (codec, seconds)
    # Matroska takes PCM as is.
    media.write_video(tmp_path / "out.mkv", video.frames, 24, audio_from=src)
    codec, seconds = _audio_info(tmp_path / "out.mkv")
    assert codec == "pcm_s16le" and 0.95 <= seconds <= 1.1, (codec, seconds)


def test_audio_from_file_without_audio_writes_video_only(tmp_path, clip):
    video, _ = clip
    src = tmp_path / "silent.mp4"
    _make_av_file(src, num_frames=4)
    media.write_video(tmp_path / "out.mp4", video.frames[:4], 24, audio_from=src)
    assert not media.probe(tmp_path / "out.mp4")["has_audio"]


# ----------------------------------------------------------------------------------------------------------
# other inputs
# ----------------------------------------------------------------------------------------------------------


def test_read_gif(tmp_path):
    out = av.open(str(tmp_path / "a.gif"), "w")
    vs = out.add_stream("gif", rate=10)
    vs.width, vs.height, vs.pix_fmt = 40, 30, "rgb8"
    for i in range(5):
        img = np.zeros((30, 40, 3), np.uint8)
        img[:, i * 8 : i * 8 + 8] = 255
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))
    out.close()
    video = media.read_video(tmp_path / "a.gif")
    assert video.frames.shape == (5, 30, 40, 3)
    assert video.fps == 10
    for i in range(5):  # the white bar moved as drawn
        assert video.frames[i, :, i * 8 + 2 : i * 8 + 6].mean() > 200


def test_read_png_folder_natural_order(tmp_path):
    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(1, 13):  # unpadded: lexical order would put 10, 11, 12 before 2
        _write_png(folder / f"{i}.png", np.full((20, 30, 3), i * 10, np.uint8))
    (folder / ".DS_Store").write_bytes(b"junk")
    (folder / "notes.txt").write_text("not a frame")
    video = media.read_video(folder)
    assert video.frames.shape == (12, 20, 30, 3)
    assert list(video.frames[:, 0, 0, 0]) == [i * 10 for i in range(1, 13)]
    assert video.fps == 24 and video.source is None and not video.has_audio
    assert media.read_video(folder, default_fps=Fraction(30000, 1001)).fps == Fraction(30000, 1001)
    assert media.probe(folder)["num_frames"] == 12


def test_read_single_png_is_one_frame(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (21, 33, 3), dtype=np.uint8)
    _write_png(tmp_path / "one.png", img)
    video = media.read_video(tmp_path / "one.png")
    assert video.frames.shape == (1, 21, 33, 3) and video.fps == 24
    np.testing.assert_array_equal(video.frames[0], img)  # PNG is lossless and RGB order is kept


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing.mp4", "does not exist"),
        (
            lambda p: (p / "bad.mp4").write_bytes(np.random.default_rng(1).bytes(4096)) and p / "bad.mp4",
            "not a readable video|could not be decoded",
        ),
        (lambda p: (p / "empty.mp4").write_bytes(b"") or p / "empty.mp4", "not a readable video|no frames"),
        (lambda p: (p / "bad.png").write_bytes(b"\x89PNG garbage") and p / "bad.png", "not a readable image"),
        (lambda p: (p / "x.txt").write_text("hello") and p / "x.txt", "not a supported"),
        (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "no image frames"),
    ],
    ids=["missing", "corrupt-mp4", "empty-file", "corrupt-png", "unknown-type", "empty-folder"],
)
def test_bad_inputs_raise_user_errors(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(FastRemoverError, match=match):
        media.read_video(path)
    with pytest.raises(FastRemoverError):
        media.read_mask(path)


def test_zero_frame_video_is_an_error(tmp_path):
    out = av.open(str(tmp_path / "zero.mp4"), "w")
    vs = out.add_stream("libx264", rate=24)
    vs.width, vs.height, vs.pix_fmt = 32, 32, "yuv420p"
    out.close()
    with pytest.raises(FastRemoverError):
        media.read_video(tmp_path / "zero.mp4")


def test_folder_with_mixed_sizes_is_an_error(tmp_path):
    _write_png(tmp_path / "1.png", np.zeros((10, 10, 3), np.uint8))
    _write_png(tmp_path / "2.png", np.zeros((12, 10, 3), np.uint8))
    with pytest.raises(FastRemoverError, match="differ in size"):
        media.read_video(tmp_path)


def test_error_messages_are_one_line(tmp_path):
    with pytest.raises(FastRemoverError) as info:
        media.read_video(tmp_path / "nope.mp4")
    assert "\n" not in str(info.value) and ";" in str(info.value)  # problem; what to do


# ----------------------------------------------------------------------------------------------------------
# masks: reading and matching
# ----------------------------------------------------------------------------------------------------------


def test_read_mask_first_channel_threshold(tmp_path):
    img = np.zeros((10, 12, 3), np.uint8)
    img[2:5, 3:6, 0] = 255  # red -> masked
    img[6:8, 6:9, 1] = 255  # green only -> not masked (first channel is 0)
    img[0, 0, 0] = 20  # at the threshold -> not masked ("> 20")
    img[0, 1, 0] = 21
    _write_png(tmp_path / "m.png", img)
    mask = media.read_mask(tmp_path / "m.png")
    assert mask.dtype == bool and mask.shape == (1, 10, 12)
    expected = np.zeros((10, 12), bool)
    expected[2:5, 3:6] = True
    expected[0, 1] = True
    np.testing.assert_array_equal(mask[0], expected)
    assert media.read_mask(tmp_path / "m.png", threshold=0)[0, 0, 0]


def test_read_mask_grey_and_rgba_pngs(tmp_path):
    grey = np.zeros((8, 8), np.uint8)
    grey[:4] = 200
    assert cv2.imwrite(str(tmp_path / "g.png"), grey)
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:, :4, 2] = 255  # red in OpenCV's BGRA order
    rgba[..., 3] = 255
    assert cv2.imwrite(str(tmp_path / "a.png"), rgba)
    grey_mask = media.read_mask(tmp_path / "g.png")[0]
    assert grey_mask[:4].all() and not grey_mask[4:].any()
    rgba_mask = media.read_mask(tmp_path / "a.png")[0]
    assert rgba_mask[:, :4].all() and not rgba_mask[:, 4:].any()


def test_mask_video_round_trip(tmp_path, clip):
    video, mask = clip
    frames = np.repeat(mask[..., None], 3, axis=-1).astype(np.uint8) * 255
    media.write_video(tmp_path / "mask.mp4", frames, 24)
    back = media.read_mask(tmp_path / "mask.mp4")
    assert back.shape == mask.shape
    assert (back != mask).mean() < 0.005  # lossy codec: only a few edge pixels may flip


def test_match_mask_resizes_nearest(clip):
    video, _ = clip
    small = np.zeros((video.num_frames, video.height // 2, video.width // 2), bool)
    small[:, 10:20, 30:40] = True
    matched = media.match_mask_to_video(small, video)
    assert matched.shape == (video.num_frames, video.height, video.width) and matched.dtype == bool
    expected = cv2.resize(small[0].astype(np.uint8), (video.width, video.height), interpolation=cv2.INTER_NEAREST) > 0
    np.testing.assert_array_equal(matched[3], expected)
    assert matched[0].sum() == 4 * small[0].sum()  # exact 2x: every pixel becomes a 2x2 block


def test_match_mask_count_mismatch_names_both_counts(clip):
    video, mask = clip
    with pytest.raises(FastRemoverError, match=rf"{video.num_frames - 3}.*{video.num_frames}"):
        media.match_mask_to_video(mask[:-3], video)


def test_match_single_frame_mask_broadcasts(clip):
    video, mask = clip
    matched = media.match_mask_to_video(mask[:1], video)
    assert matched.shape == mask.shape and (matched == mask[0]).all()
    assert media.match_mask_to_video(mask[0], video).shape == mask.shape


def test_mask_at_other_fps_with_same_count_is_fine(tmp_path, clip):
    video, mask = clip
    frames = np.repeat(mask[..., None], 3, axis=-1).astype(np.uint8) * 255
    media.write_video(tmp_path / "v.mp4", video.frames, 30)
    media.write_video(tmp_path / "m.mp4", frames, 24)
    v = media.read_video(tmp_path / "v.mp4")
    m = media.read_mask(tmp_path / "m.mp4")
    assert v.fps == 30
    assert media.match_mask_to_video(m, v).shape == (v.num_frames, v.height, v.width)


# ----------------------------------------------------------------------------------------------------------
# writing: targets, errors, atomicity
# ----------------------------------------------------------------------------------------------------------


def test_write_png_folder_and_single_image(tmp_path, clip):
    video, _ = clip
    folder = tmp_path / "out"
    media.write_video(str(folder) + "/", video.frames[:12], 24)
    back = media.read_video(folder)
    np.testing.assert_array_equal(back.frames, video.frames[:12])  # PNG: lossless
    media.write_video(folder, video.frames[:3], 24)  # existing folder: rewritten, stale frames removed
    assert media.read_video(folder).num_frames == 3
    media.write_video(tmp_path / "one.png", video.frames[:1], 24)
    np.testing.assert_array_equal(media.read_video(tmp_path / "one.png").frames, video.frames[:1])
    with pytest.raises(FastRemoverError, match="24 frames"):
        media.write_video(tmp_path / "many.png", video.frames, 24)
    with pytest.raises(FastRemoverError, match="unsupported ending"):
        media.write_video(tmp_path / "out.xyz", video.frames, 24)


def test_write_creates_missing_parent_folders(tmp_path, clip):
    video, _ = clip
    media.write_video(tmp_path / "a" / "b" / "out.mp4", video.frames[:2], 24)
    assert media.read_video(tmp_path / "a" / "b" / "out.mp4").num_frames == 2


def test_unwritable_output_is_a_user_error(tmp_path, clip):
    video, _ = clip
    blocker = tmp_path / "file"
    blocker.write_text("I am a file")  # works as root too: nobody can create a folder inside a file
    with pytest.raises(FastRemoverError, match="cannot write"):
        media.write_video(blocker / "out.mp4", video.frames[:2], 24)
    with pytest.raises(FastRemoverError, match="cannot write"):
        media.write_video(blocker / "sub" / "out.mp4", video.frames[:2], 24)
    with pytest.raises(FastRemoverError):
        media.write_video(str(blocker / "frames") + "/", video.frames[:2], 24)


def test_failed_encode_leaves_existing_output_and_no_temp_file(tmp_path, clip, monkeypatch):
    video, _ = clip
    out = tmp_path / "out.mp4"
    out.write_bytes(b"previous result")
    real = av.VideoFrame
    calls = {"n": 0}

    class FailingVideoFrame:  # fails on the 5th frame, after the file has been opened and written to
        @staticmethod
        def from_ndarray(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("simulated encoder crash")
            return real.from_ndarray(*args, **kwargs)

    monkeypatch.setattr(media.av, "VideoFrame", FailingVideoFrame)
    with pytest.raises(RuntimeError, match="simulated"):
        media.write_video(out, video.frames, 24)
    assert out.read_bytes() == b"previous result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]


def test_atomic_write_path(tmp_path):
    target = tmp_path / "result.json"
    with media.atomic_write_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".result.json.") and tmp.name.endswith(".tmp")
        assert not target.exists()
        tmp.write_text("{}")
    assert target.read_text() == "{}"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # like an ordinary new file, not mkstemp's 0600
    with pytest.raises(ValueError):
        with media.atomic_write_path(target) as tmp:
            tmp.write_text("half")
            raise ValueError("boom")
    assert target.read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_write_image(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    media.write_image(tmp_path / "x.png", img)
    np.testing.assert_array_equal(media.read_video(tmp_path / "x.png").frames[0], img)
    with pytest.raises(FastRemoverError):
        media.write_image(tmp_path / "x.mp4", img)


# ----------------------------------------------------------------------------------------------------------
# synthetic clip
# ----------------------------------------------------------------------------------------------------------


def test_synthetic_clip_shape_determinism_fraction():
    video, mask = media.synthetic_clip()
    assert video.frames.shape == (33, 240, 432, 3) and video.frames.dtype == np.uint8
    assert mask.shape == (33, 240, 432) and mask.dtype == bool
    assert video.fps == 24 and video.source is None and not video.has_audio
    fraction = mask.mean(axis=(1, 2))
    assert np.all(np.abs(fraction - 0.15) < 0.01)
    again, mask2 = media.synthetic_clip()
    np.testing.assert_array_equal(video.frames, again.frames)
    np.testing.assert_array_equal(mask, mask2)
    other, _ = media.synthetic_clip(seed=1)
    assert not np.array_equal(other.frames, video.frames)
    # The background pans (frames differ outside the object) and the object moves.
    outside = ~(mask[0] | mask[1])
    assert np.abs(video.frames[0].astype(int) - video.frames[1])[outside].mean() > 1
    assert not np.array_equal(mask[0], mask[-1])
    small, _ = media.synthetic_clip(5, 64, 96, object_fraction=0.05, fps=Fraction(30000, 1001))
    assert small.fps == Fraction(30000, 1001)


def test_synthetic_clip_at_full_size():
    video, mask = media.synthetic_clip(152, 480, 854)
    assert video.frames.shape == (152, 480, 854, 3) and mask.shape == (152, 480, 854)
    assert 0.1 < mask.mean() < 0.2


def test_truncated_video_keeps_decodable_frames_with_a_warning(tmp_path, clip):
    video, _ = clip
    media.write_video(tmp_path / "full.mp4", video.frames, 24)
    data = (tmp_path / "full.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: int(len(data) * 0.7)])
    with pytest.warns(UserWarning, match="truncated"):
        back = media.read_video(tmp_path / "cut.mp4")
    assert 0 < back.num_frames < video.num_frames


@pytest.mark.skipif("libmp3lame" not in av.codecs_available, reason="this FFmpeg build has no MP3 encoder")
def test_mp3_from_avi_is_copied_into_mp4(tmp_path, clip):
    # The decoder is called "mp3float"; copying must go by the codec ("mp3"), which mp4 accepts.
    video, _ = clip
    src = tmp_path / "a.avi"
    out = av.open(str(src), "w")
    vs = out.add_stream("libx264", rate=24)
    vs.width, vs.height, vs.pix_fmt = 64, 48, "yuv420p"
    audio = out.add_stream("libmp3lame", rate=44100)
    audio.layout = "stereo"
    for i in range(24):
        frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(88200) / 44100)).astype(np.float32)
    for k in range(0, len(tone), 1152):
        af = av.AudioFrame.from_ndarray(np.stack([tone[k : k + 1152]] * 2), format="fltp", layout="stereo")
        af.sample_rate, af.pts = 44100, k
        out.mux(audio.encode(af))
    out.mux(audio.encode(None))
    out.close()
    media.write_video(tmp_path / "out.mp4", video.frames, 24, audio_from=src)
    with av.open(str(tmp_path / "out.mp4")) as c:
        assert c.streams.audio[0].codec_context.codec.canonical_name == "mp3"


def test_h264_writes_are_reproducible_with_the_background_converter(tmp_path):
    # RGB -> YUV conversion runs one frame ahead in a worker thread; the file must not depend on thread timing
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (12, 64, 96, 3), dtype=np.uint8)
    outs = []
    for i in range(3):
        path = tmp_path / f"o{i}.mp4"
        media.write_video(path, frames, 24.0)
        outs.append(path.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    back = media.read_video(tmp_path / "o0.mp4").frames
    assert back.shape == frames.shape


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a CPU affinity API and at least 2 usable CPUs")
def test_h264_bytes_do_not_depend_on_the_writing_threads_cpus(tmp_path):
    """x264's output depends on its thread count, and its automatic count follows the CPU affinity of the thread that
    opens the encoder: the same frames written from a thread pinned to one CPU gave another file than from the main
    thread. The writer fixes the count (media.ENCODER_THREADS), so the bytes are the frames' alone."""
    import hashlib
    import threading

    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (1, 96, 160, 3)).astype(np.uint8)
    frames = np.concatenate([np.roll(base, 3 * i, axis=2) for i in range(12)])
    media.write_video(tmp_path / "main.mp4", frames, 24)
    errors = []

    def pinned():
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
            media.write_video(tmp_path / "pinned.mp4", frames, 24)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    assert not errors, errors
    digest = [hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("main.mp4", "pinned.mp4")]
    assert digest[0] == digest[1]


@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuv444p"])
def test_the_encoders_pictures_are_a_function_of_the_pixels(pix_fmt):
    """FFmpeg aligns each plane's rows (to 64 bytes on AVX-512 machines) and leaves the bytes after a row's end
    uninitialized. (Suspected, and refuted, as the cause of the H200 machine's differing H.264 files: W2's planes
    are not padded there; x264's AVX-512 code was the cause, see test_x264_is_capped_at_avx2_on_avx512_cpus.) The
    writer zeroes those bytes anyway, so every byte of the picture handed to the encoder is a function
    of the frame: repeated conversions of one frame are equal byte for byte, padding included."""
    rng = np.random.default_rng(1)
    frame = rng.integers(0, 256, (48, 86, 3), dtype=np.uint8)  # 86 / 43 columns: rows padded at any alignment
    pictures = set()
    for _ in range(6):
        yuv = media._to_yuv(frame, pix_fmt)
        assert any(p.line_size > p.width for p in yuv.planes)
        pictures.add(b"".join(bytes(p) for p in yuv.planes))
        _junk = [np.random.bytes(1 << 16) for _ in range(8)]  # churn the allocator between conversions
    assert len(pictures) == 1
    plane = yuv.planes[1]
    rows = np.frombuffer(bytes(plane), np.uint8).reshape(plane.height, plane.line_size)
    assert not rows[:, plane.width:].any()


def test_x264_is_capped_at_avx2_on_avx512_cpus():
    """On a CPU with AVX-512 the writer passes x264 asm=AVX2 (its AVX-512 code gave different files for the same
    pictures within one process on the H200 machine); elsewhere nothing."""
    flags = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma{}\n"
    assert media.x264_params(flags.format(" avx512f avx512bw")) == {"x264-params": "asm=AVX2"}
    assert media.x264_params(flags.format("")) == {}
    assert media.x264_params("no flags line") == {}


def _cpu_flags() -> list[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    return next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])


@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="needs an x86 CPU with AVX2 (/proc/cpuinfo)")
def test_the_avx2_cap_writes_the_same_frames(tmp_path, monkeypatch):
    """What holds on any x86 CPU with AVX2: the capped write is a valid H.264 file of the frames, the same bytes
    every time (the cap's purpose), and of the uncapped write's quality (the cap picks x264's SIMD code, not its
    settings). On a CPU without AVX-512, where x264 picks AVX2 itself, it is the uncapped file byte for byte. (With
    AVX-512 the pictures may differ in the last bits: x264's AVX-512 code rounds some steps differently.)"""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (1, 64, 96, 3)).astype(np.uint8)
    frames = np.concatenate([np.roll(base, 2 * i, axis=2) for i in range(8)])
    monkeypatch.setattr(media, "_X264_PARAMS", {})
    media.write_video(tmp_path / "plain.mp4", frames, 24)
    monkeypatch.setattr(media, "_X264_PARAMS", {"x264-params": "asm=AVX2"})
    media.write_video(tmp_path / "capped.mp4", frames, 24)
    media.write_video(tmp_path / "again.mp4", frames, 24)
    plain, capped = media.read_video(tmp_path / "plain.mp4").frames, media.read_video(tmp_path / "capped.mp4").frames
    assert capped.shape == frames.shape == plain.shape
    assert (tmp_path / "capped.mp4").read_bytes() == (tmp_path / "again.mp4").read_bytes()

    def psnr(a: np.ndarray) -> float:
        return 10 * np.log10(255**2 / ((a.astype(np.float64) - frames) ** 2).mean())

    assert abs(psnr(capped) - psnr(plain)) < 0.1, (psnr(capped), psnr(plain))
    if "avx512f" not in _cpu_flags():
        assert (tmp_path / "capped.mp4").read_bytes() == (tmp_path / "plain.mp4").read_bytes()
