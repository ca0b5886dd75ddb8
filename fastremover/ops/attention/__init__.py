"""Attention backends behind one registry (see registry.py). Importing this package registers the built-in ones."""

from fastremover.ops.attention import cudnn_fp8, flashattn3_fp8, flashinfer_fa3, sdpa, sparse  # noqa: F401
from fastremover.ops.attention.registry import (  # noqa: F401
    AttentionBackend,
    available,
    canonical,
    choose,
    get,
    names,
    register,
    resolve,
    runnable,
    unavailable_reason,
    unregister,
)
