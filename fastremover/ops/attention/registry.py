"""The attention backend registry: what each backend is, when it can run, and which one a mode picks.

A backend is one `AttentionBackend` record, registered by its own small module (one file per backend; adding one is
that file plus its import in `fastremover/ops/attention/__init__.py`). The record says:

* `call(q, k, v) -> o`: the stand-alone attention, q/k/v/o as [B, S, H, D] 16-bit tensors (any strides with a unit
  stride in D and rows of H*D contiguous values);
* `validate(device, dtype=None, shape=None) -> list[str]`: why it cannot run there (empty: it can), for the operands
  it is handed when given (dtype: the model's 16-bit dtype, or torch.float8_e4m3fn where the fast mode hands it
  e4m3 codes; shape: the model's (heads, head_dim)); the engine checks the model's before it builds anything;
* its capabilities, which the fast transformer reads instead of comparing names:
  - `takes_codes`: in the fast mode the transformer hands it e4m3 codes it quantized itself (q and k with static
    bounds, K and V centred) and `codes_call(q8, k8, v8, sq, sk, sv, out_dtype)` runs the kernel on them;
  - `output`: what `codes_call` returns: "fp8-codes" (e4m3 codes of (o - c) / sv, fed straight to the FP8 O
    projection) or "centred-16bit" ((o - c) in 16 bits, quantized again with a static scale);
  - `row_split_block_m`: the kernel's query-tile height when the transformer may split the partial last wave of
    tiles into a second call (None: no split);
  - `precision`: "16bit" or "8bit" attention math;
  - `token_layout`: sparse backends (sparse.py): `token_layout(grid, device, options) -> layout` for a (frames,
    rows, columns) token grid and the config's AttentionOptions; the transformer runs its tokens in the layout's
    order (`layout.permute(x)` / `layout.restore(x)`, RoPE tables `layout.rope(cos, sin)`) and passes `layout=` to
    `call` and `codes_call` (None: a dense backend, called without it);
  - `code_rows`: `code_rows(tokens, layout) -> rows` where `codes_call` reads its q/k/v codes past the sequence (a
    kernel that loads whole tiles): the fast transformer allocates each code buffer with that many rows per batch
    and hands over the first `tokens` (None: exactly `tokens`);
* `priority`: per engine mode, its rank for `--attention auto` (higher wins; a mode it lacks never picks it, and an
  explicit request for it in that mode is refused); `announce_if_skipped`: whether `auto` says so on a GPU when this
  backend is passed over for a lower one (when the fast mode ends up in 16 bits, every 8-bit backend passed over is
  named anyway: that note says why no FP8 attention runs).

`auto` in the fast mode (by priority): flashattn3-fp8, else cudnn-fp8, else sdpa in fp16 with that note (FlashInfer's
backends rank below sdpa there). The sparse backends (`sparse-*`) rank below sdpa in every mode:
only an explicit request runs them (they change the result).

No code outside this registry compares backend names. Names are canonical (`sdpa`, `flashinfer-fa3`,
`flashinfer-fa3-fp8`, `flashattn3-fp8`, `cudnn-fp8`, `sparse-sta`, `sparse-vsa`, `sparse-sta-cudnn`,
`sparse-vsa-cudnn`); the earlier names are aliases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from fastremover.errors import FastRemoverError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    label: str  # for notes: "FlashInfer's FA3 attention"
    call: Callable
    validate: Callable[..., list[str]]
    aliases: tuple[str, ...] = ()
    priority: Mapping[str, int] = field(default_factory=dict)
    precision: str = "16bit"  # "16bit" | "8bit"
    takes_codes: bool = False
    codes_call: Callable | None = None
    output: str = "16bit"  # codes_call's output: "fp8-codes" | "centred-16bit" (call() always returns 16-bit o)
    row_split_block_m: int | None = None
    announce_if_skipped: bool = True
    token_layout: Callable | None = None
    code_rows: Callable | None = None

    def __post_init__(self):
        if self.takes_codes and (self.codes_call is None or self.output not in ("fp8-codes", "centred-16bit")):
            raise ValueError(f"attention backend {self.name}: takes_codes needs codes_call and an output format")


_BACKENDS: dict[str, AttentionBackend] = {}
_ALIASES: dict[str, str] = {}


def register(backend: AttentionBackend) -> AttentionBackend:
    """Add a backend (its module calls this once at import). Names and aliases must be new."""
    for name in (backend.name, *backend.aliases):
        if name in _BACKENDS or name in _ALIASES or name == "auto":
            raise ValueError(f"attention backend name {name!r} is taken")
    _BACKENDS[backend.name] = backend
    for alias in backend.aliases:
        _ALIASES[alias] = backend.name
    return backend


def unregister(name: str) -> None:
    """Remove a backend (tests that register a temporary one)."""
    backend = _BACKENDS.pop(name)
    for alias in backend.aliases:
        _ALIASES.pop(alias, None)


def names(with_aliases: bool = False) -> list[str]:
    return [*_BACKENDS, *(_ALIASES if with_aliases else ())]


def canonical(name: str) -> str:
    """The canonical name of `name` (an alias or a name); FastRemoverError for an unknown one."""
    if name in _BACKENDS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    raise FastRemoverError(f"--attention {name!r}: unknown backend; choose one of {['auto', *names(True)]}")


def get(name: str) -> AttentionBackend:
    return _BACKENDS[canonical(name)]


def unavailable_reason(name: str, device: "torch.device") -> str | None:
    """None when backend `name` can run on `device`, else its validator's reasons in one line."""
    reasons = get(name).validate(device)
    return "; ".join(reasons) if reasons else None


def available(device: "torch.device") -> list[str]:
    return [name for name in _BACKENDS if unavailable_reason(name, device) is None]


def runnable(name: str, device: "torch.device", dtype=None, shape=None, *,
             fp8_activations: bool = False) -> AttentionBackend:
    """The backend, or FastRemoverError with its validator's reasons for the operands it gets when given: `dtype` the
    model's (16-bit) activations, `shape` its (heads, head_dim); `fp8_activations` (the fast mode's FP8 linears): a
    backend that takes codes is handed e4m3 codes (validated with dtype float8_e4m3fn), any other one 16-bit values
    (their dtype is not checked)."""
    backend = get(name)
    if fp8_activations:
        import torch

        dtype = torch.float8_e4m3fn if backend.takes_codes else None
    reasons = backend.validate(device, dtype=dtype, shape=shape) if (dtype, shape) != (None, None) else \
        backend.validate(device)
    why = "; ".join(reasons) if reasons else None
    if why is not None:
        raise FastRemoverError(f"attention backend {name!r} cannot run here: {why}")
    return backend


def choose(mode: str, device: "torch.device") -> tuple[str, list[str]]:
    """`--attention auto` for an engine mode: the runnable backend of highest priority, and notes. A note is given
    when the fast mode ends up without 8-bit attention (any device; it names every 8-bit backend passed over, each
    with its reasons, announced or not: why no FP8 attention runs), or, on a GPU, when backends marked
    `announce_if_skipped` were passed over (each named with its reasons)."""
    ranked = sorted((b for b in _BACKENDS.values() if mode in b.priority), key=lambda b: -b.priority[mode])
    skipped: list[tuple[AttentionBackend, str]] = []
    for backend in ranked:
        why = unavailable_reason(backend.name, device)
        if why is None:
            break
        skipped.append((backend, why))
    else:
        raise FastRemoverError(f"mode {mode}: no attention backend can run here")
    told = [(b, why) for b, why in skipped if b.announce_if_skipped]
    if mode == "fast" and backend.precision != "8bit":
        listed = "; ".join(f"{b.name}: {why}" for b, why in skipped if b.announce_if_skipped or b.precision == "8bit")
        return backend.name, [f"mode fast: 8-bit attention unavailable ({listed}); attention runs in fp16 "
                              f"({backend.name})"]
    if told and device.type == "cuda":
        listed = "; ".join(f"{b.label} is not used ({b.name}: {why})" for b, why in told)
        return backend.name, [f"mode {mode}: {listed}; attention runs {backend.label} ({backend.name})"]
    return backend.name, []


def resolve(attention: str, mode: str, device: "torch.device") -> tuple[str, list[str]]:
    """(canonical backend name, notes) for `--attention` in an already resolved engine mode: `auto` picks by
    priority; an explicit backend must belong to the mode and be able to run (an error otherwise: a run asked for
    fp8 attention must not silently get fp16)."""
    if attention == "auto":
        return choose(mode, device)
    backend = get(attention)
    if mode not in backend.priority:
        allowed = [b.name for b in _BACKENDS.values() if mode in b.priority]
        modes = " or ".join(m for m in backend.priority if m != "eager") or "exact or fast"
        raise FastRemoverError(f"--attention {attention}: not available in the {mode} mode (it runs {allowed}); "
                               f"use --mode {modes}")
    runnable(attention, device)
    return backend.name, []
