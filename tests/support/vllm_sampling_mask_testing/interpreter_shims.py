"""Plain ``tl`` stand-ins for libdevice functions, which are ``None`` under TRITON_INTERPRET=1."""

import triton
import triton.language as tl


@triton.jit
def log1p(x):
    # Accurate for tiny |x| (Goldberg's trick). A naive log(1 + x) returns 0 for |x| < 2**-24,
    # which turns vLLM's Gumbel noise -log(-log1p(-u)) into +inf for small u: -inf + inf = NaN
    # on a masked token, and the interpreter's argmax then picks that masked token.
    y = 1.0 + x
    ratio = tl.where(y == 1.0, 1.0, x / (y - 1.0))
    return tl.where(y == 1.0, x, tl.log(y) * ratio)


@triton.jit
def isnan(x):
    return x != x
