"""Compile a run shape's Triton kernels ahead of their first launch, concurrently (issue 45: the first-ever run).

A kernel compiles on its first launch of a new specialization (constexprs, int classes, pointer alignment, launch
options), one after another on the thread that launches it. Before a window's VAE encode, the engine asks this module
to compile everything the fast engine will launch for that window's run shape, in a thread pool:

1. record: the fast VAE's encode + decode (`record_vae`: a meta-device twin of the engine's FastWanVAE, with the
   engine's resolved options and its live pair / frames-per-step decisions) and one fast-transformer step
   (`record_transformer`: `FastTransformer.launch_kernels`, the step's Triton calls beside the real code) are driven
   on the meta device while `JITFunction.run` is intercepted (`recording`): each launch's kernel and arguments are
   kept (tensors as stand-ins with their dtype and the alignment of their storage offset), nothing is allocated or
   launched. Autotuned kernels record the tuned choice where the in-memory or persistent cache holds one, else every
   candidate (what the tuning launches). Nothing here runs a Python decomposition on a meta tensor (which would
   import torch._dynamo / sympy: seconds in a fresh process).
2. compile (`compile_launches`): each distinct launch is replayed as `JITFunction.run(..., warmup=True)` inside
   Triton's `AsyncCompileMode` (Triton 3.6 and 3.9): Triton's own binder computes the key the real launch will
   compute, the compile runs in the pool (Triton releases the GIL in its MLIR / LLVM passes; ptxas is a subprocess),
   and the kernel lands in the JITFunction's in-memory cache (and Triton's disk cache). The real launch then finds it
   there: the same kernel, the same key, so the same output bits. A launch whose key differs from the recorded one
   compiles lazily as before (time only); a recorded launch that fails to compile is skipped.

   With `wait=False` (FASTREMOVER_PRECOMPILE=background) the compiles are submitted to a long-lived pool and the
   call returns at once: the window's work goes on while they run, and a launch waits only for its own kernel (Triton
   3.9 keeps the pending compile in the kernel's cache; for Triton 3.6, which does not, `_await_hook` makes the
   launch's compile wait for the compile submitted ahead instead of starting another).

   A recording intercepts only its own thread's calls (each patched function dispatches on the calling thread), so
   a shape can be recorded in a background thread while the window's real work runs: `Precompiler.shapes(...,
   background=True)` (the engine's choice for a process's later shapes with FASTREMOVER_PRECOMPILE=record-background,
   off by default: the window's launches start at once, a launch of a key whose compile was submitted waits for it,
   one not yet recorded compiles at its launch as without precompile; both threads run Python under one GIL). One
   recording runs at a time (`_RECORDING`).

`Precompiler` holds the per-process state (shapes done, keys submitted) and is what the engine calls.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

log = logging.getLogger("fastremover")

# the kernel modules whose wrappers a recording drives (their device checks and autotuners are replaced meanwhile)
KERNEL_MODULES = ("adaln", "qk_norm_rope", "quant", "residual", "vae_norm", "upsample_conv", "gemm_fp8",
                  "conv3d_fp8")
MAX_THREADS = 16


def default_threads() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


class _Ptr:
    """A tensor as Triton's binder sees it: its dtype, and a data pointer with the 16-byte alignment a CUDA tensor of
    the same storage offset has (the caching allocator's blocks are 512-byte aligned)."""

    __slots__ = ("dtype", "_ptr")

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._ptr = (1 << 20) + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._ptr


def _stand_in(a):
    return _Ptr(a) if isinstance(a, torch.Tensor) else a


@dataclass
class Launch:
    """One recorded launch: the JITFunction, its arguments (tensors as `_Ptr`) and its launch keywords."""

    fn: object
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.fn.fn.__name__


_BINDERS: dict = {}


def _binder(fn, backend):
    from triton.runtime.jit import create_function_from_signature

    key = (id(fn), id(backend))
    entry = _BINDERS.get(key)
    if entry is None or entry[0] is not fn:
        entry = _BINDERS[key] = (fn, create_function_from_signature(fn.signature, fn.params, backend))
    return entry[1]


def make_backend(target=None):
    """Triton's backend for `target` (default: the active driver's current target, i.e. the current GPU)."""
    from triton.compiler import make_backend as _make
    from triton.runtime import driver

    return _make(target if target is not None else driver.active.get_current_target())


def specialization(launch: Launch, backend) -> tuple[list, dict]:
    """(specialization, options) of a launch as Triton's binder computes them for `backend` (JITFunction.run's key is
    str(specialization) + str(options), with its debug / instrumentation options added)."""
    _, spec, options = _binder(launch.fn, backend)(*launch.args, **launch.kwargs)
    return spec, options


def launch_key(launch: Launch, backend) -> tuple:
    spec, options = specialization(launch, backend)
    return launch.name, id(launch.fn), repr(spec), repr(sorted(options.items()))


@dataclass
class Recording:
    launches: list[Launch] = field(default_factory=list)

    def unique(self, backend) -> list[tuple[tuple, Launch]]:
        """(key, launch) per distinct specialization, in first-launch order."""
        seen: dict[tuple, Launch] = {}
        for launch in self.launches:
            seen.setdefault(launch_key(launch, backend), launch)
        return list(seen.items())


def _live_key(key: tuple, device: torch.device) -> tuple:
    """An autotune key recorded on the meta device, as the real launch on `device` forms it."""
    return tuple(device if isinstance(k, torch.device) and k.type == "meta" else k for k in key)


class _Props:
    """`torch.cuda.get_device_properties` within a recording: the recorded device's own properties (name, capability:
    the persistent cache's keys read them) with `multi_processor_count` as given; on the meta device only that."""

    def __init__(self, live, sm_count: int):
        self._live, self.multi_processor_count = live, sm_count

    def __getattr__(self, name):
        if self._live is None:
            raise AttributeError(f"a meta-device recording has no GPU property {name!r}")
        return getattr(self._live, name)


_RECORDING = threading.Lock()  # one recording at a time: each restores the functions it found


@contextlib.contextmanager
def recording(device: torch.device | None = None, *, sm_count: int | None = None, upconv: bool = True):
    """Within: a JITFunction launch is recorded in the yielded `Recording` and does nothing else; the kernel
    wrappers' device checks pass for meta tensors; `torch.cuda.get_device_properties` answers with `device`'s (or
    `sm_count` SMs); the sub-pixel conv's availability is `upconv`; an autotuned launch records the choice the
    in-memory or persistent cache holds for `device`, else every candidate (a cold run compiles them all)."""
    from triton.runtime.jit import JITFunction

    from fastremover.fast.kernels import _common

    device = torch.device(device) if device is not None else torch.device("meta")
    rec = Recording()

    def run(self, *args, grid, warmup, **kwargs):
        rec.launches.append(Launch(self, tuple(_stand_in(a) for a in args),
                                   {k: _stand_in(v) for k, v in kwargs.items()}))

    def autotune(cache, key, cands, launch, enabled, what, *, device=None, persistent="default"):
        live = _live_key(key, device_)
        cfg = cache.get(live)  # read only: the real process's tuned choices
        if cfg is not None or not enabled or len(cands) == 1:
            return cfg if cfg is not None else cands[0]
        store = persistent
        if persistent == "default":
            from fastremover.cache import default_cache

            store = default_cache() if device_.type == "cuda" else None
        if store is not None:
            from fastremover.cache import environment

            cfg = _common._stored_config(store.get(_common.AUTOTUNE_NAMESPACE, [what, live], environment(device_)),
                                         cands)
            if cfg is not None:
                return cfg
        for c in cands:  # a cold run launches (compiles) every candidate
            launch(c)
        return cands[0]

    device_ = device
    live_props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    if sm_count is None:
        sm_count = live_props.multi_processor_count if live_props is not None else 132
    props_stub = _Props(live_props, sm_count)

    patches = []
    owner = threading.get_ident()

    def patch(obj, name, value):
        """obj.name is `value` for this thread's calls and what it was for every other thread's."""
        old = getattr(obj, name)
        patches.append((obj, name, old))

        def dispatch(*args, **kwargs):  # (on a class, a method: the instance comes first in args)
            return (value if threading.get_ident() == owner else old)(*args, **kwargs)

        setattr(obj, name, dispatch)

    _RECORDING.acquire()
    try:
        patch(JITFunction, "run", run)
        for mod_name in KERNEL_MODULES:
            try:
                mod = importlib.import_module(f"fastremover.fast.kernels.{mod_name}")
            except ImportError:
                continue
            if hasattr(mod, "check_device"):
                patch(mod, "check_device", lambda *a, **k: None)
            if hasattr(mod, "autotune"):
                patch(mod, "autotune", autotune)
        from fastremover.fast.kernels import gemm_fp8, upsample_conv

        patch(upsample_conv, "available", lambda d: upconv)
        patch(gemm_fp8, "fused_ffn1_available", lambda d, k, n: True)  # asked only where the live transformer fuses
        patch(torch.cuda, "get_device_properties", lambda *a, **k: props_stub)
        import torch.nn.functional as F

        real_sdpa = F.scaled_dot_product_attention

        # on meta: the output's shape without its decomposition (the VAE's attention)
        def sdpa(q, k, v, *args, **kwargs):
            if q.device.type != "meta":
                return real_sdpa(q, k, v, *args, **kwargs)
            return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)

        patch(F, "scaled_dot_product_attention", sdpa)
        yield rec
    finally:
        for obj, name, old in reversed(patches):
            setattr(obj, name, old)
        _RECORDING.release()


# ----------------------------------------------------------------------------------------------------------------------
# What one window launches


def meta_mirror(obj, memo: dict | None = None):
    """`obj` with every tensor in it (through dataclasses, dicts, lists, tuples) replaced by a meta tensor of the same
    shape, strides, dtype and storage offset (the pointer alignment Triton specializes on); modules and other values
    kept. No Python decomposition runs (factories and views only)."""
    import copy
    import dataclasses

    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            base = torch.empty(obj.storage_offset() + max(1, obj.untyped_storage().nbytes() // obj.element_size()),
                               dtype=obj.dtype, device="meta")
            memo[key] = base.as_strided(obj.shape, obj.stride(), obj.storage_offset())
        return memo[key]
    if isinstance(obj, dict):
        return {k: meta_mirror(v, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(meta_mirror(v, memo) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, meta_mirror(getattr(obj, f.name), memo))
        return new
    return obj


class _MetaConvs:
    """The convs' output on the meta device as cuDNN lays it out on CUDA: channels-last where the input or the weight
    is channels-last (the meta conv itself returns a contiguous tensor; the kernels after it specialize on the
    layout). In place of a ConvPlans on the twin."""

    def conv(self, x: torch.Tensor, weight: torch.Tensor, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
        # the output shape by the conv formula (torch's meta conv runs checks that import sympy)
        n = x.dim() - 2

        def per_dim(v):
            return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n

        stride, padding, dilation = per_dim(stride), per_dim(padding), per_dim(dilation)
        spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in
                   zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)]
        fmt = torch.channels_last_3d if n == 3 else torch.channels_last

        def cl(t):
            return t.is_contiguous(memory_format=fmt) and not t.is_contiguous()

        return torch.empty((x.shape[0], weight.shape[0], *spatial), dtype=x.dtype, device=x.device,
                           memory_format=fmt if cl(x) or cl(weight) else torch.contiguous_format)


def vae_twin(vae):
    """A meta-device FastWanVAE of `vae` (a FastWanVAE): its eager module tree, its converted weights mirrored on the
    meta device, its dtype, precision and resolved options, and its live frame-size policies (pair_fits,
    frames_per_step): the same Triton launches as `vae` for the same shapes, with no memory and no compute. Kept on
    `vae` (built once)."""
    twin = getattr(vae, "_precompile_twin", None)
    if twin is not None:
        return twin
    from fastremover.fast.vae import conv as vae_conv
    from fastremover.fast.vae import model as vae_model

    meta = torch.device("meta")
    upconv, fp8, weights = vae.convs.upconv, vae.convs.fp8, meta_mirror(vae.weights)
    saved = [(vae_conv, "load_upconv"), (vae_model, "load_upconv"), (vae_model, "load_fp8"),
             (vae_model, "load_conv_plans"), (vae_model, "convert")]
    old = [getattr(o, n) for o, n in saved]
    vae_conv.load_upconv = vae_model.load_upconv = lambda d, dt: upconv
    vae_model.load_fp8 = lambda d: fp8
    vae_model.load_conv_plans = lambda d, dt, p: None  # cuDNN plans: no Triton launch
    vae_model.convert = lambda *a, **k: weights
    try:
        twin = vae_model.FastWanVAE(vae.vae, device=meta, dtype=vae.dtype, precision=vae.precision,
                                    kernels=vae.kernels, options=vae.options)
    finally:
        for (o, n), v in zip(saved, old):
            setattr(o, n, v)
    twin.convs.bias_kernel = vae.convs.bias_kernel
    twin.convs.plans = _MetaConvs()
    decoder, plain_head = twin.decoder, twin.decoder.head

    def head(x, st, out):  # the tap head's Triton launch is its norm; the rest is torch arithmetic (no launch)
        if decoder.head_taps is None:
            return plain_head(x, st, out)
        decoder.blocks.norm(x, decoder.vae.decoder.norm_out, silu=True)

    decoder.head = head
    twin.pair_fits = vae.pair_fits  # the live policies (free GPU memory, frame size)
    twin.frames_per_step = vae.frames_per_step
    vae._precompile_twin = twin
    return twin


# The VAE runs a clip chunk by chunk (its first frame, then 4 frames per chunk; a latent frame per decode step), each
# causal conv keeping the last 2 frames it saw: the first chunk runs without them, the second with one, every later
# chunk with two, as the third does. So a clip of this many frames (1 + 2 chunks; 3 latent frames) makes every
# specialization a window of any length does (tests/kernels/test_precompile.py compares 81 frames with it; the check
# at the released config: docs/performance.md, sessions 27-28).
VAE_RECORD_FRAMES = 9


def record_vae(vae, frames: int, height: int, width: int, batch: int = 1) -> None:
    """The fast VAE's Triton launches for one window (inside `recording`): encode_removal_inputs of a [batch, 3,
    frames, height, width] clip and the decode of its latents, on `vae`'s meta twin (at most `VAE_RECORD_FRAMES`
    frames: the same specializations, a fraction of the recording's time)."""
    frames = min(frames, VAE_RECORD_FRAMES)
    twin = vae_twin(vae)

    def source(s, e, out):  # encode_removal_inputs' sources form the inputs with torch ops: no Triton launch
        pass

    # (encode_removal_inputs without its input checks and sources: a Python scalar op on a meta tensor, `1 - mask`,
    # would run a decomposition)
    za, _ = twin._encode_two(source, source, source, batch, frames, height, width, None)
    twin.decode(za)  # (decode_iter's launches, into one output: no torch.cat of the chunks)


def record_transformer(fast, frames: int, height: int, width: int, batch: int = 1) -> None:
    """One denoise step's Triton launches (the first step, which also calibrates) of the FastTransformer `fast` for
    a window of `frames` x `height` x `width` pixels (inside `recording`)."""
    cfg = fast.model.config
    sc, tc = 8, 4  # the VAE's spatial and temporal compression (the transformer's input is the latent grid)
    t_lat = (frames - 1) // tc + 1
    hidden = (batch, cfg.in_channels, t_lat, height // sc, width // sc)
    fast.launch_kernels(hidden, torch.device("meta"))


# ----------------------------------------------------------------------------------------------------------------------
# Concurrent compile


def async_compile_mode():
    """Triton's AsyncCompileMode class (Triton 3.6+), or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@dataclass
class CompileReport:
    recorded: int = 0  # launches recorded
    distinct: int = 0  # distinct specializations among them
    submitted: int = 0  # compiles started (the rest were compiled or submitted before)
    failed: int = 0  # replays that raised (those launches compile lazily, as without precompile)
    record_s: float = 0.0
    compile_s: float = 0.0
    background: bool = False  # recorded and submitted in the background (the counts are then not known here)

    def describe(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def _replay(launches: list[Launch]) -> int:
    """Each launch as JITFunction.run(warmup=True) (inside an AsyncCompileMode: a compile submitted); the number
    that could not be replayed (those compile lazily at their launch)."""
    failed = 0
    for launch in launches:
        try:
            launch.fn.run(*launch.args, grid=None, warmup=True, **launch.kwargs)
        except Exception as e:  # noqa: BLE001 (a launch that cannot be replayed compiles lazily)
            failed += 1
            log.debug("precompile: %s not replayed: %s: %s", launch.name, type(e).__name__, e)
    return failed


# Compiles submitted in the background and not finalized yet: (id(JITFunction), Triton's key) -> its FutureKernel
_PENDING: dict = {}
_HOOKED: list = []


def _await_hook() -> bool:
    """Wrap JITFunction._do_compile once per process: a compile submitted in the background is registered in
    `_PENDING`; a launch's compile of a key pending there waits for that compile (phase "precompile_wait") instead
    of compiling again. False where Triton has no _do_compile."""
    if _HOOKED:
        return True
    from triton.runtime.jit import JITFunction

    from fastremover.timing import precompiling_now

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return False

    def _do_compile(self, key, *args, **kwargs):
        if precompiling_now():  # a replay of compile_launches
            kernel = original(self, key, *args, **kwargs)
            if getattr(kernel, "future", None) is not None:  # a FutureKernel: submitted, not finished
                _PENDING[(id(self), key)] = kernel
            return kernel
        pending = _PENDING.pop((id(self), key), None)
        if pending is not None:
            from fastremover.timing import phase

            with phase("precompile_wait"):
                kernel = pending.result(ignore_errors=True)  # (sets the kernel's cache entry)
            if kernel is not None:
                return kernel
        return original(self, key, *args, **kwargs)

    JITFunction._do_compile = _do_compile
    _HOOKED.append(original)
    return True


def settle(wait: bool = False) -> int:
    """Finalize the background compiles that have finished (all of them, waiting, with `wait`): each kernel goes into
    its JITFunction's cache; a failed one is dropped (its launch compiles lazily). Returns how many are pending."""
    for entry, kernel in list(_PENDING.items()):
        if wait or kernel.future is None or kernel.future.done():
            _PENDING.pop(entry, None)
            kernel.result(ignore_errors=True)
    return len(_PENDING)


def compile_launches(launches: list[Launch], threads: int | None = None, *, pool=None) -> tuple[int, int]:
    """Compile `launches` (distinct specializations) concurrently: each replayed as JITFunction.run(warmup=True) in
    Triton's AsyncCompileMode; returns (submitted, failed). Without `pool`: over a pool of `threads` (default:
    min(16, cores)), blocking until every compile has finished (the kernels are then in their JITFunctions'
    caches). With `pool` (a long-lived executor): submitted there and returns at once (module docstring); `failed`
    then counts the replays that raised only."""
    mode_cls = async_compile_mode()
    if mode_cls is None or not launches:
        return 0, 0
    from fastremover.timing import precompiling

    if pool is not None:
        from triton.runtime import _async_compile

        active = getattr(_async_compile, "active_mode", None)
        if active is not None and _await_hook():
            mode = mode_cls(pool, ignore_errors=True)
            token = active.set(mode)  # entered without __exit__'s wait for every compile
            try:
                with precompiling():
                    failed = _replay(launches)
            finally:
                active.reset(token)
            return len(mode.raw_futures), failed
    failed = 0
    with ThreadPoolExecutor(max_workers=threads or default_threads(), thread_name_prefix="fastremover-compile") as pool:
        with precompiling(), mode_cls(pool, ignore_errors=True) as mode:
            failed += _replay(launches)
            submitted = len(mode.raw_futures)
            futures = list(mode.raw_futures)
        # (leaving the mode waited for every compile; ignore_errors: a failed one stays uncompiled)
    for f in futures:
        if f.exception() is not None:
            failed += 1
            log.debug("precompile: a compile failed: %s: %s", type(f.exception()).__name__, f.exception())
    return submitted, failed


def _log_failure(future: Future) -> None:
    e = future.exception()  # (the recording's own failures are caught: this is anything else)
    if e is not None:
        log.debug("precompile: a background recording failed: %s: %s", type(e).__name__, e)


class Precompiler:
    """Per-process precompile of the fast engine's Triton kernels: `shapes((frames, height, width), ...)` records
    each new run shape's launches (the fast VAE's and, given, the fast transformer's) and compiles the new ones."""

    def __init__(self, device: torch.device, vae=None, transformer=None, threads: int | None = None,
                 wait: bool = True):
        self.device = torch.device(device)
        self.vae, self.transformer = vae, transformer
        self.threads = threads
        self.wait = wait  # False: compile in the background (module docstring)
        self._pool: ThreadPoolExecutor | None = None
        self._recorder: ThreadPoolExecutor | None = None  # the background recordings (`shapes(background=True)`)
        self.last: Future | None = None  # the latest background recording (its CompileReport)
        self.done: set[tuple] = set()  # run shapes recorded (or being recorded in the background)
        self.keys: set[tuple] = set()  # specializations submitted
        self._backend = None

    @property
    def backend(self):
        if self._backend is None:
            self._backend = make_backend()
        return self._backend

    def record(self, shapes) -> Recording:
        """The launches of windows of these run shapes (each part on its own: one that cannot be recorded is left out
        with a debug note, and compiles at its launches)."""
        upconv = self.vae is not None and self.vae.options.upsample_conv == "subpixel"
        parts = [(record_vae, self.vae), (record_transformer, self.transformer)]
        with recording(self.device, upconv=upconv) as rec:
            for shape in shapes:
                for record, part in parts:
                    if part is None:
                        continue
                    n = len(rec.launches)
                    try:
                        record(part, *shape)
                    except Exception as e:  # noqa: BLE001 (an optimization: the run compiles lazily instead)
                        del rec.launches[n:]
                        log.debug("precompile: %s of %s not recorded: %s: %s", record.__name__, shape,
                                  type(e).__name__, e)
        return rec

    def _executor(self) -> ThreadPoolExecutor | None:
        if self.wait:
            return None
        if self._pool is None:  # (its threads end with the process; `settle(wait=True)` waits for what they run)
            self._pool = ThreadPoolExecutor(max_workers=self.threads or default_threads(),
                                            thread_name_prefix="fastremover-compile")
        return self._pool

    def background_ok(self) -> bool:
        """Whether a new shape may be recorded in the background: compiles in the background (not `wait`), and a
        shape recorded before in this process (its kernels compiled or on the way: a later shape brings few new
        specializations), with the VAE's meta twin built then (its construction swaps module functions for every
        thread)."""
        return (not self.wait and bool(self.done)
                and (self.vae is None or getattr(self.vae, "_precompile_twin", None) is not None))

    def shapes(self, shapes, background: bool = False) -> CompileReport:
        """Record these run shapes' launches (those not recorded before) and compile the new specializations. With
        `background` (where `background_ok`), the recording and the submission run in a background thread and this
        returns at once (`self.last` is its future)."""
        report = CompileReport()
        settle()  # (the background compiles of earlier calls that have finished)
        new = [tuple(int(v) for v in s) for s in dict.fromkeys(tuple(s) for s in shapes)]
        new = [s for s in new if s not in self.done]
        if not new:
            return report
        if background and self.background_ok():
            self.done.update(new)  # (claimed now: a later call does not record them again)
            if self._recorder is None:
                self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastremover-record")
            self.last = self._recorder.submit(self._record_and_compile, new, "precompile_background")
            self.last.add_done_callback(_log_failure)
            report.background = True
            return report
        return self._record_and_compile(new, "precompile_record")

    def _record_and_compile(self, new: list[tuple], phase_name: str) -> CompileReport:
        report = CompileReport()
        t0 = time.perf_counter()
        try:
            from fastremover.timing import phase

            # (in the foreground inside the engine's "precompile": the recording's share of it; in the background
            # its own phase, which overlaps the window's work)
            with phase(phase_name):
                rec = self.record(new)
                pending = [(k, launch) for k, launch in rec.unique(self.backend) if k not in self.keys]
        except Exception as e:  # noqa: BLE001 (precompile is an optimization: the run compiles lazily instead)
            log.debug("precompile: recording %s failed: %s: %s", new, type(e).__name__, e)
            self.done.update(new)
            return report
        t1 = time.perf_counter()
        report.recorded, report.distinct = len(rec.launches), len(pending)
        try:
            report.submitted, report.failed = compile_launches([launch for _, launch in pending], self.threads,
                                                               pool=self._executor())
        except Exception as e:  # noqa: BLE001 (e.g. another Triton's AsyncCompileMode: the run compiles lazily)
            log.debug("precompile: compiling %s failed: %s: %s", new, type(e).__name__, e)
            report.failed = len(pending)
        self.keys.update(k for k, _ in pending)
        self.done.update(new)
        report.record_s, report.compile_s = t1 - t0, time.perf_counter() - t1
        log.debug("precompile %s: %s", new, report.describe())
        return report
