"""Counters for GET /metrics, in Prometheus text exposition format 0.0.4.

The `llamacpp:*` series carry llama-server's names and meanings, so dashboards and
scrapers written for it keep working; `genie_rt_*` series add what it does not report
(prefix-cache hits, requests by outcome, queue rejections). Throughput gauges are the
average over the server's lifetime, not since the previous scrape (llama-server resets a
bucket per scrape; a stateless value is easier to reason about with several scrapers).

The worker thread writes, HTTP handlers read: every update and the snapshot taken for
rendering hold one lock. No dependency: the format is a few lines of text.
"""
from __future__ import annotations

import math
import threading
import time

FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")
REJECT_REASONS = ("queue_full", "invalid", "too_large")   # every series docs/server.md lists, from 0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.prompt_tokens = 0             # prompt tokens prefilled (cached ones excluded, as llama-server)
        self.prompt_seconds = 0.0
        self.prompt_tokens_cached = 0      # prompt tokens whose KV was reused
        self.prefix_hits = 0               # requests that reused at least one token
        self.tokens_predicted = 0
        self.predicted_seconds = 0.0
        self.n_tokens_max = 0              # largest prompt + generation seen
        self.requests_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.requests_rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.request_seconds = 0.0         # queue wait + prefill + generation, summed

    # -- updates ---------------------------------------------------------------------------------
    def on_result(self, result, seconds: float, index: int = 0) -> None:
        """One choice's result. A request's prompt, cache use, finish and duration count once,
        with its first choice (index 0); every choice's generated tokens and time count (a
        further choice's first draw, its prompt_ms, is generation time, as in its usage)."""
        with self._lock:
            self.tokens_predicted += result.n_generated
            self.n_tokens_max = max(self.n_tokens_max, result.n_prompt + result.n_generated)
            if index:
                self.predicted_seconds += (result.gen_ms + result.prompt_ms) / 1000
                return
            self.predicted_seconds += result.gen_ms / 1000
            self.prompt_tokens += result.n_prompt - result.n_cached
            self.prompt_seconds += result.prompt_ms / 1000
            self.prompt_tokens_cached += result.n_cached
            self.prefix_hits += result.n_cached > 0
            reason = result.finish_reason if result.finish_reason in self.requests_finished else "stop"
            self.requests_finished[reason] += 1
            self.request_seconds += seconds

    def on_tool_calls(self) -> None:
        """A finished 'stop' turned out to be a tool call (known only after parsing)."""
        with self._lock:
            if self.requests_finished["stop"]:
                self.requests_finished["stop"] -= 1
            self.requests_finished["tool_calls"] += 1

    def on_error(self) -> None:
        with self._lock:
            self.requests_finished["error"] += 1

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self.requests_rejected[reason] = self.requests_rejected.get(reason, 0) + 1

    # -- exposition ------------------------------------------------------------------------------
    def render(self, *, processing: int, queued: int, kv_tokens: int, n_ctx: int) -> str:
        with self._lock:
            s = dict(self.__dict__)
            finished = dict(self.requests_finished)
            rejected = dict(self.requests_rejected)
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value, labels: list[tuple[dict, float]] | None = None):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            if labels is None:
                lines.append(f"{name} {_num(value)}")
            else:
                for lab, v in labels:
                    text = ",".join(f'{k}="{val}"' for k, val in lab.items())
                    lines.append(f"{name}{{{text}}} {_num(v)}")

        def rate(n, secs):
            return n / secs if secs > 0 else 0.0

        metric("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", s["prompt_tokens"])
        metric("llamacpp:prompt_seconds_total", "counter", "Prompt process time", s["prompt_seconds"])
        metric("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
               s["tokens_predicted"])
        metric("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time",
               s["predicted_seconds"])
        metric("llamacpp:prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache.",
               s["prompt_tokens_cached"])
        metric("llamacpp:n_decode_total", "counter", "Total number of decode steps (one per generated token).",
               s["tokens_predicted"])
        metric("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", s["n_tokens_max"])
        metric("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
               rate(s["prompt_tokens"], s["prompt_seconds"]))
        metric("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
               rate(s["tokens_predicted"], s["predicted_seconds"]))
        for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                     "spec_decode_num_drafts_total"):   # no speculative decoding here: always 0
            metric(f"llamacpp:{name}", "counter", "Speculative decoding (not used by this server).", 0)
        metric("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per decode step.",
               1 if s["tokens_predicted"] else 0)
        metric("llamacpp:requests_processing", "gauge", "Number of requests processing.", processing)
        metric("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", queued)
        metric("llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               kv_tokens / n_ctx if n_ctx > 0 else 0.0)
        metric("llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.", kv_tokens)
        metric("genie_rt_kv_cache_capacity_tokens", "gauge", "Context length (KV positions).", n_ctx)
        metric("genie_rt_prefix_cache_hits_total", "counter",
               "Requests that reused a KV prefix (in memory or from a conversation file).", s["prefix_hits"])
        metric("genie_rt_prompt_tokens_cached_total", "counter", "Prompt tokens whose KV was reused.",
               s["prompt_tokens_cached"])
        metric("genie_rt_requests_finished_total", "counter", "Finished requests by outcome.", None,
               [({"reason": k}, v) for k, v in finished.items()])
        metric("genie_rt_requests_rejected_total", "counter", "Requests refused before generation.", None,
               [({"reason": k}, v) for k, v in rejected.items()])
        metric("genie_rt_request_seconds_total", "counter", "Queue wait plus generation time, summed.",
               s["request_seconds"])
        metric("genie_rt_process_start_time_seconds", "gauge", "Start time since the Unix epoch.", s["started"])
        return "\n".join(lines) + "\n"


def _num(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)
