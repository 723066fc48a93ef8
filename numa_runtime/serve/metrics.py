"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineGauges:
    """The engine's gauges and its preemption counter, read from its stats snapshot at scrape
    time: one sample each, or on a server of several models one per model under vLLM's
    model_name label (they were the models' sums, unlabelled, so a dashboard's model filter
    found none)."""

    # (name, counter?, help, the snapshot's field, its index in a per-model row)
    FAMILIES = (
        ("num_requests_running", False, "Sequences in the running batch", "num_running", 1),
        ("num_requests_waiting", False, "Sequences waiting to be scheduled", "num_waiting", 2),
        ("kv_cache_usage_ratio", False, "Fraction of KV cache blocks in use", "kv_cache_usage", 3),
        ("prefix_cache_hit_rate", False, "Prompt tokens served from the prefix cache / prompt tokens",
         "prefix_cache_hit_rate", 4),
        ("num_preemptions", True, "Requests preempted (their KV blocks freed for others; recomputed "
         "later): many mean the KV cache is too small", "num_preemptions", 5),
        # NOTE: as vLLM's counters, in tokens: a dashboard's windowed hit rate is their rates' ratio
        ("prefix_cache_queries", True, "Prompt tokens looked up in the prefix cache", "prefix_cache_queries", 6),
        ("prefix_cache_hits", True, "Prompt tokens served from the prefix cache", "prefix_cache_hits", 7),
    )

    def __init__(self, prefix: str, stats_source):
        self.prefix, self.stats_source = prefix, stats_source

    def collect(self):
        s = self.stats_source()
        rows = s.per_model
        for name, counter, doc, attr, i in self.FAMILIES:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            fam = kind(self.prefix + name, doc, labels=["model_name"] if rows else None)
            if rows:
                for row in rows:
                    fam.add_metric([row[0]], float(row[i]))
            else:
                fam.add_metric([], float(getattr(s, attr)))
            yield fam


# NOTE: our families under vLLM's names too (vllm:...), so that vLLM's Grafana dashboard and
# autoscaling rules on vllm:num_requests_waiting read this server: (vLLM's name, the label our
# status becomes and the statuses it keeps, or None)
VLLM_NAMES = {
    "numa_runtime_num_requests_running": ["vllm:num_requests_running"],
    "numa_runtime_num_requests_waiting": ["vllm:num_requests_waiting"],
    "numa_runtime_kv_cache_usage_ratio": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "numa_runtime_prompt_tokens": ["vllm:prompt_tokens"],
    "numa_runtime_generation_tokens": ["vllm:generation_tokens"],
    "numa_runtime_num_preemptions": ["vllm:num_preemptions"],
    "numa_runtime_prefix_cache_queries": ["vllm:prefix_cache_queries"],
    "numa_runtime_prefix_cache_hits": ["vllm:prefix_cache_hits"],
    "numa_runtime_time_to_first_token_seconds": ["vllm:time_to_first_token_seconds"],
    "numa_runtime_time_per_output_token_seconds": ["vllm:time_per_output_token_seconds",
                                                   "vllm:inter_token_latency_seconds"],
    "numa_runtime_e2e_request_latency_seconds": ["vllm:e2e_request_latency_seconds"],
    "numa_runtime_requests": ["vllm:request_success"],
    "numa_runtime_request_prompt_tokens": ["vllm:request_prompt_tokens"],
    "numa_runtime_request_queue_time_seconds": ["vllm:request_queue_time_seconds"],
    "numa_runtime_request_prefill_time_seconds": ["vllm:request_prefill_time_seconds"],
    "numa_runtime_request_decode_time_seconds": ["vllm:request_decode_time_seconds"],
    "numa_runtime_request_inference_time_seconds": ["vllm:request_inference_time_seconds"],
    "numa_runtime_request_generation_tokens": ["vllm:request_generation_tokens"],
}
# NOTE: vllm:request_success's finished_reason: ours "tool_calls" ended as a stop; errors are none of its
_FINISHED_REASON = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "stop"}


class _VllmNames:
    """A collector that yields the registry's other families again under VLLM_NAMES (without
    the _created series, as vLLM serves them); `model_name` labels the samples that have none
    (the engine gauges of a one-model server; a server of several shares them unlabelled)."""

    def __init__(self, registry, model_name: str | None = None):
        self.registry, self.model_name = registry, model_name
        self._inside = threading.local()

    def collect(self):
        if getattr(self._inside, "on", False):  # NOTE: registry.collect() below reaches this collector too
            return
        self._inside.on = True
        try:
            families = list(self.registry.collect())
        finally:
            self._inside.on = False
        for fam in families:
            for name in VLLM_NAMES.get(fam.name, ()):
                values: dict = {}  # NOTE: (sample name, labels) -> value; stop and tool_calls share "stop"
                for smp in fam.samples:
                    if smp.name.endswith("_created"):
                        continue
                    labels = dict(smp.labels)
                    if self.model_name is not None:  # NOTE: the engine gauges too, as vLLM labels them
                        labels.setdefault("model_name", self.model_name)
                    if name == "vllm:request_success":
                        reason = _FINISHED_REASON.get(labels.pop("status", None))
                        if reason is None:
                            continue
                        labels["finished_reason"] = reason
                    key = (name + smp.name[len(fam.name):], tuple(sorted(labels.items())))
                    values[key] = values.get(key, 0.0) + smp.value
                out = Metric(name, fam.documentation, fam.type)
                for (sample, labels), value in values.items():
                    out.add_sample(sample, dict(labels), value)
                yield out


class ServerMetrics:
    """Request counters and latency histograms (fed by the handlers) and engine gauges (read
    from the AsyncEngine's stats snapshot at scrape time)."""

    def __init__(self, stats_source, liveness_source=None, model_name: str | None = None):
        self.registry = r = CollectorRegistry()
        p = "numa_runtime_"
        self.http_responses = Counter(p + "http_responses", "HTTP responses by status code",
                                      ["code"], registry=r)
        # NOTE: per model (vLLM's model_name label): a server of several models shares one registry
        m = ["model_name"]
        self.requests = Counter(p + "requests", "Finished generation requests by status "
                                "(stop, length, tool_calls, abort, error)", m + ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", m, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first token",
                              m, buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time between output tokens "
                              "of one request", m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from arrival to the last token",
                             m, buckets=_E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(p + "request_prompt_tokens", "Prompt tokens of a finished sequence",
                                               m, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(p + "request_generation_tokens", "Tokens a finished sequence "
                                                   "generated", m, buckets=_TOKEN_BUCKETS, registry=r)
        phases = {"queue": "Time from arrival until the request was first scheduled",
                  "prefill": "Time from first being scheduled to the first token",
                  "decode": "Time from the first token to the last",
                  "inference": "Time from first being scheduled to the last token"}
        self.phases = {k: Histogram(p + f"request_{k}_time_seconds", doc, m, buckets=_E2E_BUCKETS, registry=r)
                       for k, doc in phases.items()}
        self.embedding_requests = Counter(p + "embedding_requests", "Finished /v1/embeddings requests by status "
                                          "(ok, error)", m + ["status"], registry=r)
        self.embedding_latency = Histogram(p + "embedding_request_latency_seconds", "Time from arrival to the "
                                           "answer of an embeddings request", m, buckets=_E2E_BUCKETS, registry=r)
        g = Gauge(p + "engine_threads", "Compute threads of the thread that steps the engine", registry=r)
        g.set_function(lambda: float(stats_source().num_threads))
        r.register(_EngineGauges(p, stats_source))
        live = {
            "seconds_since_last_step": "Seconds since the engine last finished a step",
            "engine_busy_seconds": "Seconds the engine has spent in its current step or command (0 when idle)",
        }
        for name, doc in live.items():
            if liveness_source is not None:
                g = Gauge(p + name, doc, registry=r)
                g.set_function(lambda name=name: float(liveness_source(name)))
        r.register(_VllmNames(r, model_name))

    def observe_request(self, model: str, sequences: list, prompt_tokens: int, completion_tokens: int,
                        arrival: float) -> None:
        """One API request to `model` finished: `sequences`, each of its sequences (every prompt's n) as
        (status, prompt tokens, generated tokens, first token, latest token, end), on `arrival`'s clock
        (time.monotonic); prompt tokens None for one that has no output, a time None where it has none.
        NOTE: per sequence and on its own times, as vLLM counts its engine requests (one a prompt, each of n
        too): the request counter took choice 0's reason once, and every sequence the request's end."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        for status, prompt, generated, first, last, end in sequences:
            self.requests.labels(model, status).inc()
            if prompt is None:
                continue
            self.request_prompt_tokens.labels(model).observe(prompt)
            self.request_generation_tokens.labels(model).observe(generated)
            if status in ("stop", "length", "tool_calls") and end is not None:
                self.e2e.labels(model).observe(max(0.0, end - arrival))
            if first is not None:
                self.ttft.labels(model).observe(max(0.0, first - arrival))
                if generated > 1 and last is not None:
                    self.tpot.labels(model).observe(max(0.0, last - first) / (generated - 1))

    def observe_phases(self, model: str, times: dict, end: float, first: float | None = None) -> None:
        """One sequence's queue, prefill, decode and inference time (RequestOutput.metrics: arrival,
        first scheduled and first token, on time.monotonic's clock; `first`: the sequence's own first
        token, where it has one)."""
        arrival, scheduled = times.get("arrival_time"), times.get("first_scheduled_time")
        first = first if first is not None else times.get("first_token_time")
        if arrival is None or scheduled is None:
            return
        self.phases["queue"].labels(model).observe(max(0.0, scheduled - arrival))
        if first is not None:
            self.phases["prefill"].labels(model).observe(max(0.0, first - scheduled))
            self.phases["decode"].labels(model).observe(max(0.0, end - first))
        self.phases["inference"].labels(model).observe(max(0.0, end - scheduled))

    def observe_embedding(self, model: str, ok: bool, prompt_tokens: int, arrival: float, end: float) -> None:
        """One /v1/embeddings request to `model` answered (ok) or failed; its tokens count as prompt tokens."""
        self.embedding_requests.labels(model, "ok" if ok else "error").inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        if ok:
            self.embedding_latency.labels(model).observe(end - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
