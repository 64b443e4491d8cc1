"""MMQ split-K reduction: the second launch of RED_KERNEL, one thread per output.

When a GEMM (mmq_kernels.py `build_mmq_kernel`) splits K over several blocks with
RED_KERNEL, every block stores its raw partial sums at P[split, token, weight row] and
exits; this kernel sums them over the splits for every output in parallel and runs the
epilogue (x xscale, store / add / gated activation), so the reduction is spread over the
whole GPU instead of one block per tile. The launcher is in `mmq.py`, the plan in
`mmq_plan.py`, the lesson in docs/kernels/mmq.md.

Deliberately not here: the RED_LAST path (inside the GEMM kernel) and the epilogue's
activations (`_gate_act` in mmq_defs.py, shared with the GEMM's own epilogue).
"""
from numba import cuda, float32, uint32

from genie_rt.engine import kernel_cache

from .mmq_defs import EPI_ADD, EPI_STORE, GATED, U, _gate_act, _inline
from .pdl import hooks

REDUCE_THREADS = 256


def build_reduce_kernel(epi, pdl=False):
    """Return the `@cuda.jit` kernel reduce(ws, xscale, y, n_tok, rows_out, splits):

      ws      float32 [splits, N, rows_w]   raw partial sums from the GEMM (RED_KERNEL)
      xscale  float32 [N]                   prepare_x's per-token scale
      y       float32 [N, rows_out]         EPI_STORE: y = s * xscale; EPI_ADD: y += ...;
                                            EPI_SWIGLU: y = silu(g) * u, g from weight row
                                            r, u from row rows_out + r (rows_w = 2 rows_out)
    grid = (ceil(rows_out / REDUCE_THREADS), N), block = REDUCE_THREADS.
    Sums run in split order, so the result is the same on every run; the loads of four
    splits are issued before they are added (they are independent, the adds are not).
    pdl: the programmatic-dependent-launch build (sm_90+, quant/pdl.py): the next kernel may
    launch at once, and every thread waits for the GEMM before it before reading anything.
    """
    swiglu = epi in GATED
    wait, launch_dependents, _ = hooks(bool(pdl))
    gate_act = _gate_act(epi)

    @_inline
    def split_sum(ws, i, stride, splits):
        s = float32(0.0)
        sp = U(0)
        while sp + U(4) <= splits:
            a0 = ws[i + sp * stride]
            a1 = ws[i + (sp + U(1)) * stride]
            a2 = ws[i + (sp + U(2)) * stride]
            a3 = ws[i + (sp + U(3)) * stride]
            s = (((s + a0) + a1) + a2) + a3
            sp += U(4)
        while sp < splits:
            s += ws[i + sp * stride]
            sp += U(1)
        return s

    @cuda.jit
    def reduce(ws, xscale, y, n_tok_, rows_out_, splits_):
        launch_dependents()
        wait()                                           # PDL: ws is the GEMM's output
        r = uint32(cuda.blockIdx.x) * U(REDUCE_THREADS) + (uint32(cuda.threadIdx.x) & U(REDUCE_THREADS - 1))
        tok = uint32(cuda.blockIdx.y)
        rows_out = uint32(rows_out_)
        if r >= rows_out:
            return
        splits = uint32(splits_)
        rows_w = rows_out * U(2) if swiglu else rows_out
        stride = uint32(n_tok_) * rows_w
        i = tok * rows_w + r
        xs = xscale[tok]
        v = split_sum(ws, i, stride, splits) * xs
        if epi == EPI_STORE:
            y[tok, r] = v
        elif epi == EPI_ADD:
            y[tok, r] += v
        else:
            u = split_sum(ws, i + rows_out, stride, splits) * xs
            y[tok, r] = gate_act(v) * u
    return kernel_cache.attach(reduce)
