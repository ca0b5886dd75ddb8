"""fastremover.masks, checked against scipy.ndimage (the test oracle; never imported at runtime)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from scipy import ndimage

from fastremover.masks import composite, dilate_masks, feather_alpha, mask_bbox, threshold_mask


def _scipy_dilate(mask: np.ndarray, iterations: int) -> np.ndarray:
    if iterations == 0:  # our 0 means "no dilation"; scipy's 0 means "until nothing changes"
        return mask.copy()
    return np.stack([ndimage.binary_dilation(m, iterations=iterations) for m in mask])


# ----------------------------------------------------------------------------------------------------------
# dilation
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("iterations", [0, 1, 2, 6, 16, 31, 32, 40])
def test_dilation_matches_scipy_on_random_masks(iterations):
    rng = np.random.default_rng(iterations)
    for density in (0.0005, 0.01, 0.2, 0.7):
        h, w = rng.integers(5, 90, size=2)
        mask = rng.random((3, h, w)) < density
        np.testing.assert_array_equal(dilate_masks(mask, iterations), _scipy_dilate(mask, iterations))


@pytest.mark.parametrize("iterations", [1, 6, 16, 40])
def test_dilation_edges_empty_full(iterations):
    h, w = 37, 53
    edges = np.zeros((6, h, w), bool)
    edges[0, 0, 0] = True  # corners and borders: nothing may wrap or grow in from outside
    edges[1, -1, -1] = True
    edges[2, :, 0] = True
    edges[3, 0, :] = True
    edges[4, h // 2, w // 2] = True  # single pixel: an L1 diamond of radius n
    edges[5] = np.random.default_rng(0).random((h, w)) < 0.3
    np.testing.assert_array_equal(dilate_masks(edges, iterations), _scipy_dilate(edges, iterations))
    empty = np.zeros((2, h, w), bool)
    assert not dilate_masks(empty, iterations).any()
    full = np.ones((2, h, w), bool)
    assert dilate_masks(full, iterations).all()
    centre = dilate_masks(edges[4:5], iterations)[0]
    yy, xx = np.mgrid[:h, :w]
    np.testing.assert_array_equal(centre, np.abs(yy - h // 2) + np.abs(xx - w // 2) <= iterations)


def test_dilation_shapes_and_input_untouched():
    mask = np.zeros((20, 30), bool)
    mask[10, 10] = True
    before = mask.copy()
    out = dilate_masks(mask, 3)
    assert out.shape == (20, 30) and out.dtype == bool and out.sum() == 25  # 2n^2 + 2n + 1
    np.testing.assert_array_equal(mask, before)
    assert dilate_masks(mask[None], 0) is not mask
    with pytest.raises(ValueError):
        dilate_masks(mask, -1)


# ----------------------------------------------------------------------------------------------------------
# threshold, bbox
# ----------------------------------------------------------------------------------------------------------


def test_threshold_mask_uses_first_channel_strictly_greater():
    frames = np.zeros((2, 4, 5, 3), np.uint8)
    frames[0, 1, 1, 0] = 21
    frames[0, 1, 2, 0] = 20
    frames[1, 2, 2, 1] = 255  # second channel is ignored
    mask = threshold_mask(frames)
    assert mask.shape == (2, 4, 5) and mask.dtype == bool
    assert mask[0, 1, 1] and not mask[0, 1, 2] and not mask[1].any()
    assert threshold_mask(frames[..., 0]).shape == (2, 4, 5)
    assert threshold_mask(frames[0, ..., 0], threshold=10)[1, 2]
    with pytest.raises(ValueError):
        threshold_mask(np.zeros(5, np.uint8))


def test_mask_bbox():
    mask = np.zeros((3, 20, 30), bool)
    assert mask_bbox(mask) is None
    mask[0, 2, 5] = True
    mask[2, 10:12, 20:25] = True
    y0, y1, x0, x1 = mask_bbox(mask)
    assert (y0, y1, x0, x1) == (2, 12, 5, 25)
    assert mask[:, y0:y1, x0:x1].sum() == mask.sum()  # half-open box holds every set pixel
    assert mask_bbox(mask[2]) == (10, 12, 20, 25)


# ----------------------------------------------------------------------------------------------------------
# composite
# ----------------------------------------------------------------------------------------------------------


def _images(seed=0, shape=(4, 40, 50)):
    rng = np.random.default_rng(seed)
    original = rng.integers(0, 256, shape + (3,), dtype=np.uint8)
    generated = rng.integers(0, 256, shape + (3,), dtype=np.uint8)
    mask = np.zeros(shape, bool)
    mask[:, 10:30, 12:40] = True
    mask[1, :, :5] = True  # touches the frame border
    mask[3] = False  # an empty frame
    return original, generated, mask


def test_composite_hard():
    original, generated, mask = _images()
    out = composite(original, generated, mask)
    np.testing.assert_array_equal(out[~mask], original[~mask])
    np.testing.assert_array_equal(out[mask], generated[mask])
    assert out.dtype == np.uint8 and out is not original


@pytest.mark.parametrize("feather", [1, 3, 8])
def test_composite_feather_only_inside_mask(feather):
    original, generated, mask = _images(seed=feather)
    out = composite(original, generated, mask, feather=feather)
    np.testing.assert_array_equal(out[~mask], original[~mask])  # outside: bit-exact original
    # deep inside (further than the feather from any unmasked pixel): exactly generated
    deep = ~ndimage.binary_dilation(~mask[0], iterations=feather + 1)
    np.testing.assert_array_equal(out[0][deep], generated[0][deep])
    # on the mask's edge: a blend, strictly between the two where they differ a lot
    edge = mask[0] & ndimage.binary_dilation(~mask[0])
    lo = np.minimum(original[0], generated[0]).astype(int)
    hi = np.maximum(original[0], generated[0]).astype(int)
    assert np.all((out[0][edge] >= lo[edge]) & (out[0][edge] <= hi[edge]))
    far = (hi - lo)[edge] > 100
    assert np.all((out[0][edge] > lo[edge])[far] & (out[0][edge] < hi[edge])[far])


def test_composite_feather_equals_whole_frame_formula():
    # composite() only works on each mask's bounding box; it must match the whole-frame definition.
    rng = np.random.default_rng(7)
    original = rng.integers(0, 256, (5, 30, 41, 3), dtype=np.uint8)
    generated = rng.integers(0, 256, (5, 30, 41, 3), dtype=np.uint8)
    mask = dilate_masks(rng.random((5, 30, 41)) < 0.01, 4)
    mask[2, :, -6:] = True  # touching the frame edge
    for feather in (1, 2, 5):
        out = composite(original, generated, mask, feather=feather)
        for i in range(5):
            alpha = feather_alpha(mask[i], feather)[..., None]
            expected = np.rint(original[i] + alpha * (generated[i].astype(np.float32) - original[i])).astype(np.uint8)
            np.testing.assert_array_equal(out[i], expected)


def test_feather_alpha_does_not_fade_at_frame_border():
    mask = np.zeros((20, 20), bool)
    mask[:, :10] = True  # touches left, top and bottom borders
    alpha = feather_alpha(mask, 3)
    assert alpha[10, 0] == 1.0 and alpha[0, 0] == 1.0  # border of the frame: no fade
    assert 0 < alpha[10, 9] < 1  # next to unmasked pixels: faded
    assert (alpha[:, 10:] == 0).all()


def test_composite_accepts_single_mask_and_validates():
    original, generated, mask = _images()
    out = composite(original, generated, mask[0])
    np.testing.assert_array_equal(out[:, ~mask[0]], original[:, ~mask[0]])
    with pytest.raises(ValueError):
        composite(original, generated[:2], mask)
    with pytest.raises(ValueError):
        composite(original.astype(np.float32), generated, mask)


def test_masks_module_does_not_import_scipy():
    code = "import sys, fastremover.masks, fastremover.media; assert 'scipy' not in sys.modules, 'scipy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
