"""Inline PTX through numba intrinsics: the device implementations of quant/ptx.py's
intrinsics (tensor-core mma, ldmatrix, cp.async, 128-bit read-only loads, dp4a, f16x2 FMA,
f16 packing). Callable only from `@cuda.jit` code; imported by ptx.py when the simulator
is off (under the simulator ptx_fallbacks.py stands in, with the same names).

Each intrinsic checks its argument types while numba types the call (a clear TypingError
instead of bad PTX) and emits one `llvmlite.ir.InlineAsm`. Fragment layouts and
constraints: docs/ptx-intrinsics.md.
"""
from llvmlite import ir
from numba import cuda, types
from numba.core.errors import TypingError
from numba.cuda import cgutils, libdevice
from numba.cuda.extending import intrinsic

_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
_f32 = ir.FloatType()


def _asm(builder, retty, argtys, text, constraints, args, side_effect=False):
    fnty = ir.FunctionType(retty, argtys)
    asm = ir.InlineAsm(fnty, text, constraints, side_effect=side_effect)
    return builder.call(asm, args)


def _struct_to_tuple(context, builder, restype, st, n):
    vals = [builder.extract_value(st, k) for k in range(n)]
    return context.make_tuple(builder, restype, vals)


def _check_ints(name, **tys):
    for argname, ty in tys.items():
        if not isinstance(ty, types.Integer):
            raise TypingError(f"{name}: {argname} must be an integer, got {ty}")


def _check_index(name, arrty, idxty):
    if not isinstance(arrty, types.Array):
        raise TypingError(f"{name}: expected an array, got {arrty}")
    if isinstance(idxty, types.BaseTuple):
        if len(idxty) != arrty.ndim or not all(isinstance(t, types.Integer) for t in idxty):
            raise TypingError(f"{name}: index {idxty} does not match a {arrty.ndim}-d array")
    elif not (isinstance(idxty, types.Integer) and arrty.ndim == 1):
        raise TypingError(f"{name}: index must be an integer for a 1-d array or a tuple "
                          f"of {arrty.ndim} integers, got {idxty}")


def _elem_ptr(context, builder, arrty, arr, idxty, idx):
    """Generic pointer to arr[idx] (no bounds check, no negative wrap-around)."""
    ary = context.make_array(arrty)(context, builder, value=arr)
    if isinstance(idxty, types.BaseTuple):
        vals = cgutils.unpack_tuple(builder, idx, len(idxty))
        tys = list(idxty)
    else:
        vals, tys = [idx], [idxty]
    vals = [context.cast(builder, v, t, types.intp) for v, t in zip(vals, tys)]
    return cgutils.get_item_pointer(context, builder, arrty, ary, vals, wraparound=False)


def _shared_addr32(builder, ptr):
    """Generic pointer -> 32-bit .shared address (CUDA's __cvta_generic_to_shared)."""
    sp = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=3))
    return builder.ptrtoint(sp, _i32)


def _global_addr64(builder, ptr):
    """Generic pointer -> 64-bit .global address (cvta.to.global)."""
    gp = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=1))
    return builder.ptrtoint(gp, _i64)


# ---- tensor-core mma -----------------------------------------------------------
_MMA_OPERANDS = "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"


@intrinsic
def mma_f16_f32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A(16x16 f16, row) * B(16x8 f16, col) + C(16x8 f32), one warp; see frag_a_f16."""
    _check_ints("mma_f16_f32", a0=a0, a1=a1, a2=a2, a3=a3, b0=b0, b1=b1)
    for ty in (c0, c1, c2, c3):
        if not isinstance(ty, (types.Float, types.Integer)):
            raise TypingError(f"mma_f16_f32: accumulators must be float32, got {ty}")
    sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

    def codegen(context, builder, sig, args):
        st = _asm(builder, ir.LiteralStructType([_f32] * 4), [_i32] * 6 + [_f32] * 4,
                  "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " + _MMA_OPERANDS,
                  "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", list(args))
        return _struct_to_tuple(context, builder, sig.return_type, st, 4)
    return sig, codegen


@intrinsic
def mma_s8_s32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A(16x32 s8, row) * B(32x8 s8, col) + C(16x8 s32), one warp; see frag_a_s8."""
    _check_ints("mma_s8_s32", a0=a0, a1=a1, a2=a2, a3=a3, b0=b0, b1=b1,
                c0=c0, c1=c1, c2=c2, c3=c3)
    sig = types.UniTuple(types.int32, 4)(*([types.uint32] * 6 + [types.int32] * 4))

    def codegen(context, builder, sig, args):
        st = _asm(builder, ir.LiteralStructType([_i32] * 4), [_i32] * 10,
                  "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 " + _MMA_OPERANDS,
                  "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", list(args))
        return _struct_to_tuple(context, builder, sig.return_type, st, 4)
    return sig, codegen


@intrinsic
def mma_s8_k16(typingctx, a0, a1, b0, c0, c1, c2, c3):
    """D = A(16x16 s8, row) * B(16x8 s8, col) + C(16x8 s32), one warp: a0 = (g, 4t..4t+3),
    a1 = (g + 8, 4t..), b0 = (k 4t..4t+3, n g) - m16n8k32's first half (a2 = a3 = b1 = 0). For
    weights whose scales cover 16 values (Q6_K: quant/gemv_mma_q6k.py)."""
    _check_ints("mma_s8_k16", a0=a0, a1=a1, b0=b0, c0=c0, c1=c1, c2=c2, c3=c3)
    sig = types.UniTuple(types.int32, 4)(*([types.uint32] * 3 + [types.int32] * 4))

    def codegen(context, builder, sig, args):
        st = _asm(builder, ir.LiteralStructType([_i32] * 4), [_i32] * 7,
                  "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {$0,$1,$2,$3}, {$4,$5}, {$6}, "
                  "{$7,$8,$9,$10};", "=r,=r,=r,=r,r,r,r,r,r,r,r", list(args))
        return _struct_to_tuple(context, builder, sig.return_type, st, 4)
    return sig, codegen


# ---- ldmatrix ------------------------------------------------------------------
def _make_ldmatrix(num, trans):
    name = f"ldmatrix_x{num}" + ("_trans" if trans else "")
    outs = ",".join(f"${k}" for k in range(num))
    text = (f"ldmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 "
            f"{{{outs}}}, [${num}];")
    cons = ",".join(["=r"] * num + ["r", "~{memory}"])

    def typer(typingctx, smem, idx):
        _check_index(name, smem, idx)
        rt = types.uint32 if num == 1 else types.UniTuple(types.uint32, num)

        def codegen(context, builder, sig, args):
            p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            addr = _shared_addr32(builder, p)
            if num == 1:
                return _asm(builder, _i32, [_i32], text, cons, [addr], side_effect=True)
            st = _asm(builder, ir.LiteralStructType([_i32] * num), [_i32], text, cons,
                      [addr], side_effect=True)
            return _struct_to_tuple(context, builder, sig.return_type, st, num)
        return rt(smem, idx), codegen
    typer.__name__ = name
    typer.__doc__ = (f"{name}(smem, idx): warp-wide {text.split()[0]}; this lane supplies "
                     f"the address of smem[idx] (16-byte aligned row of 8 b16).")
    return intrinsic(typer)


ldmatrix_x1 = _make_ldmatrix(1, False)
ldmatrix_x2 = _make_ldmatrix(2, False)
ldmatrix_x4 = _make_ldmatrix(4, False)
ldmatrix_x1_trans = _make_ldmatrix(1, True)
ldmatrix_x2_trans = _make_ldmatrix(2, True)
ldmatrix_x4_trans = _make_ldmatrix(4, True)


# ---- cp.async ------------------------------------------------------------------
@intrinsic
def cp_async16(typingctx, dst_smem, di, src_glob, si):
    """Asynchronous 16-byte copy global src_glob[si] -> shared dst_smem[di] (cp.async.cg)."""
    _check_index("cp_async16", dst_smem, di)
    _check_index("cp_async16", src_glob, si)

    def codegen(context, builder, sig, args):
        d = _shared_addr32(builder, _elem_ptr(context, builder, sig.args[0], args[0],
                                              sig.args[1], args[1]))
        s = _global_addr64(builder, _elem_ptr(context, builder, sig.args[2], args[2],
                                              sig.args[3], args[3]))
        _asm(builder, ir.VoidType(), [_i32, _i64],
             "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", [d, s],
             side_effect=True)
        return context.get_dummy_value()
    return types.void(dst_smem, di, src_glob, si), codegen


@intrinsic
def cp_async16_zfill(typingctx, dst_smem, di, src_glob, si, src_bytes):
    """cp_async16 reading only src_bytes (0..16) bytes; the rest of the 16 is zero-filled."""
    _check_index("cp_async16_zfill", dst_smem, di)
    _check_index("cp_async16_zfill", src_glob, si)
    _check_ints("cp_async16_zfill", src_bytes=src_bytes)
    sig = types.void(dst_smem, di, src_glob, si, types.uint32)

    def codegen(context, builder, sig, args):
        d = _shared_addr32(builder, _elem_ptr(context, builder, sig.args[0], args[0],
                                              sig.args[1], args[1]))
        s = _global_addr64(builder, _elem_ptr(context, builder, sig.args[2], args[2],
                                              sig.args[3], args[3]))
        _asm(builder, ir.VoidType(), [_i32, _i64, _i32],
             "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
             [d, s, args[4]], side_effect=True)
        return context.get_dummy_value()
    return sig, codegen


def _make_void_asm(name, text, doc):
    def typer(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()
        return types.void(), codegen
    typer.__name__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


cp_async_commit = _make_void_asm(
    "cp_async_commit", "cp.async.commit_group;",
    "Close the current group of cp.async copies issued by this thread.")
cp_async_wait_all = _make_void_asm(
    "cp_async_wait_all", "cp.async.wait_all;",
    "Wait until all of this thread's cp.async copies have landed (no syncthreads implied).")
cp_async_wait_group_0 = _make_void_asm(
    "cp_async_wait_group_0", "cp.async.wait_group 0;", "cp.async.wait_group 0")
cp_async_wait_group_1 = _make_void_asm(
    "cp_async_wait_group_1", "cp.async.wait_group 1;", "cp.async.wait_group 1")
cp_async_wait_group_2 = _make_void_asm(
    "cp_async_wait_group_2", "cp.async.wait_group 2;", "cp.async.wait_group 2")

# Programmatic dependent launch (PTX 7.8, sm_90+ only: never in a kernel built for sm_80/87;
# quant/pdl.py says how a kernel is launched so that they matter)
griddep_wait = _make_void_asm(
    "griddep_wait", "griddepcontrol.wait;",
    "Wait until the grids this one depends on have completed and their writes are visible "
    "(a no-op for a kernel launched without programmatic stream serialization).")
griddep_launch_dependents = _make_void_asm(
    "griddep_launch_dependents", "griddepcontrol.launch_dependents;",
    "Allow the next kernel on the stream (launched with programmatic stream serialization) "
    "to start once every block of this grid has said so or exited.")


@intrinsic
def cp_async_wait_group(typingctx, n):
    """Wait until at most n of this thread's committed cp.async groups are pending.

    n must be a compile-time integer literal (an immediate in PTX)."""
    if not isinstance(n, types.IntegerLiteral):
        # numba also tries the literal type when the argument is a constant
        raise TypingError("cp_async_wait_group(n): n must be an integer literal written "
                          "at the call (it is a PTX immediate), e.g. "
                          "cp_async_wait_group(1); or use cp_async_wait_group_0/_1/_2")
    count = int(n.literal_value)
    if not 0 <= count <= 7:
        raise TypingError(f"cp_async_wait_group: n must be 0..7, got {count}")

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {count};", "~{memory}", [],
             side_effect=True)
        return context.get_dummy_value()
    return types.void(n), codegen


# ---- 128-bit read-only global load ---------------------------------------------
_LDG_TYPES = {types.uint32: ("u32", "r"), types.int32: ("s32", "r"),
              types.float32: ("f32", "f")}


def _make_ld_v4(name: str, cache: str, side_effect: bool, n: int = 4):
    """A 16-byte (n = 4) or 8-byte (n = 2) vector load intrinsic: (arr[idx], .., arr[idx+n-1])
    by one ld.global<cache>.v<n> (aligned to its size; uint32, int32 or float32 arrays)."""
    def ld_v4(typingctx, arr, idx):
        _check_index(name, arr, idx)
        if arr.dtype not in _LDG_TYPES:
            raise TypingError(f"{name}: array dtype must be uint32, int32 or float32, got "
                              f"{arr.dtype}; view the buffer as uint32 on the host")
        ptx_ty, letter = _LDG_TYPES[arr.dtype]
        outs = ",".join(f"${i}" for i in range(n))
        text = f"ld.global{cache}.v{n}.{ptx_ty} {{{outs}}}, [${n}];"
        cons = ",".join([f"={letter}"] * n) + ",l"

        def codegen(context, builder, sig, args):
            p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            lty = context.get_value_type(sig.args[0].dtype)
            st = _asm(builder, ir.LiteralStructType([lty] * n), [_i64], text, cons,
                      [_global_addr64(builder, p)], side_effect=side_effect)
            return _struct_to_tuple(context, builder, sig.return_type, st, n)
        return types.UniTuple(arr.dtype, n)(arr, idx), codegen
    ld_v4.__name__ = name
    return intrinsic(ld_v4)


# Read-only data (weights, and activations of a plain launch): the non-coherent path, which
# the compiler may move freely - the data must not change while the kernel runs.
ldg_v4 = _make_ld_v4("ldg_v4", ".nc", side_effect=False)
# Data another kernel may still be writing when this one starts (a programmatic-dependent-
# launch build's activations, read after griddepcontrol.wait): a coherent load, kept in its
# place by the compilers (volatile asm: LLVM does not move it above the wait; ptxas does not
# move an ordinary load above griddepcontrol.wait, where it may an .nc load, whose data it
# may assume unchanging for the kernel's lifetime).
ld_v4 = _make_ld_v4("ld_v4", "", side_effect=True)
# Weights a programmatic-dependent-launch build loads BEFORE griddepcontrol.wait, to overlap them
# with the kernel before: not ldg_v4. ptxas (12.9 and 13.0, sm_90) schedules an ld.global.nc next to
# its use - below the wait, so the weight stream starts only once the kernel before has finished
# (the SASS: LDG.E.128.CONSTANT after ACQBULK; tests/test_pdl_sass.py). An ordinary load stays
# where it is, and volatile asm keeps LLVM from moving it. L1::no_allocate: a weight is streamed
# once; L1 keeps the activations every warp reads.
ldw_v4 = _make_ld_v4("ldw_v4", ".L1::no_allocate", side_effect=True)
ldw_v2 = _make_ld_v4("ldw_v2", ".L1::no_allocate", side_effect=True, n=2)     # 8 bytes of the same
# 8 bytes of read-only data: two words by one ld.global.nc.v2 (the int8 tensor-core GEMV's A and B
# fragments, quant/gemv_mma_k.py)
ldg_v2 = _make_ld_v4("ldg_v2", ".nc", side_effect=False, n=2)
# 8 bytes another kernel may still be writing (the PDL builds of those GEMVs' activations): ld_v4's rule
ld_v2 = _make_ld_v4("ld_v2", "", side_effect=True, n=2)


# ---- coherent scalar load -------------------------------------------------------
def _ld_relaxed(name: str, nb_type, ir_type, ptx_type: str, letter: str):
    """The intrinsic `name(arr, idx)`: arr[idx] of an nb_type array by one
    ld.relaxed.gpu.global.<ptx_type>, volatile asm with a memory clobber."""
    text = f"ld.relaxed.gpu.global.{ptx_type} $0, [$1];"

    def ld_relaxed(typingctx, arr, idx):
        _check_index(name, arr, idx)
        if arr.dtype != nb_type:
            raise TypingError(f"{name}: array dtype must be {nb_type}, got {arr.dtype}")

        def codegen(context, builder, sig, args):
            p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return _asm(builder, ir_type, [_i64], text, f"={letter},l,~{{memory}}",
                        [_global_addr64(builder, p)], side_effect=True)
        return nb_type(arr, idx), codegen
    ld_relaxed.__name__ = ld_relaxed.__qualname__ = name
    return ld_relaxed


ld_relaxed_f32 = intrinsic(_ld_relaxed("ld_relaxed_f32", types.float32, _f32, "f32", "f"))
ld_relaxed_f32.__doc__ = """arr[idx] (float32) by ld.relaxed.gpu.global: a load that sees what other blocks of the
same launch stored and made visible with a fence (threadfence before an atomic the
reader observed), bypassing the SM's non-coherent L1. Emitted as volatile asm with a
memory clobber, so the compiler keeps it after the barrier and atomic that precede it
and never merges it with an earlier load."""
ld_relaxed_i32 = intrinsic(_ld_relaxed("ld_relaxed_i32", types.int32, _i32, "s32", "r"))
ld_relaxed_i32.__doc__ = """arr[idx] (int32) by ld.relaxed.gpu.global: ld_relaxed_f32's load for a counter that
other blocks of the same launch advance with atomics (a grid barrier's spin)."""


# ---- integer dot product -------------------------------------------------------
@intrinsic
def dp4a(typingctx, a, b, c):
    """c + sum of the 4 signed-byte products of a and b (dp4a.s32.s32), as int32."""
    _check_ints("dp4a", a=a, b=b, c=c)

    def codegen(context, builder, sig, args):
        return _asm(builder, _i32, [_i32] * 3, "dp4a.s32.s32 $0, $1, $2, $3;",
                    "=r,r,r,r", list(args))
    return types.int32(types.int32, types.int32, types.int32), codegen


@intrinsic
def hfma2(typingctx, a, b, c):
    """fma.rn.f16x2 on packed half2 words: (a.lo*b.lo + c.lo, a.hi*b.hi + c.hi)."""
    _check_ints("hfma2", a=a, b=b, c=c)

    def codegen(context, builder, sig, args):
        return _asm(builder, _i32, [_i32] * 3, "fma.rn.f16x2 $0, $1, $2, $3;",
                    "=r,r,r,r", list(args))
    return types.uint32(types.uint32, types.uint32, types.uint32), codegen


# ---- f16 packing ---------------------------------------------------------------
@intrinsic
def pack_half2(typingctx, lo, hi):
    """uint32 holding f16(lo) in bits 0..15 and f16(hi) in bits 16..31 (round to nearest even)."""
    def codegen(context, builder, sig, args):
        # cvt.rn.f16x2.f32 d, a, b puts a in the UPPER half: pass hi first.
        return _asm(builder, _i32, [_f32, _f32], "cvt.rn.f16x2.f32 $0, $2, $1;",
                    "=r,f,f", list(args))
    return types.uint32(types.float32, types.float32), codegen


@intrinsic
def unpack_half2(typingctx, h2):
    """(f32 of bits 0..15, f32 of bits 16..31) of a packed half2 word."""
    _check_ints("unpack_half2", h2=h2)

    def codegen(context, builder, sig, args):
        st = _asm(builder, ir.LiteralStructType([_f32, _f32]), [_i32],
                  "{ .reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\t"
                  "cvt.f32.f16 $0, lo;\n\tcvt.f32.f16 $1, hi; }",
                  "=f,=f,r", list(args))
        return _struct_to_tuple(context, builder, sig.return_type, st, 2)
    return types.UniTuple(types.float32, 2)(types.uint32), codegen


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """float32 value of the IEEE half whose bits are the low 16 bits of `bits` (cvt.f32.f16)."""
    _check_ints("f16_bits_to_f32", bits=bits)

    def codegen(context, builder, sig, args):
        return _asm(builder, _f32, [_i32],
                    "{ .reg .b16 h;\n\tcvt.u16.u32 h, $1;\n\tcvt.f32.f16 $0, h; }",
                    "=f,r", list(args))
    return types.float32(types.uint32), codegen


@intrinsic
def bits_to_f32(typingctx, bits):
    """The float32 whose bits are the uint32 `bits` (mov.b32: a reinterpretation;
    bf16 weights are the high 16 bits of a float32)."""
    _check_ints("bits_to_f32", bits=bits)

    def codegen(context, builder, sig, args):
        return _asm(builder, _f32, [_i32], "mov.b32 $0, $1;", "=f,r", list(args))
    return types.float32(types.uint32), codegen


# ---- a product rounded on its own ------------------------------------------------
@cuda.jit(device=True)
def mul_rn(a, b):
    """a * b rounded to float32 by itself (libdevice's fmul_rn: mul.rn.f32), which NVVM never
    contracts with a following add into one FMA - for kernels whose bits must be a numpy
    reference's (the embedding's dequantization, rmsnorm_q8k's rounding)."""
    return libdevice.fmul_rn(a, b)
