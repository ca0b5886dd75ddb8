"""The weightless flow-guided remover (fastremover.classic): flow completion, propagation, never-visible pixels."""

import cv2
import numpy as np
import pytest

from fastremover import classic as C
from fastremover.errors import FastRemoverError


def _texture(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Textured uint8 [h,w,3]: smooth colour noise at two scales plus fine detail."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 128, np.float32)
    for cell, amp in ((16, 50), (4, 25)):
        coarse = rng.standard_normal((h // cell + 2, w // cell + 2, 3)).astype(np.float32)
        img += amp * cv2.resize(coarse, ((w // cell + 2) * cell, (h // cell + 2) * cell),
                                interpolation=cv2.INTER_CUBIC)[:h, :w]
    return np.clip(img, 0, 255).astype(np.uint8)


def _panning_clip(num=12, h=96, w=160, step=(1, 2), square=28):
    """Frames cropped from a big texture at integer offsets `step` (dy, dx) per frame (content moves by -step), and a
    square mask that crosses the frame: (clean frames, mask)."""
    big = _texture(h + step[0] * num + 2, w + step[1] * num + 2)
    clean = np.stack([big[i * step[0] : i * step[0] + h, i * step[1] : i * step[1] + w] for i in range(num)])
    mask = np.zeros((num, h, w), bool)
    for i in range(num):
        x = 8 + i * (w - square - 16) // (num - 1)
        mask[i, h // 2 - square // 2 : h // 2 + square // 2, x : x + square] = True
    return clean, mask


def test_harmonic_fill_exact_for_constants_close_for_linear():
    rng = np.random.default_rng(1)
    hole = np.zeros((60, 80), bool)
    hole[15:45, 20:65] = True
    values = rng.normal(size=(60, 80, 2)).astype(np.float32)
    values[~hole] = (3.25, -1.5)
    out = C.harmonic_fill(values, hole)
    np.testing.assert_allclose(out[hole], np.broadcast_to([3.25, -1.5], (hole.sum(), 2)), atol=1e-5)
    assert np.array_equal(out[~hole], values[~hole])
    # A linear field is harmonic: the fill must come close to it (an approximate solver, but not far off).
    yy, xx = np.mgrid[0:60, 0:80].astype(np.float32)
    linear = np.stack([0.1 * xx + 0.05 * yy, -0.02 * xx], axis=-1)
    noisy = np.where(hole[..., None], 0, linear).astype(np.float32)
    assert np.abs(C.harmonic_fill(noisy, hole)[hole] - linear[hole]).max() < 0.2
    with pytest.raises(ValueError, match="known pixel"):
        C.harmonic_fill(values, np.ones((60, 80), bool))


@pytest.mark.parametrize("use_homography", [True, False])
def test_complete_flow_recovers_a_shift_inside_the_hole(use_homography):
    rng = np.random.default_rng(2)
    hole = np.zeros((48, 80), bool)
    hole[10:30, 25:60] = True
    flow = rng.normal(scale=5, size=(48, 80, 2)).astype(np.float32)  # garbage inside the hole
    flow[~hole] = (2.5, -1.25)
    homography = C.fit_homography(flow, ~hole) if use_homography else None
    if use_homography:
        np.testing.assert_allclose(homography, [[1, 0, 2.5], [0, 1, -1.25], [0, 0, 1]], atol=1e-4)
    done = C.complete_flow(flow, hole, homography)
    np.testing.assert_allclose(done[hole], np.broadcast_to([2.5, -1.25], (hole.sum(), 2)), atol=1e-4)
    assert np.array_equal(done[~hole], flow[~hole])


def test_complete_flow_recovers_a_zoom_and_rotation():
    h, w = 60, 100
    a, s = np.deg2rad(2.0), 1.04
    m = np.array([[s * np.cos(a), -s * np.sin(a), 1.5], [s * np.sin(a), s * np.cos(a), -0.5], [0, 0, 1]])
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    dx, dy = C.homography_flow(m, ys, xs)
    truth = np.stack([dx, dy], axis=-1)
    hole = np.zeros((h, w), bool)
    hole[20:45, 30:75] = True
    flow = np.where(hole[..., None], 0, truth).astype(np.float32)
    done = C.complete_flow(flow, hole, C.fit_homography(flow, ~hole))
    assert np.abs(done[hole] - truth[hole]).max() < 1e-3


def _exact_flows(num, h, w, step):
    """Exact constant flows of a camera moving `step` (dy, dx) px per frame: content moves by -step."""
    dy, dx = step
    flows = {}
    for t in range(1, num):
        flows[(t, t - 1)] = C.FlowField(np.full((h, w, 2), (dx, dy), np.float32))
        flows[(t - 1, t)] = C.FlowField(np.full((h, w, 2), (-dx, -dy), np.float32))
    return flows


def test_propagation_along_a_known_shift_is_exact():
    clean, mask = _panning_clip()
    num, h, w = mask.shape
    frames = clean.copy()
    frames[mask] = (255, 0, 255)  # the object
    colours, got = C.propagate(frames, ~mask, mask, _exact_flows(num, h, w, (1, 2)))
    reached = 0
    for t in range(num):
        ys, xs = np.nonzero(mask[t])
        assert np.array_equal(np.rint(colours[t][got[t]]), clean[t, ys[got[t]], xs[got[t]]].astype(np.float32))
        reached += got[t].sum()
    assert reached > 0.95 * mask.sum()  # nearly everything is visible in some frame; all of it comes back exactly


def test_propagation_pass_chains_to_the_first_visible_frame():
    num, h, w = 6, 20, 30
    mask = np.zeros((num, h, w), bool)
    mask[:, 5:15, 10:20] = True  # a fixed hole on a camera moving 3 px right per frame
    mask[0] = False
    forward = C.propagation_pass(~mask, mask, _exact_flows(num, h, w, (0, 3)), range(num))
    assert forward[0] is None
    for t in range(1, num):
        ys, xs = np.nonzero(mask[t])
        src = forward[t]
        ok = src.frame >= 0
        # A pixel lands in the previous frame 3 px further right; inside the hole it keeps hopping until frame 0 or a
        # visible pixel: its source is always the same scene point.
        assert ok.all()
        np.testing.assert_array_equal(src.x[ok] - xs[ok], 3 * (t - src.frame[ok]))
        np.testing.assert_array_equal(src.y[ok], ys[ok])
        assert (src.frame[ok] < t).all()


def test_static_camera_moving_object_is_restored_exactly():
    clean, mask = _panning_clip(step=(0, 0))
    frames = clean.copy()
    frames[mask] = (20, 240, 20)
    out = C.classic_remove(frames, mask)
    assert np.array_equal(out[~mask], frames[~mask])
    visible_somewhere = mask & ~mask.all(axis=0)[None]
    assert np.array_equal(out[visible_somewhere], clean[visible_somewhere])


def test_panning_camera_beats_the_old_remover():
    clean, mask = _panning_clip(step=(1, 2))
    frames = clean.copy()
    frames[mask] = (20, 240, 20)

    def psnr(x):
        mse = np.mean((x[mask].astype(np.float64) - clean[mask]) ** 2)
        return 10 * np.log10(255**2 / mse)

    new, old = psnr(C.classic_remove(frames, mask)), psnr(C.classic_remove_v1(frames, mask))
    assert new > 30 and new > old + 3, (new, old)


def test_never_visible_pixels_come_from_one_inpainted_key_frame():
    frame = _texture(64, 96, seed=3)
    frames = np.repeat(frame[None], 8, axis=0)
    mask = np.zeros((8, 64, 96), bool)
    mask[:, 20:40, 30:60] = True  # a still object on a still camera: never visible
    frames[mask] = (250, 10, 10)
    out = C.classic_remove(frames, mask, seam=False)
    key = C._inpaint(frames[0], mask[0], 5, C.KEY_INPAINT)  # key frame: the first with the most missing pixels
    for t in range(8):
        assert np.array_equal(out[t][mask[t]], key[mask[t]]), t  # the same fill in every frame: no flicker
    with_seam = C.classic_remove(frames, mask)
    assert all(np.array_equal(with_seam[t], with_seam[0]) for t in range(8))


def test_contract_deterministic_unmasked_unchanged_and_refusals():
    clean, mask = _panning_clip(num=8)
    frames = clean.copy()
    frames[mask] = (0, 0, 255)
    a, b = C.classic_remove(frames, mask), C.classic_remove(frames, mask)
    assert a.dtype == np.uint8 and a.shape == frames.shape
    assert np.array_equal(a, b)
    assert np.array_equal(a[~mask], frames[~mask])
    assert not np.array_equal(a[mask], frames[mask])
    assert np.array_equal(C.classic_remove(frames, np.zeros_like(mask)), frames)
    # frames shared with the previous window come with their mask cleared: they are sources, left as they are
    shared = mask.copy()
    shared[:3] = False
    c = C.classic_remove(frames, shared)
    assert np.array_equal(c[:3], frames[:3])
    for fn in (C.classic_remove, C.classic_remove_v1, C.telea_remove):
        with pytest.raises(FastRemoverError, match="covers every pixel"):
            fn(frames, np.ones_like(mask))
