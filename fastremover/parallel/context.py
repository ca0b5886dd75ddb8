"""ParallelContext: who this process is among the ranks of one run, and the hooks the models call.

The models hold a hook (fastremover.engine.interfaces.SINGLE, size 1, by default; this context under sequence
parallelism) and call it at the only points where sequence parallelism
changes their data flow:

    shard_tokens(x)          [B, S, ...] -> this rank's tokens [B, s_r, ...] (contiguous ranges, balanced sizes)
    shard_rope(rope)         the RoPE tables' rows of this rank's tokens
    attention(fn, q, k, v)   q/k/v [B, s_r, H, D] -> all-to-all -> fn on [B, S, H/N, D] -> all-to-all back (ulysses.py)
    sequence_mean(x, out)    a mean over the whole sequence (K's centre): local fp32 sum, all-reduce, divide
    quant_centred(v, s)      V's statistics for the 8-bit attention: global mean, global amax of v - mean, codes
    gather_tokens(y)         [B, s_r, C] -> [B, S, C] on every rank (the flow prediction, 64 values per token)

At size 1 every hook returns its input or calls `fn` directly: the single-process numerics and kernels are untouched.

Collectives run on a process group created with a timeout (gloo on CPUs, NCCL on CUDA GPUs), so a lost rank never
hangs a run: its peers fail in their next collective, at the latest after the timeout. The first rank that raises
writes its message into the rendezvous store (`report_error`) before it exits; a rank whose collective then breaks
reads it (`peer_error`) and raises that one message instead of a transport error, so every rank - and the launcher -
ends with the same line.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

from fastremover.config import DEFAULT_PARALLEL_TIMEOUT_S, TRANSPORTS
from fastremover.engine.interfaces import ParallelHook
from fastremover.errors import FastRemoverError
from fastremover.parallel.ulysses import ulysses_attention

ERROR_KEY = "fastremover/error"


class ParallelError(FastRemoverError):
    """A rank of a parallel run failed; the message names the rank and its error (the same on every rank)."""


def split_sizes(total: int, world_size: int) -> list[int]:
    """Balanced contiguous split: the first total % N ranks get one item more (every rank needs at least one)."""
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


@dataclass
class ParallelContext:
    """Rank, world size and process group of a run over several ranks (the ParallelHook of engine/interfaces.py; a
    context of size 1 behaves as `SINGLE`, the hook every model holds by default).

    transport: how q/k/v travel before a 16-bit attention ("fp16": as they are, exact; "fp8": e4m3 codes + one fp32
    scale per (row, head), transport.py). head_groups: the all-to-all and the attention run in this many head groups
    per rank, the exchange of group g+1 started before the attention of group g (same result: heads are
    independent)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    transport: str = "fp16"
    head_groups: int = 1
    timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S
    store: Any = None
    sequence_total: int | None = None  # S of the current forward (recorded by shard_tokens)
    # host seconds spent waiting in the transformer's collectives (all-to-alls, the gather); on gloo that is the
    # exposed communication, on NCCL only the launch time (the GPU timeline measures it there: parallel/bench.py)
    comm_seconds: float = 0.0
    # a GPU test seam: run every hook's collectives even at world size 1 (a one-rank NCCL group), so that one GPU can
    # check what the collectives do inside a CUDA graph
    always_communicate: bool = False

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise FastRemoverError(f"--sp-transport {self.transport!r}: choose one of {list(TRANSPORTS)}")
        if not isinstance(self.head_groups, int) or self.head_groups < 1:
            raise FastRemoverError(f"head_groups={self.head_groups!r}: must be a positive integer")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1 or (self.always_communicate and self.group is not None)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        return {"parallel": "ulysses" if self.is_parallel else "none", "world_size": self.world_size,
                "sp_transport": self.transport, "head_groups": self.head_groups}

    # ------------------------------------------------------------------------------------------------------------
    # Start-up

    @classmethod
    def initialize(cls, rank: int, world_size: int, *, master_addr: str = "127.0.0.1", master_port: int,
                   device: str | torch.device = "cpu", backend: str | None = None,
                   timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S,
                   use_existing_store: bool = False, **options) -> "ParallelContext":
        """Join (or start, on rank 0) the rendezvous store at master_addr:master_port and create the process group:
        NCCL for CUDA devices, gloo otherwise. use_existing_store: every rank connects as a client (torchrun's agent
        already serves the store on that port)."""
        import torch.distributed as dist

        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=rank == 0 and not use_existing_store,
                              timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore("fastremover/", store)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        return cls(rank=rank, world_size=world_size, group=dist.group.WORLD, device=device, timeout_s=timeout_s,
                   store=store, **options)

    @classmethod
    def from_env(cls, env, *, device: torch.device, timeout_s: float = DEFAULT_PARALLEL_TIMEOUT_S,
                 **options) -> "ParallelContext":
        """The context of the rank torchrun describes (`env`: fastremover.config.torchrun_env(), read there) on the
        resolved `device`: "cuda" without an index -> cuda:LOCAL_RANK; anything else as given."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", env.local_rank)
        return cls.initialize(env.rank, env.world_size, master_addr=env.master_addr, master_port=env.master_port,
                              device=dev, timeout_s=timeout_s, use_existing_store=env.agent_store, **options)

    def close(self) -> None:
        import torch.distributed as dist

        if self.is_parallel and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------------------------
    # The error channel

    def report_error(self, message: str) -> None:
        """Record this rank's failure as the run's error (the first one recorded wins)."""
        if self.store is None:
            return
        try:
            self.store.compare_set(ERROR_KEY, "", message)
        except Exception:  # the store itself is gone: nothing more to tell
            pass

    def peer_error(self, wait_s: float = 2.0) -> str | None:
        """The run's recorded error, waiting up to wait_s for one to appear (a peer that raised records it before it
        exits, so a collective broken by its exit finds it here)."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check([ERROR_KEY]):
                    value = self.store.get(ERROR_KEY).decode()
                    if value:
                        return value
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def run(self, fn: Callable[[], Any]) -> Any:
        """fn() with the error rules of a parallel run: an exception raised here is recorded as the run's error
        unless a peer recorded one first (then this rank's exception - typically a broken collective - is its
        consequence); either way it leaves as one ParallelError naming the failed rank."""
        try:
            return fn()
        except BaseException as e:
            if not self.is_parallel:
                raise
            first = self.peer_error(wait_s=0.0 if isinstance(e, ParallelError) else 2.0)
            if first is None:
                first = f"rank {self.rank} failed: {type(e).__name__}: {e}"
                if isinstance(e, FastRemoverError):
                    first = f"rank {self.rank}: {e}"
                self.report_error(first)
                first = self.peer_error(wait_s=0.0) or first
            raise ParallelError(first) from e

    # ------------------------------------------------------------------------------------------------------------
    # Collectives (all on this context's group; each is bounded by the group's timeout)

    def barrier_same(self, what: str, value: Any) -> None:
        """Start-up check that every rank sees the same `value` (options, model identity, input fingerprint): an
        all-gather of its sha256; a mismatch is an error naming the ranks that differ."""
        if not self.is_parallel:
            return
        import torch.distributed as dist

        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, digest, group=self.group)
        differ = [r for r, d in enumerate(gathered) if d != gathered[0]]
        if differ:
            raise FastRemoverError(f"ranks {differ} see different {what} than rank 0: every rank must get the same "
                                   "command line, model and inputs")

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.is_parallel:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def broadcast_tensor(self, t: torch.Tensor | None, shape=None, dtype=None) -> torch.Tensor:
        """Rank 0's tensor on every rank (others pass None with its shape and dtype, or None: then sent first)."""
        if not self.is_parallel:
            return t
        import torch.distributed as dist

        if shape is None:
            shape, dtype = self.broadcast_object((tuple(t.shape), t.dtype) if self.is_root else None)
        if self.is_root:
            buf = t.contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        wire = buf.view(torch.uint8) if buf.dtype.itemsize == 1 and buf.dtype != torch.uint8 else buf
        dist.broadcast(wire, src=0, group=self.group)
        return buf

    def agree(self, ok: bool) -> bool:
        """True on every rank when `ok` is True on every rank (one all-reduce; size 1: ok). Used where the ranks must
        take the same branch, e.g. all with CUDA graphs or all without (their collectives must match)."""
        if not self.is_parallel:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.all_reduce(flag, "max")
        return bool(flag.item() == 0.0)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the ranks; op "sum" or "max"."""
        if not self.is_parallel:
            return t
        import torch.distributed as dist

        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return t

    # ------------------------------------------------------------------------------------------------------------
    # The model hooks (see the module docstring)

    def token_range(self, total: int) -> tuple[int, int]:
        sizes = split_sizes(total, self.world_size)
        if min(sizes) < 1:
            raise FastRemoverError(f"{total} tokens cannot be split over {self.world_size} ranks")
        lo = sum(sizes[: self.rank])
        return lo, lo + sizes[self.rank]

    def shard_tokens(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        if not self.is_parallel:
            return x
        self.sequence_total = x.shape[dim]
        lo, hi = self.token_range(x.shape[dim])
        return x.narrow(dim, lo, hi - lo)

    def shard_rope(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [S, D/2] -> this rank's rows (contiguous: the kernels index rows by token)."""
        if not self.is_parallel:
            return rope
        return tuple(t.narrow(0, *self._lo_len(t.shape[0])).contiguous() for t in rope)

    def token_sizes(self, local: int, what: str = "ulysses_attention") -> list[int]:
        """Every rank's token count: the balanced split of the sequence shard_tokens recorded, checked against this
        rank's `local` count."""
        total = self.sequence_total
        if total is None:
            raise RuntimeError(f"{what}: no sequence length recorded (ParallelContext.shard_tokens records it)")
        sizes = split_sizes(total, self.world_size)
        if sizes[self.rank] != local:
            raise RuntimeError(f"rank {self.rank} holds {local} tokens, expected {sizes[self.rank]} of {total}")
        return sizes

    def _lo_len(self, total: int) -> tuple[int, int]:
        lo, hi = self.token_range(total)
        return lo, hi - lo

    def gather_tokens(self, y: torch.Tensor, total: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of y along `dim` -> all `total` tokens on every rank (rank order = token order)."""
        if not self.is_parallel:
            return y
        import torch.distributed as dist

        sizes = split_sizes(total, self.world_size)
        y = y.movedim(dim, 0).contiguous()
        pad = max(sizes) - y.shape[0]
        if pad:
            y = torch.cat([y, y.new_zeros((pad, *y.shape[1:]))])
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        t = time.perf_counter()
        dist.all_gather(parts, y, group=self.group)
        self.comm_seconds += time.perf_counter() - t
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).movedim(0, dim)

    def attention(self, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """fn(q, k, v) over the whole sequence: q/k/v/result [B, s_r, H, D] here, [B, S, H/N, D] inside fn."""
        if not self.is_parallel:
            return fn(q, k, v)
        return ulysses_attention(self, fn, q, k, v)

    def sequence_mean(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, s_r, N] -> the fp32 mean over all S tokens [B, N] (into `out`). Size 1: torch.mean (as before);
        parallel: the local fp32 sum, all-reduced, divided by S (another summation order: the last bits differ)."""
        if not self.is_parallel:
            return torch.mean(x, dim=1, dtype=torch.float32, out=out)
        # S is known on the host (every rank's share of the recorded sequence), so no device scalar is made here: a
        # host-to-device copy would end a CUDA graph capture. fp32(S) is exact, and so is the division's rounding.
        total = sum(self.token_sizes(x.shape[1], "sequence_mean"))
        local = torch.sum(x, dim=1, dtype=torch.float32)
        self.all_reduce(local)
        return torch.div(local, float(total), out=out)

    def quant_centred(self, v: torch.Tensor, tokens_per_batch: int):
        """V's 8-bit attention codes with statistics over the whole sequence: v [B*s_r, N] (any row stride) ->
        (codes e4m3 [B*s_r, N], scale [1] fp32, mean [B, N] fp32), the rule of quant.quant_fp8_centred with the
        mean and the amax of |v - mean| all-reduced (torch ops; the fused single-pass kernel needs all rows)."""
        from fastremover.fast.kernels.quant import quant_static_reference

        m, n = v.shape
        b = m // tokens_per_batch
        mean = self.sequence_mean(v.float().view(b, tokens_per_batch, n))
        amax = (v.float().view(b, tokens_per_batch, n) - mean.view(b, 1, n)).abs().amax().view(1)
        self.all_reduce(amax, "max")
        amax = amax.clamp_min(1e-12)
        codes = quant_static_reference(v, amax, mean, tokens_per_batch)
        return codes, amax / amax.new_full((), 448.0), mean



def set_parallel(model, ctx: ParallelHook) -> None:
    """Give an eager RemoverTransformer (and its attention modules) or a FastTransformer the context `ctx`."""
    model.parallel = ctx
    inner = getattr(model, "model", None)  # FastTransformer wraps the eager module
    for m in (model, inner) if inner is not None else (model,):
        m.parallel = ctx
        for block in getattr(m, "blocks", ()):
            block.attn1.parallel = ctx
