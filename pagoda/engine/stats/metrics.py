"""Prometheus metrics of one engine, named after vLLM's with the `pagoda:` prefix.

Every metric lives in the registry given (one per server, so that tests can run several
servers or engines in one process). Whoever drives the engine (the async engine's thread, a
benchmark loop) calls `record_step(outputs)` after each `step()`, and `update(snapshot)`
with the engine's EngineSnapshot after each step or abort: gauges read it, and counters
follow its running totals, so nothing is counted twice however often `update` runs.

    gauges      pagoda:num_requests_running, pagoda:num_requests_waiting,
                pagoda:kv_cache_usage_perc (0..1, as vLLM),
                pagoda:lora_requests_info{running_lora_adapters, waiting_lora_adapters,
                max_lora} (vLLM's: the adapters' names comma-joined, value the time of the
                update; one sample, the current label set, only with --enable-lora)
    counters    pagoda:prompt_tokens_total, pagoda:generation_tokens_total,
                pagoda:prefix_cache_queries_total, pagoda:prefix_cache_hits_total (tokens),
                pagoda:num_preemptions_total, pagoda:request_success_total{finished_reason}
                (per sequence: a request with n=2 counts twice, as in vLLM v1),
                pagoda:structured_output_requests_total (requests with a JSON schema, regex,
                choice or grammar), pagoda:grammar_compile_seconds_total (compiling them),
                pagoda:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
                ..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position}
                (speculative decoding, as vLLM's); with KV tiers, kv_offload_metrics.py's
                series (per tier: hits, misses, bytes written and read, evictions; ...)
    histograms  pagoda:time_to_first_token_seconds, pagoda:inter_token_latency_seconds,
                pagoda:e2e_request_latency_seconds, pagoda:request_queue_time_seconds,
                pagoda:request_time_per_output_token_seconds (TPOT: per finished sequence
                of 2+ tokens, (last token - first token) / (tokens - 1), as vLLM's)
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagoda.engine.stats.kv_offload_metrics import KVOffloadMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.outputs import RequestOutput

# No `*_created` timestamp samples: vLLM's /metrics has none, and they double the output.
disable_created_metrics()

PREFIX = "pagoda:"

_LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_TOKEN_GAP_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 extra_labels: dict[str, str] | None = None) -> None:
        """`extra_labels`: more labels on every sample, e.g. {"replica": "0"} for one
        replica of a data-parallel server (pagoda/engine/data_parallel/metrics.py)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        extra_labels = extra_labels or {}
        self._labels = ["model_name", *extra_labels]
        self._label_values = (model_name, *extra_labels.values())
        self._register_state_gauges()
        self._register_token_counters()
        self._register_structured_output_counters()
        self._register_spec_decode_counters()
        self._register_finish_and_step_counters()
        self._register_latency_histograms()
        self._register_lora_info()
        self._kv_offload: KVOffloadMetrics | None = None
        """The KV tiers' series, registered with the first snapshot that has tiers."""
        # Engine totals at the previous update (counters advance by the difference).
        self._totals: dict[str, float] = {}
        self._finished_by_reason: dict[str, int] = {}
        # Per request / sequence state for the latency histograms.
        self._first_token_seen: set[str] = set()
        self._last_token_time: dict[tuple[str, int], float] = {}
        # (first token time, tokens so far) per sequence, for TPOT.
        self._seq_tokens: dict[tuple[str, int], tuple[float, int]] = {}

    # ---- the metric families ---------------------------------------------------------------

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, self._labels,
                     registry=self.registry).labels(*self._label_values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, self._labels,
                       registry=self.registry).labels(*self._label_values)

    def _counter_by(self, name: str, doc: str, label: str) -> Counter:
        """A counter with one more label (its children made as values appear)."""
        return Counter(PREFIX + name, doc, [*self._labels, label], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        return Histogram(PREFIX + name, doc, self._labels, buckets=buckets,
                         registry=self.registry).labels(*self._label_values)

    def _register_state_gauges(self) -> None:
        """The queue and the KV cache now."""
        gauge = self._gauge
        self.num_requests_running = gauge("num_requests_running", "Sequences running in the batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to run.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100 percent)."
        )
        self.num_kv_blocks = gauge("num_kv_blocks", "KV-cache blocks in all.")
        self.num_kv_blocks_held = gauge(
            "num_kv_blocks_held", "KV-cache blocks held by requests (0 once the load drains).")
        self.num_requests_tracked = gauge(
            "num_requests_tracked", "Requests the engine holds state for (0 once drained).")

    def _register_token_counters(self) -> None:
        """Tokens in and out, the prefix cache's share of the prompts, and preemptions."""
        counter = self._counter
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")

    def _register_structured_output_counters(self) -> None:
        self.structured_output_requests = self._counter(
            "structured_output_requests", "Requests with a structured-output constraint."
        )
        self.grammar_compile_seconds = self._counter(
            "grammar_compile_seconds", "Time spent compiling structured-output grammars."
        )

    def _register_spec_decode_counters(self) -> None:
        """Speculative decoding's proposals and acceptances, as vLLM's."""
        counter = self._counter
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Requests' proposals verified (one per request per step).")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self._spec_decode_accepted_per_pos = self._counter_by(
            "spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the draft (0 = first).", "position")

    def _register_finish_and_step_counters(self) -> None:
        """Finished sequences by reason (the three usual ones exported as 0 from the start),
        and model forwards by step executor."""
        self._request_success = self._counter_by(
            "request_success", "Finished sequences, by finish reason.", "finished_reason")
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(*self._label_values, reason)
        self._model_steps = self._counter_by(
            "model_steps", "Model forwards, by the executor that ran them: "
            "whole-stack (one C call for every layer of a decode step), compiled or eager.",
            "executor")

    def _register_latency_histograms(self) -> None:
        """Per request and per token latencies (record_step observes them)."""
        histogram = self._histogram
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token of a request.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per generated token after the first, per finished sequence.",
            _TOKEN_GAP_BUCKETS,
        )

    def _register_lora_info(self) -> None:
        """vLLM's lora_requests_info gauge (set by _update_lora_info with --enable-lora)."""
        self._lora_info = Gauge(
            PREFIX + "lora_requests_info", "Running stats on LoRA requests: the adapters of "
            "the running and of the waiting requests (value: the time of the update).",
            [*self._labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry,
        )
        self._lora_info_labels: tuple[str, ...] | None = None

    # ---- per step ------------------------------------------------------------------------------

    def record_step(self, outputs: Iterable[RequestOutput], now: float | None = None) -> None:
        """Latency histograms from one step's outputs (call `update` for the rest)."""
        now = time.time() if now is None else now
        for output in outputs:
            self._record_output(output, now)

    def _record_output(self, output: RequestOutput, now: float) -> None:
        request_id = output.request_id
        metrics = output.metrics
        if (
            metrics is not None
            and metrics.first_token_time is not None
            and request_id not in self._first_token_seen
        ):
            self._first_token_seen.add(request_id)
            self.time_to_first_token.observe(max(metrics.time_to_first_token, 0.0))
            if metrics.queue_time is not None:
                self.request_queue_time.observe(max(metrics.queue_time, 0.0))
        for completion in output.outputs:
            if not completion.delta_token_ids:
                continue
            key = (request_id, completion.index)
            last = self._last_token_time.get(key)
            if last is not None:
                # One token per sequence per step: the gap is the time since its last token.
                self.inter_token_latency.observe(max(now - last, 0.0))
            self._last_token_time[key] = now
            first, count = self._seq_tokens.get(key, (now, 0))
            self._seq_tokens[key] = (first, count + len(completion.delta_token_ids))
        if output.finished:
            for completion in output.outputs:
                first, count = self._seq_tokens.get((request_id, completion.index), (0.0, 0))
                if count > 1:
                    last = self._last_token_time[(request_id, completion.index)]
                    self.time_per_output_token.observe(max(last - first, 0.0) / (count - 1))
            if metrics is not None:
                end = metrics.finished_time or now
                self.e2e_request_latency.observe(max(end - metrics.arrival_time, 0.0))
            self.forget(request_id, num_seqs=len(output.outputs))

    def forget(self, request_id: str, num_seqs: int | None = None) -> None:
        """Drop the per-request state of a finished or aborted request."""
        self._first_token_seen.discard(request_id)
        if num_seqs is None:
            keys = [k for k in self._last_token_time if k[0] == request_id]
        else:
            keys = [(request_id, i) for i in range(num_seqs)]
        for key in keys:
            self._last_token_time.pop(key, None)
            self._seq_tokens.pop(key, None)

    # ---- engine totals --------------------------------------------------------------------------

    def update(self, snapshot: EngineSnapshot) -> None:
        """Gauges from the snapshot's state; counters by the growth of its totals."""
        self.num_requests_running.set(snapshot.num_running_seqs)
        self.num_requests_waiting.set(snapshot.num_waiting_seqs)
        self.kv_cache_usage.set(snapshot.kv_cache_usage)
        self.num_kv_blocks.set(snapshot.num_kv_blocks)
        self.num_kv_blocks_held.set(snapshot.num_kv_blocks - snapshot.num_free_kv_blocks)
        self.num_requests_tracked.set(snapshot.num_tracked_requests)
        if snapshot.max_lora:
            self._update_lora_info(snapshot)
        if snapshot.kv_offload is not None:
            if self._kv_offload is None:
                self._kv_offload = KVOffloadMetrics(self.registry, self._labels,
                                                    self._label_values)
            self._kv_offload.update(snapshot.kv_offload)
        self._advance(self.prompt_tokens, "prompt_tokens", snapshot.num_prompt_tokens)
        self._advance(self.generation_tokens, "generation_tokens", snapshot.num_generation_tokens)
        self._advance(self.prefix_cache_queries, "prefix_cache_queries",
                      snapshot.prefix_cache_queries)
        self._advance(self.prefix_cache_hits, "prefix_cache_hits", snapshot.prefix_cache_hits)
        self._advance(self.num_preemptions, "num_preemptions", snapshot.num_preemptions)
        self._advance(self.structured_output_requests, "structured_output_requests",
                      snapshot.num_structured_requests)
        self._advance(self.grammar_compile_seconds, "grammar_compile_seconds",
                      snapshot.grammar_compile_seconds)
        spec = snapshot.spec_decode
        self._advance(self.spec_decode_num_drafts, "spec_drafts", spec.num_drafts)
        self._advance(self.spec_decode_num_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
        self._advance(self.spec_decode_num_accepted_tokens, "spec_accepted_tokens",
                      spec.num_accepted_tokens)
        for position, total in enumerate(spec.accepted_per_position):
            self._advance(self._spec_decode_accepted_per_pos.labels(*self._label_values, str(position)),
                          f"spec_accepted_{position}", total)
        for executor, total in snapshot.steps_by_executor.items():
            self._advance(self._model_steps.labels(*self._label_values, executor),
                          f"model_steps_{executor}", total)
        for reason, total in snapshot.finished_by_reason.items():
            previous = self._finished_by_reason.get(reason, 0)
            if total > previous:
                self._request_success.labels(*self._label_values, reason).inc(total - previous)
                self._finished_by_reason[reason] = total

    def _update_lora_info(self, snapshot: EngineSnapshot) -> None:
        """vLLM's lora_requests_info: the label set says which adapters run and wait; the
        previous label set is removed so the gauge has one sample (vLLM keeps them all)."""
        labels = (*self._label_values, ",".join(snapshot.running_lora_adapters),
                  ",".join(snapshot.waiting_lora_adapters), str(snapshot.max_lora))
        if self._lora_info_labels is not None and self._lora_info_labels != labels:
            self._lora_info.remove(*self._lora_info_labels)
        self._lora_info_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def _advance(self, counter, name: str, total: float) -> None:
        previous = self._totals.get(name, 0)
        if total > previous:
            counter.inc(total - previous)
            self._totals[name] = total
