"""One thread, one packed 576 -> 3072 weight of a GGUF type, 1 row: OMP_NUM_THREADS=1 python micro_matmul.py q5"""
import time, sys, torch, numpy as np
from pagoda.executor.kernels.packed_weight import gemm_packed, PackedWeight
from pagoda.executor.loader.gguf_packing import pack_gguf
import gguf
fmt = sys.argv[1]
Q = gguf.GGMLQuantizationType
qt = {"q5": Q.Q5_0, "q4": Q.Q4_1, "q4k": Q.Q4_K, "q6k": Q.Q6_K, "q8": Q.Q8_0}[fmt]
N, K = 3072, 768 if fmt in ("q4k","q6k") else 576
w = np.random.randn(N, K).astype(np.float32)
raw = gguf.quants.quantize(w, qt)
import inspect
pw = pack_gguf(raw, qt, (N, K)) if 'shape' in str(inspect.signature(pack_gguf)) else pack_gguf(raw, qt)
x = torch.randn(1, K)
for _ in range(20): gemm_packed(x, pw)
n=2000
t=time.perf_counter()
for _ in range(n): gemm_packed(x, pw)
dt=(time.perf_counter()-t)/n
print(fmt, f"{dt*1e6:.1f} us", f"{N*K/dt/1e9:.1f} Gw/s")
