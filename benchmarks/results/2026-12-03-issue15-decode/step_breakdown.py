"""Where a decode step goes: python step_breakdown.py FILE.gguf (kernel call, head, the rest)"""
import time, sys, torch
from pagoda import LLM, SamplingParams
from pagoda.executor.models import llama_decode_kernel as ldk
llm = LLM(model=sys.argv[1], kv_cache_memory=1<<28, max_model_len=2048)
engine = llm.engine
params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
engine.add_request("a", [100+j for j in range(128)], params)
for _ in range(60): engine.step()
k = engine.runner.model.model.decode_kernel
orig = ldk.LlamaDecodeKernel.forward
times=[]
def timed(self, ids, pos):
    t=time.perf_counter(); r=orig(self, ids, pos); times.append(time.perf_counter()-t); return r
ldk.LlamaDecodeKernel.forward = timed
head=[]
m=engine.runner.model
oh=type(m).head_logits
def th(self, h):
    t=time.perf_counter(); r=oh(self,h); head.append(time.perf_counter()-t); return r
type(m).head_logits=th
t=time.perf_counter()
for _ in range(200): engine.step()
tot=(time.perf_counter()-t)/200
import statistics as st
print(f"step {tot*1e3:.2f} ms, kernel {st.median(times)*1e3:.2f} ms, head {st.median(head)*1e3:.2f} ms, rest {(tot-st.mean(times)-st.mean(head))*1e3:.2f} ms")
