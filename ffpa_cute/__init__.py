"""ffpa_cute: exact attention for large head dims (D > 256), CuTe-DSL kernels behind SDPA's API.

Importing is cheap on purpose: cutlass and the kernel families load on the first kernel call.
`ffpa_cute.options` holds what a caller may switch (`Options`, `options.use(...)`).
"""

from . import options
from .fp8 import quantize_fp8
from .interface import attention, explain, patch_sdpa, unpatch_sdpa
from .options import Options

__version__ = "0.1.0"

__all__ = ["Options", "attention", "explain", "options", "patch_sdpa", "quantize_fp8",
           "unpatch_sdpa", "__version__"]
