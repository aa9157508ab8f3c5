"""ffpa_cute: exact attention for large head dims (D > 256), CuTe-DSL kernels behind SDPA's API.

Importing is cheap on purpose: cutlass and the kernel families load on the first kernel call.
`ffpa_cute.options` holds what a caller may switch (`Options`, `options.use(...)`);
`merge_attention` combines (out, lse) pairs over disjoint key sets; `varlen_attention` (packed
sequences) and `attention_with_kvcache` (contiguous or paged cache, decode and chunked prefill)
take FlashAttention's conventions; context parallelism (ring and Ulysses attention over
torch.distributed) is `ffpa_cute.distributed`, imported on its own.
"""

from . import options
from .fp8 import quantize_fp8
from .interface import attention, explain
from .sdpa_patch import patch_sdpa, unpatch_sdpa
from .kvcache import attention_with_kvcache
from .merge import merge_attention
from .nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from .options import Options
from .varlen import varlen_attention

__version__ = "0.1.0"

__all__ = ["NVFP4Tensor", "Options", "attention", "attention_with_kvcache", "dequantize_nvfp4",
           "explain", "merge_attention", "options", "patch_sdpa", "quantize_fp8",
           "quantize_nvfp4", "unpatch_sdpa", "varlen_attention", "__version__"]
