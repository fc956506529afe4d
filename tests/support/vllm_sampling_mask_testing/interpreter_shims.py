"""Plain ``tl`` stand-ins for libdevice functions, which are ``None`` under TRITON_INTERPRET=1."""

import triton
import triton.language as tl


@triton.jit
def log1p(x):
    return tl.log(1.0 + x)


@triton.jit
def isnan(x):
    return x != x
