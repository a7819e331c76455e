"""Fused bucket copies for sharded data parallelism: flatten / scatter / chunk layout, one launch each.

    import triton_kernels
    flat = triton_kernels.flatten(tensors, out=None, dtype=None, backend="auto")   # 1-D, in order, cast
    triton_kernels.scatter(flat, outs, backend="auto")                              # inverse, cast per out
    buf = triton_kernels.chunk_cat(tensors, num_chunks, out=None, dtype=None, backend="auto")  # rank-major
    triton_kernels.chunk_split(buf, outs, num_chunks, backend="auto")              # inverse of chunk_cat

backend: "auto" runs Triton on CUDA tensors and torch ops elsewhere; "triton" forces the kernels
(on CPU only under TRITON_INTERPRET=1); "torch" forces the fallback. Both give bit-identical results
(NaN payloads aside: see _copy.py). Supported dtypes: float32, bfloat16, float16, mixed freely.
No Lightning here, and triton itself is optional: it is imported only when a kernel runs.

Not to be confused with the `triton_kernels` package in Triton's own repository or the
`triton-kernels` distribution on PyPI; this one belongs to lightning-mics.
"""

from ._backend import BACKENDS, triton_available
from ._checks import SUPPORTED_DTYPES
from .api import chunk_cat, chunk_split, flatten, scatter

__all__ = ["BACKENDS", "SUPPORTED_DTYPES", "chunk_cat", "chunk_split", "flatten", "scatter", "triton_available"]
