"""Prometheus metrics of one gateway process (own registry: several apps may live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Registration order is the order of the /metrics page.
        self._serving(r)
        self._capture(r)
        self._admission(r)
        self._policy(r)
        self._training(r)

    def _serving(self, r: CollectorRegistry) -> None:
        """Calls served: counts, prompt building, tokens, latencies, errors."""
        self.calls = Counter("clawgate_calls", "Model calls served", ["api", "status"], registry=r)
        self.render_mode = Counter(
            "clawgate_render_mode",
            "How prompts were built (fresh, spliced, drifted, raw)",
            ["mode"],
            registry=r,
        )
        self.drift = Counter(
            "clawgate_drift", "Calls whose prompt re-tokenized an answer this gateway generated", registry=r
        )
        self.prompt_tokens = Counter("clawgate_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("clawgate_completion_tokens", "Completion tokens", registry=r)
        self.latency = Histogram(
            "clawgate_call_latency_seconds",
            "Wall time per call",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "clawgate_time_to_first_token_seconds",
            "Time to first token",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "clawgate_gateway_overhead_seconds",
            "Gateway time per call outside the engine",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.errors = Counter("clawgate_errors", "Errors returned", ["type"], registry=r)
        self.grammar_hits = Counter(
            "clawgate_grammar_cache_hits", "Structured outputs whose grammar was compiled already", registry=r
        )
        self.grammar_compile = Histogram(
            "clawgate_grammar_compile_seconds",
            "Compilation of a structured output's grammar not in the cache",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _capture(self, r: CollectorRegistry) -> None:
        """The capture writer: its queue, what it wrote, retried and dead-lettered, and outages."""
        self.capture_queue = Gauge("clawgate_capture_queue_depth", "Calls waiting to be written", registry=r)
        self.capture_written = Gauge("clawgate_capture_written", "Rows written by the capture writer", registry=r)
        self.capture_retries = Gauge("clawgate_capture_retries", "Capture write retries", registry=r)
        self.capture_dead_lettered = Gauge(
            "clawgate_capture_dead_lettered",
            "Capture records the database rejected, kept in <data_dir>/spool/dead-letter.jsonl",
            registry=r,
        )
        self.capture_degraded = Gauge(
            "clawgate_capture_degraded", "1 while the capture database cannot be written (calls queue up)", registry=r
        )
        self.served_degraded = Counter(
            "clawgate_calls_served_degraded",
            "Durable calls answered before their capture was committed (the database was down or slow)",
            registry=r,
        )

    def _admission(self, r: CollectorRegistry) -> None:
        """Calls in flight, and calls refused before generating."""
        self.in_flight = Gauge("clawgate_in_flight_calls", "Calls being generated", registry=r)
        self.refused = Counter(
            "clawgate_calls_refused",
            "Calls refused before generating (503 with Retry-After: capture queue full, or concurrency limit; 429: a "
            "tenant's or key's quota)",
            ["reason"],
            registry=r,
        )

    def _policy(self, r: CollectorRegistry) -> None:
        """The policy version served, a running canary and its decisions, and version swaps."""
        self.policy_version = Gauge(
            "clawgate_policy_version", "Policy version new calls are routed to (-1: the base model)", registry=r
        )
        self.policy_version.set(-1)
        self.lineage_version = Gauge(
            "clawgate_lineage_policy_version",
            "Version of a tenant's own policy its new calls are routed to",
            ["tenant"],
            registry=r,
        )
        self.canary_version = Gauge(
            "clawgate_canary_version", "Candidate version serving a canary here (-1: none)", registry=r
        )
        self.canary_version.set(-1)
        self.canary_share = Gauge(
            "clawgate_canary_share", "Share of new conversations sent to the candidate", registry=r
        )
        self.canary_samples = Gauge(
            "clawgate_canary_samples", "Rewarded samples of each arm of the running canary", ["arm"], registry=r
        )
        self.canary_reward = Gauge(
            "clawgate_canary_reward_mean", "Mean reward of each arm of the running canary", ["arm"], registry=r
        )
        self.canary_error_rate = Gauge(
            "clawgate_canary_error_rate", "Failed calls per call of each arm of the running canary", ["arm"], registry=r
        )
        self.promotion_decisions = Counter(
            "clawgate_promotion_decisions", "Stage decisions this gateway took", ["outcome"], registry=r
        )
        self.policy_swaps = Counter("clawgate_policy_swaps", "Policy versions swapped in", registry=r)
        self.policy_swap_failures = Counter(
            "clawgate_policy_swap_failures", "Published versions that could not be loaded or did not answer", registry=r
        )
        self.policy_swap_seconds = Histogram(
            "clawgate_policy_swap_seconds",
            "From a version's publication to new calls being routed to it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _training(self, r: CollectorRegistry) -> None:
        """What waits for the trainer and what it consumed, judgements, and how stale the served policy is."""
        self.rollouts_ready = Gauge(
            "clawgate_rollouts_ready", "Finished, rewarded rollouts not yet trained on", registry=r
        )
        self.rollouts_trained = Gauge("clawgate_rollouts_trained", "Rollouts consumed by train steps", registry=r)
        self.turns_ready = Gauge(
            "clawgate_turns_ready", "Turns of everyday traffic rewarded and ready, not yet trained on", registry=r
        )
        self.turns_trained = Gauge("clawgate_turns_trained", "Turns consumed by train steps", registry=r)
        self.turns_waiting = Gauge(
            "clawgate_turns_waiting",
            "Turns of everyday traffic not trained yet, by what they wait for (next_state, judge)",
            ["for"],
            registry=r,
        )
        self.judgements = Gauge("clawgate_judgements", "Reward-worker verdicts by status", ["status"], registry=r)
        self.counterfactuals_drawn = Counter(
            "clawgate_counterfactuals_drawn",
            "Counterfactual siblings drawn whole and recorded (extra answers to served turns' prompts)",
            registry=r,
        )
        self.counterfactuals_dropped = Counter(
            "clawgate_counterfactuals_dropped",
            "Counterfactual siblings not drawn or not kept, by why (cap: too many groups pending; busy: live traffic "
            "left no idle moment; preempted: a draw cut short by a live call, drawn again in the next idle moment; "
            "late: not drawn by the group's deadline; capture: the served call was not committed; error: the engine "
            "failed)",
            ["reason"],
            registry=r,
        )
        self.counterfactuals_judged = Gauge(
            "clawgate_counterfactuals_judged", "Counterfactual siblings with a recorded score", registry=r
        )
        self.policy_staleness = Gauge(
            "clawgate_policy_staleness",
            "Versions between the newest published one and the one served (0: serving the newest)",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
