"""The fast VAE's convolutions on cuDNN plans that give torch's bits faster (cuDNN-frontend, CUDA).

    y = ConvPlans(device).conv(x, weight, stride, padding)      ==  F.conv3d / F.conv2d(x, weight, None, stride, padding)

torch runs a convolution with the first plan of cuDNN's heuristics. For some of the VAE's shapes another plan that
cuDNN offers for the same convolution is much faster and computes the same bits: on the H200 at W2 (cuDNN 9.19,
experiments/vae_conv_plans.py, bench/results/vae-conv-plans-*.json) the encoder's 96 -> 96 3x3x3 conv at
480x832 takes 1.46 ms per call with torch's plan and 0.61 ms with `eng62_k2=20_k13=0_k18=0_k25=0_k27=2_k28=1`
(18 of the 43 plans cuDNN builds there are bit-identical to torch's; the others sum in another order).

Contract: `conv` returns exactly what torch's call returns. Per signature (conv rank, shapes, strides, dtype,
stride, padding) the first call
  1. runs torch's conv (its result is this call's output) and, for a conv of at least MIN_GFLOP, builds the
     CANDIDATES cuDNN offers for the signature (plans named by engine and knobs, so the set is the same in every
     process);
  2. keeps a candidate only if its output is torch.equal to torch's on the call's input AND on a random input of
     the same shape (a plan that adds the products in another order differs in many of the millions of outputs);
  3. times torch's conv and the kept candidates (`timing.cuda_time_ms`, TIME_REPEATS calls) and uses the fastest
     candidate from then on if it beats torch's by at least 3 %, else torch's call.
Since every candidate that can be chosen gave torch's bits, which one wins the timing changes no output: runs stay
reproducible across processes and machines. The choice is kept in the persistent cache (fastremover/cache.py; on CUDA,
keyed by the signature, the candidate list, the GPU and the library versions): a later process builds only the
stored plan and checks it once against torch's output of its first call (equal: used, no timing; not equal: noted,
chosen again as above). A signature met for the first time whose class (`class_key`: the same conv and chunk length
at other rows and columns, i.e. another crop size) has a measured choice takes that choice untimed: torch's call as
it is, or the class's plan if it builds and passes both equality checks (else it is chosen in full). The choices of
one ConvPlans are bounded (MAX_SIGNATURES, least recently used out). Inputs the plans were not built for (another
data pointer alignment, a CUDA graph capture in progress, another signature) take torch's call or their own first
call.

Cost of a first call: the plan builds, 2 + 2 x (candidates) conv runs for the equality checks and 4 x (1 + kept)
for the timing, and, transiently, a random input and two outputs of the signature (at W2's encoder level 0 about
0.9 GiB above what the conv itself needs). Later calls cost what the chosen plan costs.

Without cudnn-frontend (`pip install nvidia-cudnn-frontend`, in the `gpu` extra), off CUDA or outside fp16/bf16,
`available()` says why and the VAE runs torch's convs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from fastremover.lru import LRUCache
from fastremover.timing import cuda_time_ms, phase

# Plans that were bit-identical to torch's and fastest at the VAE's W2 shapes on the H200 (cuDNN 9.19), by name.
CANDIDATES = (
    "eng62_k2=20_k13=0_k18=0_k25=0_k27=2_k28=1",  # encoder 96 -> 96 at full resolution: 0.61 vs 1.46 ms
    "eng62_k2=20_k13=0_k18=0_k25=0_k27=4_k28=1",
    "eng62_k2=18_k13=1_k18=0_k25=0_k27=8_k28=1",  # 192 -> 192 (encoder): 1.09 vs 1.26 ms
    "eng62_k2=19_k13=1_k18=0_k25=1_k27=8_k28=1",
    "eng62_k2=20_k13=1_k18=0_k25=1_k27=1_k28=2",  # 192 (decoder), 384 -> 384: 0.30 vs 0.33, 0.56 vs 0.65 ms
    "eng62_k2=18_k13=1_k18=0_k25=1_k27=8_k28=1",
)
MIN_GFLOP = 20.0  # smaller convs keep torch's call (a plan build and a timing per signature would not pay)
TIME_REPEATS = 3
MIN_GAIN = 0.03
ALIGN = 16  # bytes: every data pointer of a call the plans run (cuDNN's default alignment assumption)
MAX_SIGNATURES = 256  # choices kept per ConvPlans (the VAE's convs at a few run shapes)
NAMESPACE = "cudnn_conv_plan"  # the persistent cache's entries (fastremover/cache.py)


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the plans can run for this device and dtype, else why not."""
    if device.type != "cuda":
        return "cuDNN plans need a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN plans are used for fp16/bf16 convs, not {dtype}"
    from fastremover.ops.attention.cudnn_fp8 import import_error

    err = import_error()
    return None if err is None else f"cudnn-frontend does not import ({err})"


def _flops(y: torch.Tensor, weight: torch.Tensor) -> float:
    return 2.0 * y.numel() * weight[0].numel()


@dataclass
class Choice:
    """What a signature runs: a plan (`run(x, w, y)`) or torch's call (run None), and the timings behind it."""

    name: str  # plan name, or "torch"
    run: Callable | None = None
    torch_ms: float | None = None
    ms: float | None = None
    equal_candidates: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why not (unequal, build failed)
    shape: tuple = ()  # the output's shape and strides (torch's, which the plans write too)
    stride: tuple = ()
    cached: bool = False  # taken from the persistent cache (checked once against torch's output, not timed)
    inferred: bool = False  # the choice of a conv of the same class at another input size (checked, not timed)


def differs(run: Callable, checks: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """None if run(x, y_out) reproduces each check's (input, torch's output) bit for bit, else why not."""
    try:
        for x, want in checks:
            got = torch.empty_strided(want.shape, want.stride(), dtype=want.dtype, device=want.device)
            run(x, got)
            if not torch.equal(got, want):
                return "output differs from torch's"
    except Exception as exc:  # noqa: BLE001 - a plan that fails to run is not a candidate
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def choose(default: Callable[[torch.Tensor], torch.Tensor], candidates: dict[str, Callable],
           checks: list[tuple[torch.Tensor, torch.Tensor]], time_ms: Callable[[Callable], float],
           min_gain: float = MIN_GAIN) -> Choice:
    """The selection rule, apart from cuDNN (tests drive it with plain functions).

    default(x) -> y: torch's conv; candidates: name -> run(x, y_out) writing the conv of x into y_out; checks:
    (input, default(input)) pairs every kept candidate must reproduce bit for bit (torch.equal); time_ms(fn) -> ms.
    Returns the fastest kept candidate if it beats the default by `min_gain` (timed on the first check's input),
    else the default."""
    kept, rejected = {}, {}
    for name, run in candidates.items():
        why = differs(run, checks)
        if why is None:
            kept[name] = run
        else:
            rejected[name] = why
    x0, y0 = checks[0]
    torch_ms = time_ms(lambda: default(x0))
    best = Choice("torch", None, torch_ms, torch_ms, list(kept), rejected)
    out = torch.empty_strided(y0.shape, y0.stride(), dtype=y0.dtype, device=y0.device)
    for name, run in kept.items():
        ms = time_ms(lambda run=run: run(x0, out))
        if ms < best.ms and ms <= (1.0 - min_gain) * torch_ms:
            best = Choice(name, run, torch_ms, ms, list(kept), rejected)
    return best


def _cuda_time_ms(fn: Callable) -> float:
    return cuda_time_ms(fn, iters=TIME_REPEATS, warmup=1)  # the warm-up: the plan's first launch


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % ALIGN == 0 for t in tensors)


class ConvPlans:
    """Per-signature plan choice for F.conv2d / F.conv3d without bias, dilation 1, groups 1 (see the module doc).
    `choices` maps each signature seen to its Choice (the bench and the tests read it)."""

    def __init__(self, device: torch.device, candidates: tuple[str, ...] = CANDIDATES, min_gflop: float = MIN_GFLOP,
                 *, builder=None, time_ms: Callable[[Callable], float] | None = None, cache="default"):
        """builder(x, weight, y, stride, padding, names) -> an object with .built (name -> index), .failed
        (name -> why) and .run(index, x, weight, y) (default: the cuDNN-frontend graph); time_ms(fn) -> ms (default:
        CUDA events). Both are replaceable for tests. cache: a fastremover.cache.PersistentCache, None (choices are
        not kept between processes), or "default": the process's cache on CUDA devices, none elsewhere."""
        self.device = device
        self.candidates = tuple(candidates)
        self.min_gflop = float(min_gflop)
        self._builder = builder or _CudnnConvPlans
        self._time_ms = time_ms or _cuda_time_ms
        if cache == "default":
            from fastremover.cache import default_cache

            cache = default_cache() if torch.device(device).type == "cuda" else None
        self.cache = cache
        self.choices: LRUCache[Choice] = LRUCache(MAX_SIGNATURES)
        self._class_hints: dict[str, str] = {}  # class_key -> the plan its last measured choice took
        self._lock = threading.Lock()

    @staticmethod
    def torch_conv(x: torch.Tensor, weight: torch.Tensor, stride, padding) -> torch.Tensor:
        fn = F.conv3d if x.dim() == 5 else F.conv2d
        return fn(x, weight, None, stride, padding)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
        nd = x.dim() - 2
        stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,) * nd
        padding = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * nd
        if (x.is_cuda and torch.cuda.is_current_stream_capturing()) or not _aligned(x, weight):
            return self.torch_conv(x, weight, stride, padding)
        key = (nd, tuple(x.shape), x.stride(), tuple(weight.shape), weight.stride(), x.dtype, stride, padding)
        choice = self.choices.get(key)
        if choice is None:
            with self._lock:
                choice = self.choices.get(key)
                if choice is None:
                    y, choice = self._first_call(x, weight, stride, padding)
                    self.choices.put(key, choice)
                    return y
        if choice.run is None:
            return self.torch_conv(x, weight, stride, padding)
        y = torch.empty_strided(choice.shape, choice.stride, dtype=x.dtype, device=x.device)
        choice.run(x, weight, y)
        return y

    def cache_key(self, x: torch.Tensor, weight: torch.Tensor, stride, padding) -> list:
        """What a choice is for: the signature and the candidate list (the persistent cache adds the GPU and the
        library versions)."""
        return [x.dim() - 2, list(x.shape), list(x.stride()), list(weight.shape), list(weight.stride()), str(x.dtype),
                list(stride), list(padding), list(self.candidates)]

    def class_key(self, x: torch.Tensor, weight: torch.Tensor, stride, padding) -> list:
        """What a choice is taken over to: the signature without the input's rows and columns (the same conv, at the
        same chunk length, of another crop size)."""
        order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
        return ["class", x.dim() - 2, list(x.shape[:-2]), order, list(weight.shape), list(weight.stride()),
                str(x.dtype), list(stride), list(padding), list(self.candidates)]

    def _class_hint(self, ckey: list) -> str | None:
        """The plan a conv of this class chose last (this process's, else the persistent cache's), or None."""
        hint = self._class_hints.get(repr(ckey))
        if hint is None and self.cache is not None:
            from fastremover.cache import environment

            stored = self.cache.get(NAMESPACE, ckey, environment(self.device))
            hint = stored.get("plan") if isinstance(stored, dict) else None
        return hint if hint in ("torch", *self.candidates) else None

    def _inferred_choice(self, name, x, weight, y, stride, padding) -> Choice | None:
        """`name`, the choice of a conv of the same class, for this signature without timing: torch's call as it is;
        a plan if it builds and reproduces torch's output on this call's input and on a random one (the equality
        checks of a full choice), else None (then chosen in full)."""
        if name == "torch":
            return Choice("torch", inferred=True)
        plans = self._builder(x, weight, y, stride, padding, (name,))
        index = plans.built.get(name)
        if index is None:
            return None
        probe = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).normal_()
        checks = [(x, y), (probe, self.torch_conv(probe, weight, stride, padding))]
        if differs(lambda xi, yo: plans.run(index, xi, weight, yo), checks) is not None:
            return None
        return Choice(name, lambda xi, w, yo, index=index: plans.run(index, xi, w, yo), equal_candidates=[name],
                      inferred=True)

    def _stored_choice(self, key, x, weight, y, stride, padding) -> Choice | None:
        """The persistent cache's choice for `key` if it still holds: "torch", or a candidate whose plan builds and
        reproduces `y` (torch's output of this call) bit for bit; else None (and a note when a stored plan
        stopped reproducing torch's output)."""
        from fastremover.cache import environment

        stored = self.cache.get(NAMESPACE, key, environment(self.device))
        if not isinstance(stored, dict) or stored.get("plan") not in ("torch", *self.candidates):
            return None
        name = stored["plan"]
        if name == "torch":
            return Choice("torch", None, stored.get("torch_ms"), stored.get("ms"), cached=True)
        plans = self._builder(x, weight, y, stride, padding, (name,))
        index = plans.built.get(name)
        if index is None:
            return None
        out = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=y.device)
        try:
            plans.run(index, x, weight, out)
            same = torch.equal(out, y)
        except Exception:  # noqa: BLE001 - a stored plan that fails to run is chosen again
            same = False
        if not same:
            self.cache.note(f"the cached cuDNN plan {name} no longer gives torch's output for conv {key[1]} x "
                            f"{key[3]}: choosing again")
            return None
        return Choice(name, lambda xi, w, yo, index=index: plans.run(index, xi, w, yo), stored.get("torch_ms"),
                      stored.get("ms"), cached=True)

    def _first_call(self, x, weight, stride, padding) -> tuple[torch.Tensor, Choice]:
        y = self.torch_conv(x, weight, stride, padding)
        if _flops(y, weight) < self.min_gflop * 1e9 or not _aligned(y):
            choice = Choice("torch")
            choice.shape, choice.stride = tuple(y.shape), y.stride()
            return y, choice
        key = self.cache_key(x, weight, stride, padding)
        ckey = self.class_key(x, weight, stride, padding)
        with phase("cudnn_plans"):
            choice = self._stored_choice(key, x, weight, y, stride, padding) if self.cache is not None else None
            if choice is None:
                hint = self._class_hint(ckey)
                choice = None if hint is None else self._inferred_choice(hint, x, weight, y, stride, padding)
                measured = choice is None
                if measured:
                    choice = self._choose(x, weight, y, stride, padding)
                    self._class_hints[repr(ckey)] = choice.name
                if self.cache is not None:
                    from fastremover.cache import environment

                    env = environment(self.device)
                    self.cache.put(NAMESPACE, key, {"plan": choice.name, "torch_ms": choice.torch_ms,
                                                    "ms": choice.ms}, env)
                    if measured:
                        self.cache.put(NAMESPACE, ckey, {"plan": choice.name}, env)
        choice.shape, choice.stride = tuple(y.shape), y.stride()
        return y, choice

    def _choose(self, x, weight, y, stride, padding) -> Choice:
        """The full selection of the module docstring (plan builds, equality checks, timing)."""
        plans = self._builder(x, weight, y, stride, padding, self.candidates)
        runs = {name: (lambda xi, yo, i=i: plans.run(i, xi, weight, yo)) for name, i in plans.built.items()}
        probe = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).normal_()
        checks = [(x, y), (probe, self.torch_conv(probe, weight, stride, padding))]
        choice = choose(lambda xi: self.torch_conv(xi, weight, stride, padding), runs, checks, self._time_ms)
        choice.rejected.update(plans.failed)
        if choice.run is not None:
            index = plans.built[choice.name]
            choice.run = lambda xi, w, yo, index=index: plans.run(index, xi, w, yo)
        del probe, checks
        return choice

    def report(self) -> list[dict]:
        """One row per signature whose first call was a candidate for plans: shapes, choice, timings."""
        rows = []
        for key, c in self.choices.items():
            if c.torch_ms is None and not c.inferred:
                continue
            ms = (lambda v: None if v is None else round(v, 4))
            rows.append({"x": list(key[1]), "w": list(key[3]), "plan": c.name, "torch_ms": ms(c.torch_ms),
                         "ms": ms(c.ms), "equal_candidates": len(c.equal_candidates),
                         "rejected": len(c.rejected), "cached": c.cached, "inferred": c.inferred})
        return rows


class _CudnnConvPlans:
    """One cuDNN-frontend conv_fprop graph for fixed shapes/strides/dtype, with the named candidate plans built
    (names None: every plan cuDNN offers, for experiments/vae_conv_plans.py's survey; a graph that cannot be built
    then raises)."""

    def __init__(self, x, weight, y, stride, padding, names: tuple[str, ...] | None):
        import cudnn

        from fastremover.ops.attention.cudnn_fp8 import _dtype, _handle

        self.cudnn = cudnn
        self.handle = _handle(x.device)
        dt = _dtype(cudnn, x.dtype)
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        self.X = g.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=dt)
        self.W = g.tensor(name="W", dim=list(weight.shape), stride=list(weight.stride()), data_type=dt)
        self.Y = g.conv_fprop(image=self.X, weight=self.W, padding=list(padding), stride=list(stride),
                              dilation=[1] * len(stride), compute_data_type=cudnn.data_type.FLOAT, name="conv")
        self.Y.set_output(True).set_dim(list(y.shape)).set_stride(list(y.stride())).set_data_type(dt)
        self.built: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.workspace: dict[int, int] = {}
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
        except Exception as exc:  # noqa: BLE001 - no graph: every candidate fails, torch's call runs
            if names is None:
                raise
            self.failed = {n: f"graph: {type(exc).__name__}: {str(exc)[:120]}" for n in names}
            return
        offered = {g.get_plan_name_at_index(i): i for i in range(g.get_execution_plan_count())}
        for name in offered if names is None else names:
            index = offered.get(name)
            if index is None:
                self.failed[name] = "not offered for this conv"
                continue
            try:
                g.build_plan_at_index(index)
                self.workspace[index] = g.get_workspace_size_plan_at_index(index)
                self.built[name] = index
            except Exception as exc:  # noqa: BLE001
                self.failed[name] = f"build: {type(exc).__name__}: {str(exc)[:120]}"
        self.graph = g

    def run(self, index: int, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
        size = self.workspace.get(index, 0)
        ws = torch.empty(max(1, size), dtype=torch.uint8, device=x.device)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(x.device).cuda_stream)
        self.graph.execute_plan_at_index({self.X: x, self.W: weight, self.Y: y}, ws, index, handle=self.handle)
