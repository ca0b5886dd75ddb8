"""Overlap on the model path of `RemovalPipeline.remove_stream`: the last window's frames go to `emit` as the VAE
decodes them, and the next window's input is read and preprocessed on the reader thread while the current window
runs. Checked with recorded events (the `trace` hook), never with wall-clock times; the output stays the bytes of the
in-memory path."""

import threading

import numpy as np
import pytest
import torch

from fastremover import media
from fastremover.config import EngineConfig
from fastremover.masks import composite, dilate_masks
from fastremover.models.loading import random_models
from fastremover.options import RunOptions
from fastremover.pipeline import RemovalPipeline, stream_prefetch
from fastremover.windows import STREAM_PREFETCH, plan_windows


@pytest.fixture(scope="module")
def tiny_pipe():
    torch.set_num_threads(1)
    return RemovalPipeline(random_models("tiny", seed=0), EngineConfig(device="cpu", precision="fp32"))


def _clip(frames, height=32, width=48, seed=3):
    video, mask = media.synthetic_clip(frames, height, width, seed=seed, object_fraction=0.08, travel=0.3)
    return video.frames, mask


class Recorder:
    """trace(event, index) from any thread, in the order they happened; `wait_for` blocks until an event arrives."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self._cond = threading.Condition()

    def __call__(self, event: str, index: int) -> None:
        with self._cond:
            self.events.append((event, index))
            self._cond.notify_all()

    def wait_for(self, item, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: item in self.events, timeout)

    def position(self, item) -> int:
        return self.events.index(item)


def _stream(pipe, frames, mask, options, trace=None, prefetch=None):
    out = []
    result = pipe.remove_stream(zip(frames, mask), out.append, options, trace=trace, prefetch=prefetch)
    return np.stack(out), result


def test_model_path_prefetches_a_whole_window():
    options = RunOptions(window=81, overlap=17)
    assert stream_prefetch(options, model=True) == 64 > STREAM_PREFETCH
    assert stream_prefetch(options, model=False) == STREAM_PREFETCH
    assert stream_prefetch(RunOptions(window=9, overlap=1), model=False) == 8


def test_next_window_is_read_while_the_current_one_decodes(tiny_pipe, monkeypatch):
    """Window 0's VAE decode waits (up to 60 s) for the reader thread to report the last frame of window 1 read,
    mask dilated. With more new frames per window (24) than the classic read-ahead (STREAM_PREFETCH = 16), that
    happens only because the model path reads one whole window ahead on its thread; a serial read would time out."""
    options = RunOptions(steps=1, window=25, overlap=1, crop="off", dilate=2)
    frames, mask = _clip(49)
    windows = plan_windows(49, options.window, options.overlap)
    assert [(w.start, w.stop) for w in windows] == [(0, 25), (24, 49)]
    assert 25 - 1 > STREAM_PREFETCH
    expected = tiny_pipe.remove(frames, mask, options).frames
    trace = Recorder()
    waited = []
    original = tiny_pipe.vae.decode_latents_iter

    def decode_after_prefetch(latents, progress=None):
        if not waited:
            waited.append(trace.wait_for(("read", 48), timeout=60))
        yield from original(latents, progress)

    monkeypatch.setattr(tiny_pipe.vae, "decode_latents_iter", decode_after_prefetch)
    out, result = _stream(tiny_pipe, frames, mask, options, trace=trace)
    assert waited == [True], "window 1's input was not read during window 0's decode"
    assert trace.position(("read", 48)) < trace.position(("decoded", 0)) < trace.position(("decode", 1))
    assert np.array_equal(out, expected)
    assert len(result.windows) == 2


def test_last_window_frames_are_emitted_while_it_decodes(tiny_pipe):
    """In the last window, each latent frame's pixels are composited, cross-faded and emitted before the next latent
    frame is decoded: frames of the last window reach `emit` between its ("decode") and ("decoded") events, in order,
    and the output equals `remove`'s bit for bit."""
    options = RunOptions(steps=1, window=9, overlap=1, crop="off", dilate=2)
    frames, mask = _clip(17)
    expected = tiny_pipe.remove(frames, mask, options).frames
    trace = Recorder()
    out, result = _stream(tiny_pipe, frames, mask, options, trace=trace)
    assert np.array_equal(out, expected)
    last = len(result.windows) - 1
    assert last == 1 and result.windows[last].ran
    start, stop = trace.position(("decode", last)), trace.position(("decoded", last))
    during = [i for event, i in trace.events[start:stop] if event == "emit"]
    # every frame of the last window goes out inside its decode (frame 8 is the shared one, cross-faded first)
    assert during == list(range(8, 17))
    emits = [i for event, i in trace.events if event == "emit"]
    assert emits == list(range(17))
    # window 0 (not the last) keeps its frames until window 1 starts: none goes out during its own decode
    first = trace.events[trace.position(("decode", 0)) : trace.position(("decoded", 0))]
    assert not [e for e in first if e[0] == "emit"]


def test_streamed_decode_equals_the_whole_decode(tiny_pipe):
    """One window through remove_stream (chunked decode, per-chunk finish + composite) against the stages run by
    hand on the whole decoded video (pipeline.decode, finish, composite): the same bytes."""
    options = RunOptions(steps=2, seed=9, crop="off", dilate=2)
    frames, mask = _clip(13, seed=5)
    dilated = dilate_masks(mask, options.dilate)
    prep = tiny_pipe.prepare(frames, dilated, None)
    latents = tiny_pipe.denoise(*tiny_pipe.encode(prep), steps=2, seed=9)
    whole = tiny_pipe.decode(latents)
    assert torch.equal(whole, tiny_pipe.vae.decode_latents(latents))
    by_hand = composite(frames, tiny_pipe.finish(whole, prep), dilated)
    out, _ = _stream(tiny_pipe, frames, mask, options)
    assert np.array_equal(out, by_hand)
    chunks = [tiny_pipe.finish_chunk(c, prep, s) for c, s in zip(tiny_pipe.decode_iter(latents), (0, 1, 5, 9))]
    assert [len(c) for c in chunks] == [1, 4, 4, 4]
    assert np.array_equal(np.concatenate(chunks), tiny_pipe.finish(whole, prep))


def test_emit_time_is_recorded(tiny_pipe, monkeypatch):
    """StreamResult.emit_s: the time the window loop spent inside `emit` (the write time a writer thread did not
    hide; the worker reports it as the exposed write). The loop's clock is replaced by one that moves only while
    `emit` runs (one unit per call), so emit_s counts exactly the time inside `emit`, no wall clock involved."""
    import types

    from fastremover import pipeline

    clock = [0.0]
    monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    options = RunOptions(steps=1, window=9, overlap=1, crop="off", dilate=2)
    frames, mask = _clip(9)

    def emit(frame):
        clock[0] += 1.0

    result = tiny_pipe.remove_stream(zip(frames, mask), emit, options)
    assert result.emit_s == 9.0 and result.timer.wall_s["read"] == 0.0


def test_worker_budget_counts_the_deeper_read_ahead():
    """A model run holds one window's new frames read ahead (input + dilated mask each) where the classic fill holds
    STREAM_PREFETCH: the worker's host-memory estimate grows by exactly those frames at 4 bytes per pixel."""
    from fastremover.worker import BYTES_PER_PREFETCHED_PIXEL, streaming_bytes, streaming_frames

    options = RunOptions()  # window 81, overlap 17: 64 new frames per window
    extra = 64 - STREAM_PREFETCH
    assert streaming_frames(0, options, model=True) == streaming_frames(0, options) + extra
    grown = streaming_bytes(0, 1080, 1920, options, model=True) - streaming_bytes(0, 1080, 1920, options)
    assert grown == extra * BYTES_PER_PREFETCHED_PIXEL * 1080 * 1920
    assert streaming_bytes(0, 1080, 1920, options, model=True) < 4 * 2**30  # 1080p still fits the default budget


def test_decode_runs_one_chunk_ahead_of_the_composite(tiny_pipe, monkeypatch):
    """The window's decode loop asks the VAE for chunk i+1 before it waits for chunk i's frames and composites them
    (on a GPU the host then waits for and composites chunk i while chunk i+1 decodes); the output bytes do not
    change."""
    options = RunOptions(steps=1, seed=4, crop="off", dilate=2)
    frames, mask = _clip(13, seed=6)
    expected, _ = _stream(tiny_pipe, frames, mask, options)
    events = []
    decode_iter = RemovalPipeline.decode_iter

    def logged_decode_iter(self, latents, progress=None):
        for i, chunk in enumerate(decode_iter(self, latents, progress)):
            events.append(("decoded", i))
            yield chunk

    def logged_emit(frame):
        events.append(("emit", len([e for e in events if e[0] == "emit"])))
        out.append(frame)

    monkeypatch.setattr(RemovalPipeline, "decode_iter", logged_decode_iter)
    out = []
    tiny_pipe.remove_stream(zip(frames, mask), logged_emit, options)
    assert np.array_equal(np.stack(out), expected)
    # 13 frames: chunks of 1, 4, 4, 4 frames; chunk i's frames go out only after chunk i+1 was decoded
    first_emit = {0: 0, 1: 1, 2: 5, 3: 9}
    for chunk, frame in first_emit.items():
        emitted_at = events.index(("emit", frame))
        if chunk + 1 in first_emit:
            assert events.index(("decoded", chunk + 1)) < emitted_at, events
        assert events.index(("decoded", chunk)) < emitted_at
