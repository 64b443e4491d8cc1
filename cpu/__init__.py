"""CPU kernels (Numba) that read quantized GGUF weights in place: the fast ops of the CPU back-end.

The ops a model file calls (all float32 activations, C-contiguous; every function
checks its arguments and raises ValueError/IndexError naming what is wrong):

    genie_rt.cpu.weights.CPUWeight.from_tensor(t)  a zero-copy view of a GGUF tensor's bytes
    genie_rt.cpu.linear.linear(x, w, out=None)     x [n, cols] @ W^T -> [n, rows]; every type
                                                   of quant/formats.py (Q4_0 .. Q6_K, F16, BF16, F32)
    genie_rt.cpu.attention.attention(q, k, v, k_scale, v_scale, start, scale, window=0, ring=0, out=None)
    genie_rt.cpu.attention.kv_write(k_new, v_new, k, v, k_scale, v_scale, start, ring=0)
    genie_rt.cpu.ops.rmsnorm(x, w, eps, out=None)  also per-head QK norm (x [n, heads, hd])
    genie_rt.cpu.ops.rope(x, cos, sin, neox=True)  in place; NeoX or normal pairs
    genie_rt.cpu.ops.silu_mul(g, u, out=None), gelu_tanh_mul(g, u, out=None)
    genie_rt.cpu.ops.embed(tokens, table, out=None, scale=None)
    genie_rt.cpu.topk.top_k(logits, k)            indices of the k largest, largest first
    genie_rt.cpu.threads.set_threads(n), get_threads()

(The functions are not re-exported here: `attention` and `linear` would shadow their
own modules.)

Properties every op keeps: the GIL is released while a kernel runs; each output
element is computed by the same operation sequence whatever the batch size n, its
place in the batch and the thread count (so prefix reuse and chunked prefill give the
same bits); kernels are compiled once per machine and loaded from numba's disk cache,
keyed by a hash of this package's sources (jit.py).

Files: weights.py (CPUWeight), simd.py and rowdot.py (LLVM IR primitives), linear.py
(references + launcher) and linear_kernels.py, attention.py, ops.py, threads.py,
topk.py, jit.py (decorator + cache), bench.py (`python -m genie_rt.cpu.bench`). Design,
numbers and roofline: docs/cpu-backend.md.

Importing a module compiles nothing: each kernel compiles (or loads from the cache) on
its first call.
"""
