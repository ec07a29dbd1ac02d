"""The boundary between scheduling and execution is plain data: an engine whose model runner
lives in another process, reached only through pickled SchedulerOutputs and
ModelRunnerOutputs, generates exactly what the in-process engine does, through chunked
prefill, preemption (resumed requests are re-sent whole), n > 1, seeds and aborts."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest

from pagoda.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda.engine.loop.builder import build_engine
from pagoda.engine.loop.llm_engine import LLMEngine
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import SchedulerOutput
from pagoda.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(
    model=ModelConfig(dtype="float32", max_model_len=192),
    # 12 blocks of 16 tokens for 6 requests of up to ~110 tokens: preemption is certain.
    cache=CacheConfig(num_kv_blocks=12),
    scheduler=SchedulerConfig(max_num_batched_tokens=48),  # prompts are chunked
)
PROMPTS = [f"Tell me about {topic}. " + "Be precise. " * (i * 3)
           for i, topic in enumerate(["owls", "salt", "tea", "maps", "rain", "glass"])]


def serve_steps(config: EngineConfig, conn) -> None:
    """The worker: its own model runner, fed pickled SchedulerOutputs until an empty one."""
    runner = build_engine(config).runner
    conn.send_bytes(b"ready")
    while payload := conn.recv_bytes():
        scheduler_output = pickle.loads(payload)
        assert isinstance(scheduler_output, SchedulerOutput)
        conn.send_bytes(pickle.dumps(runner.execute_model(scheduler_output)))


class RemoteRunner:
    def __init__(self, conn) -> None:
        self.conn = conn
        self.num_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput):
        self.conn.send_bytes(pickle.dumps(scheduler_output))
        self.num_steps += 1
        return pickle.loads(self.conn.recv_bytes())


def generate(engine: LLMEngine) -> dict[str, list[list[int]]]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
    ]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params[i % 2])
    engine.add_request("aborted", "This one is cut short.", params[0])
    # a grammar: its bitmask rows cross the boundary too
    engine.add_request("choice", "Yes or no?", SamplingParams(
        temperature=1.0, seed=3, max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "perhaps so"])))
    finished = {}
    for step in range(1000):
        if step == 3:
            engine.abort_request("aborted")
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [c.token_ids for c in output.outputs]
        if not engine.has_unfinished_requests():
            break
    engine.step()  # delivers the last finished ids to the runner
    return finished


def test_a_runner_in_another_process_generates_the_same_tokens():
    local = build_engine(CONFIG)
    expected = generate(local)
    assert local.snapshot().num_preemptions > 0

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    worker = context.Process(target=serve_steps, args=(CONFIG, child), daemon=True)
    worker.start()
    try:
        assert parent.poll(300) and parent.recv_bytes() == b"ready"
        runner = RemoteRunner(parent)
        remote = LLMEngine(
            CONFIG, runner, local.tokenizer, local.eos_token_ids,
            max_model_len=local.max_model_len,
            num_blocks=local.snapshot().kv_group_num_blocks,
            kv_cache_windows=local.snapshot().kv_group_windows,
            vocab_size=local.vocab_size, grammar_compiler=local.grammar_compiler,
        )
        got = generate(remote)
        parent.send_bytes(b"")
    finally:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0
    assert runner.num_steps > len(PROMPTS)
    assert remote.snapshot().num_preemptions == local.snapshot().num_preemptions
    assert got == expected
    assert sorted(got) == sorted([f"r{i}" for i in range(len(PROMPTS))] + ["choice"])
    assert local.tokenizer.decode(got["choice"][0]) in ("yes", "no", "perhaps so")
    assert remote.snapshot().num_tracked_requests == 0
