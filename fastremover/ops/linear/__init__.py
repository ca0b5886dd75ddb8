"""Linear methods behind one registry (see registry.py): how the transformer's block linears are stored and what
activation format they read. Importing this package registers the built-in ones: `dense` (registry.py),
`fp8-rowwise` (fp8_rowwise.py, with its cuBLASLt GEMM in cublaslt.py), `nvfp4` and `nvfp4-w4a4` (nvfp4.py)."""

from fastremover.ops.linear import fp8_rowwise, nvfp4  # noqa: F401
from fastremover.ops.linear.registry import (  # noqa: F401
    ACT_16BIT,
    ACT_FP8_ROWWISE,
    ACTIVATION_FORMATS,
    DenseLinear,
    Fp8Activation,
    LinearLayer,
    LinearMethod,
    get,
    names,
    register,
    unregister,
)
