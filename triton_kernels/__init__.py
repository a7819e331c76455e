"""Fused bucket copies for sharded data parallelism: flatten / scatter / chunk layout, one launch each.

    import lightning_mics_kernels
    flat = lightning_mics_kernels.flatten(tensors, out=None, dtype=None, backend="auto")   # 1-D, in order, cast
    lightning_mics_kernels.scatter(flat, outs, backend="auto")                              # inverse, cast per out
    buf = lightning_mics_kernels.chunk_cat(tensors, num_chunks, out=None, dtype=None, backend="auto")  # rank-major
    lightning_mics_kernels.chunk_split(buf, outs, num_chunks, backend="auto")              # inverse of chunk_cat

    qz = lightning_mics_kernels.quantize(tensors, block_size, num_chunks=1, residual=None, out=None, backend="auto")
    lightning_mics_kernels.dequantize(qz.wire, outs, block_size, num_chunks=1, backend="auto")  # int8 blocks -> floats
    part = lightning_mics_kernels.dequantize_sum(wire, num_chunks, block_size, out=None, backend="auto")  # fp32 sum
    (block-quantized int8 with fp32 scales for the slow hop: see quant_api.py and _quant_layout.py)

backend: "auto" runs Triton on CUDA tensors (the bucket copies from a size up: [Note: auto's size rule]
in _backend.py) and torch ops elsewhere; "triton" forces the kernels (on CPU only under
TRITON_INTERPRET=1); "torch" forces the fallback. Both give bit-identical results (NaN payloads aside:
see _copy.py). Supported dtypes: float32, bfloat16, float16, mixed freely. No Lightning here, and
triton itself is optional: it is imported only when a kernel runs.

    lightning_mics_kernels.table_stats()   # lookups, builds, per-call pointer copies of the kernels' descriptor tables
    (built once per bucket shape: [Note: descriptor tables] in _table.py; reset_table_stats() zeroes them)

Not to be confused with the `triton_kernels` package in Triton's own repository or the
`triton-kernels` distribution on PyPI; this one belongs to lightning-mics.
"""

from ._backend import AUTO_MIN_NUMEL, BACKENDS, triton_available, triton_unusable
from ._checks import SUPPORTED_DTYPES
from ._quant_layout import MAX_BLOCK_SIZE, QuantLayout, quant_layout, wire_views
from ._table import TableStats, reset_table_stats, table_stats
from .api import chunk_cat, chunk_split, flatten, scatter
from .quant_api import Quantized, dequantize, dequantize_sum, quantize

__all__ = ["AUTO_MIN_NUMEL", "BACKENDS", "MAX_BLOCK_SIZE", "QuantLayout", "Quantized", "SUPPORTED_DTYPES",
           "TableStats", "chunk_cat", "chunk_split", "dequantize", "dequantize_sum", "flatten", "quant_layout",
           "quantize", "reset_table_stats", "scatter", "table_stats", "triton_available", "triton_unusable",
           "wire_views"]
