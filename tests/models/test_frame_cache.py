"""Tests for clew.models.frame_cache: resized frames kept by their content."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image
from support.tiny import tiny_policy

from clew.models import load_processor, pixels
from clew.models.frame_cache import FrameCache, frame_cache

SIZE = (32, 32)


def _image(seed: int, side: int = 30) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def _resizer(image: Image.Image, counter: list[int]):
    def resize() -> Image.Image:
        counter.append(1)
        return image.resize((SIZE[1], SIZE[0]), resample=3)

    return resize


def test_a_frame_shown_again_is_resized_once_and_read_back_unchanged() -> None:
    cache, resizes = FrameCache(), []
    image = _image(0)
    first = cache.resized(image, SIZE, 3, _resizer(image, resizes))
    again = cache.resized(image.copy(), SIZE, 3, _resizer(image, resizes))  # equal pixels
    assert len(resizes) == 1 and (cache.hits, cache.misses) == (1, 1)
    assert again is first and not first.flags.writeable
    np.testing.assert_array_equal(first, np.asarray(image.resize((32, 32), resample=3)))


def test_frames_that_differ_in_one_pixel_or_in_the_filter_are_kept_apart() -> None:
    cache, resizes = FrameCache(), []
    a = _image(1)
    b = a.copy()
    b.putpixel((3, 4), (0, 0, 0) if a.getpixel((3, 4)) != (0, 0, 0) else (1, 1, 1))
    cache.resized(a, SIZE, 3, _resizer(a, resizes))
    got = cache.resized(b, SIZE, 3, _resizer(b, resizes))
    cache.resized(a, SIZE, 2, _resizer(a, resizes))  # another filter: another entry
    assert len(resizes) == 3 and len(cache) == 3
    np.testing.assert_array_equal(got, np.asarray(b.resize((32, 32), resample=3)))


def test_the_least_recently_used_frames_leave_past_the_byte_budget() -> None:
    frame_bytes = SIZE[0] * SIZE[1] * 3
    cache, resizes = FrameCache(capacity_bytes=2 * frame_bytes), []
    images = [_image(s) for s in range(3)]
    for im in (images[0], images[1], images[0], images[2]):  # 1 is now the oldest
        cache.resized(im, SIZE, 3, _resizer(im, resizes))
    assert len(cache) == 2 and cache.nbytes == 2 * frame_bytes
    cache.resized(images[0], SIZE, 3, _resizer(images[0], resizes))
    assert len(resizes) == 3  # 0 stayed
    cache.resized(images[1], SIZE, 3, _resizer(images[1], resizes))
    assert len(resizes) == 4  # 1 had left


def test_a_cache_of_zero_bytes_resizes_every_time() -> None:
    cache, resizes = FrameCache(capacity_bytes=0), []
    image = _image(2)
    for _ in range(3):
        cache.resized(image, SIZE, 3, _resizer(image, resizes))
    assert len(resizes) == 3 and len(cache) == 0


def test_threads_sharing_the_cache_get_each_frame_s_own_pixels() -> None:
    cache = FrameCache()
    images = [_image(s) for s in range(4)] * 16

    def one(im: Image.Image) -> np.ndarray:
        return cache.resized(im, SIZE, 3, lambda: im.resize((32, 32), resample=3))

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, images))
    for im, arr in zip(images, out, strict=True):
        np.testing.assert_array_equal(arr, np.asarray(im.resize((32, 32), resample=3)))
    assert cache.hits + cache.misses == len(images) and len(cache) == 4


@pytest.fixture
def fresh_cache():
    frame_cache.clear()
    frame_cache.hits = frame_cache.misses = 0
    yield frame_cache
    frame_cache.clear()


def test_fast_frames_resizes_a_repeated_observation_once(fresh_cache) -> None:
    # Qwen3-VL's patch 16 x merge 2 does not divide 90 px: the processor resizes to 96.
    ip = load_processor(tiny_policy(arch="qwen3_vl")).image_processor
    images = [_image(5, 90), _image(5, 90), _image(6, 90), _image(5, 90)]
    frames = pixels.fast_frames(images, ip)
    assert frames is not None and frames.data.shape[1] == 96
    assert (fresh_cache.misses, fresh_cache.hits) == (2, 2)
    ref = ip(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels.as_patches(frames), ref)  # the processor's values, bit for bit
