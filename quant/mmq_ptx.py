"""fp16x2 arithmetic for the MMQ kernels: inline PTX with a simulator fallback.

Belongs in quant/ptx.py with the other inline PTX (that file has another owner; move
`hfma2` and `hfma2_reference` there on merge and import them from there).
"""
import numpy as np

from .ptx import SIMULATOR

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def hfma2(typingctx, a, b, c):
        """fma.rn.f16x2: (a.lo*b.lo + c.lo, a.hi*b.hi + c.hi) on packed half2 words."""
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(i32, [i32, i32, i32])
            asm = ir.InlineAsm(fnty, "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, list(args))
        return sig, codegen
else:
    def hfma2(a, b, c):
        """Simulator: f16x2 FMA; products of halves are exact in float64, one rounding."""
        def halves(x):
            return np.array([int(x) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            r = (halves(a) * halves(b) + halves(c)).astype(np.float16)
        return np.uint32(r.view(np.uint32)[0])


def hfma2_reference(a, b, c):
    """numpy reference of hfma2 on uint32 arrays (for tests)."""
    ha = np.asarray(a, np.uint32).view(np.float16).astype(np.float64)
    hb = np.asarray(b, np.uint32).view(np.float16).astype(np.float64)
    hc = np.asarray(c, np.uint32).view(np.float16).astype(np.float64)
    return (ha * hb + hc).astype(np.float16).view(np.uint32)
