"""GPU checks of the substitutions (needs CuPy and a GPU): plans with fused attention, a split key
reduction and a fused llama training step run on CuPy and verify against NumPy; then one causal
attention (fp16, b 4, h 16, s 4096, e 64) through the executor, unfused vs fused, with the CuPy
memory pool's bytes after a run and the best of 3 CUDA-event times. The fused kernel here is the
executor's array-API code (online softmax over 512-key blocks), not a hand-written FlashAttention
kernel: the times compare the two graphs under one executor, not with cuDNN/FlashAttention.

    PYTHONPATH=. python3 scripts/gpu_check_substitutions.py   # writes $OUT/gpu_check.json if OUT is set
"""
import json
import math
import os

import cupy as cp
import numpy as np

from executor import verify
from executor.run import execute, random_inputs
from ir import workloads
from ir.builder import GraphBuilder
from ir.rewrites import fuse_attention, place, split, split_reduction
from ir.rewrites.substitute_attention import attention_sites
from ir.autodiff import training_step

out = {}
g = workloads.build("transformer", batch=2, seq=64, d_model=64, heads=4, d_ff=128)
h = fuse_attention(g, "attn_qk")
p = place(split(split_reduction(h, "attn_qk+attn_av", 4), "attn_qk+attn_av", "kb", 4), "attn_qk+attn_av", [0, 1, 2, 3])
out["transformer_fused_split_cupy"] = str(verify(p, reference=g, backend="cupy"))
l = workloads.build("llama", batch=2, seq=32, kv_heads=2)
lf = l
for s in attention_sites(l): lf = fuse_attention(lf, s)
out["llama_fused_cupy"] = str(verify(lf, reference=l, backend="cupy"))
st = training_step(lf, loss="cross_entropy", optimizer_params={"lr": 1.0})
ref = training_step(l, loss="cross_entropy", optimizer_params={"lr": 1.0})
out["llama_fused_train_step_cupy"] = str(verify(st, reference=ref, backend="cupy"))

def attn_program(b, h, s, e, dtype):
    gb = GraphBuilder(dtype)
    q, k, v = (gb.input(n, (b, h, s, e)) for n in "qkv")
    sc = gb.einsum(q, k, name="attn_qk", equation="bhse,bhte->bhst", alpha=1 / math.sqrt(e))
    sc = gb.causal_mask(sc, name="attn_mask")
    pr = gb.softmax(sc, name="attn_softmax")
    gb.einsum(pr, v, name="attn_av", equation="bhst,bhte->bhse")
    return gb.build()

B, H, S, E = 4, 16, 4096, 64
un = attn_program(B, H, S, E, "float16")
fu = fuse_attention(un, "attn_qk")
ins = {k: cp.asarray(v) for k, v in random_inputs(un, 0).items()}
pool = cp.get_default_memory_pool()
res = {}
for name, gr in (("unfused", un), ("fused", fu)):
    execute(gr, ins, "cupy"); cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base = pool.used_bytes()
    times = []
    for _ in range(3):
        s0, s1 = cp.cuda.Event(), cp.cuda.Event()
        s0.record(); env = execute(gr, ins, "cupy"); s1.record(); s1.synchronize()
        times.append(cp.cuda.get_elapsed_time(s0, s1) / 1e3)
        peak = pool.total_bytes()
        y = cp.asnumpy(env["attn_av.out"]).astype(np.float64)
        del env
        pool.free_all_blocks()
    res[name] = {"seconds_min": min(times), "pool_bytes_after_run": int(peak - base), "y": y}
err = float(np.max(np.abs(res["fused"]["y"] - res["unfused"]["y"])) / np.max(np.abs(res["unfused"]["y"])))
out["attention_fp16_b4_h16_s4096_e64"] = {k: {kk: vv for kk, vv in v.items() if kk != "y"} for k, v in res.items()}
out["attention_fp16_rel_err"] = err
out["scores_plus_probs_bytes"] = 2 * B * H * S * S * 2
out["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
print(json.dumps(out, indent=1))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1)
