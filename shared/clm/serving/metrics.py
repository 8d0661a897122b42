"""Prometheus metrics of the serving path (the series clm-serve exposes), on a registry owned by one runtime.

A per-app ``CollectorRegistry`` (not the process-global one) lets tests and
benchmarks run several apps in one process without "duplicated timeseries"
errors, and makes ``/metrics`` show exactly this service's series.

Series about heads carry a ``model`` label: the served model's name
(``clm-latest``, a published name, a ``ckpt_dir`` stem; aliases resolved), so
several heads served at once are told apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "clm_serve_requests", "Decision requests answered, by HTTP status.", ["status"], registry=r
        )
        self.latency = Histogram(
            "clm_serve_request_latency_seconds",
            "Wall time of a decision request (POST /v1/systemone, /v1/decisions), including encoding.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.questions = Counter("clm_serve_questions", "Questions answered, by served model and question type.",
                                 ["model", "type"], registry=r)
        self.answers = Counter("clm_serve_model_requests",
                               "Requests answered (POST /v1/systemone, /v1/decisions and /v1/rank), "
                               "by served model (`clm-raw` too).", ["model"], registry=r)
        self.batch_questions = Histogram(
            "clm_serve_projection_batch_questions", "Questions per micro-batched state projection.",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.batch_texts = Histogram(
            "clm_serve_encode_batch_texts", "State and option texts per micro-batched encoder call.",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.heads_version = Gauge(
            "clm_serve_heads_version", "Numeric version of the heads serving now (vNNNN), by served model; 0 when "
            "none is loaded or the checkpoint is not a published version.", ["model"], registry=r,
        )
        self.heads_loaded = Gauge("clm_serve_heads_loaded", "1 when the model's heads are loaded and serving.",
                                  ["model"], registry=r)
        self.reloads = Counter(
            "clm_serve_heads_reloads", "Attempts to load a new heads version, by served model and outcome "
            "(success, failure).", ["model", "outcome"], registry=r,
        )
        self.source_errors = Counter(
            "clm_serve_heads_source_errors", "Polls of a bucket checkpoint root that got no answer (unreachable, "
            "5xx, access denied), by served model: the heads serving stay, the next poll asks again.", ["model"],
            registry=r,
        )
        self.reload_seconds = Histogram(
            "clm_serve_heads_reload_seconds", "Load, validate and warm time of a heads version, until the swap.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.action_cache_hits = Counter(
            "clm_serve_action_cache_hits", "Option projections served from the action cache, by served model.",
            ["model"], registry=r,
        )
        self.action_cache_misses = Counter(
            "clm_serve_action_cache_misses", "Option projections computed on demand (first sight of an option "
            "text for the loaded heads), by served model.", ["model"], registry=r,
        )
        self.action_cache_size = Gauge(
            "clm_serve_action_cache_entries", "Projected option vectors held, all heads together (one shared LRU).",
            registry=r,
        )
        self.option_texts_encoded = Counter(
            "clm_serve_option_texts_encoded", "Option texts sent to the encoder (not yet in the option store).",
            registry=r,
        )
        self.decisions = Counter(
            "clm_serve_decisions", "Answers of calibrated heads by decision (automate, defer), served model and "
            "question id (ids the calibration knows; any other is `other`): the automated share per question is "
            "automate / (automate + defer).", ["model", "question", "action"], registry=r,
        )
        self.calibration_refused = Counter(
            "clm_serve_calibration_refused", "Heads versions loaded whose calibration file was refused (fitted for "
            "other heads or another encoder, unreadable): they serve uncalibrated.", ["model"], registry=r,
        )
        self.drift_psi = Gauge(
            "clm_serve_drift_psi", "PSI of a served model's answers since its heads version loaded against the "
            "version's reference (drift.json: its validation answers), by served model, question id and kind "
            "(top_option: which option is on top; confidence: the top probability, binned); computed every "
            "CLM_SERVE_DRIFT_INTERVAL_S and on GET /v1/drift, for question ids with CLM_SERVE_DRIFT_MIN_ANSWERS "
            "answers in both (docs/drift.md).", ["model", "question", "kind"], registry=r,
        )
        self.drift_alerts = Counter(
            "clm_serve_drift_alerts", "Crossings into alert, by served model, question id and kind: a PSI reaching "
            "CLM_SERVE_DRIFT_PSI_ALERT (kind top_option or confidence; counted again only after falling below and "
            "crossing again), or the state-embedding test turning drifted (question `*`, kind states).",
            ["model", "question", "kind"], registry=r,
        )
        self.drift_state_p_value = Gauge(
            "clm_serve_drift_states_p_value", "p-value of the MMD permutation test of a served model's sampled state "
            "embeddings against its training states (drift.json), once CLM_SERVE_DRIFT_MIN_STATES were served; "
            "drifted at or below the test's alpha.", ["model"], registry=r,
        )
        self.shadow_answers = Counter(
            "clm_serve_shadow_answers", "Live answers a candidate version also scored, off the response path "
            "(CLM_SERVE_SHADOW_SHARE), by served model and candidate version.", ["model", "candidate"], registry=r,
        )
        self.shadow_agreements = Counter(
            "clm_serve_shadow_agreements", "Of those, answers whose top option the candidate chose too.",
            ["model", "candidate"], registry=r,
        )
        self.shadow_labelled = Counter(
            "clm_serve_shadow_labelled", "Shadowed answers whose feedback (a label, or correct for the live answer) "
            "came back, read from the decision log, by served model and candidate version.", ["model", "candidate"],
            registry=r,
        )
        self.shadow_right = Counter(
            "clm_serve_shadow_right", "Of those, answers right, by arm: `live` (the answer served) or `candidate` "
            "(the shadow's; a `correct: false` about another answer of a question of more than two options is "
            "unknown, counted in neither).", ["model", "candidate", "arm"], registry=r,
        )
        self.shadow_dropped = Counter(
            "clm_serve_shadow_dropped", "Shadowed answers dropped because the shadow queue was full "
            "(CLM_SERVE_SHADOW_QUEUE): shadow scoring never makes a live request wait.", ["model"], registry=r,
        )
        self.canary_share = Gauge(
            "clm_serve_canary_share", "Share of a served model's traffic its canary (the newly promoted version) "
            "answers now, by the name's canary policy (canary.json; docs/promotion.md): the stage's share while it "
            "runs, 1 once completed, 0 once rolled back; 1 without a canary.", ["model"], registry=r,
        )
        self.canary_answers = Counter(
            "clm_serve_canary_answers", "Answers of a served model during its canary, by arm: `canary` (the "
            "promoted version) or `previous` (the version it replaced).", ["model", "arm"], registry=r,
        )
        self.canary_rollbacks = Counter(
            "clm_serve_canary_rollbacks", "Canaries this replica rolled back (its look crossed a sequential test "
            "and its write of `rolled_back` won), by served model.", ["model"], registry=r,
        )
        self.encoder_changes = Counter(
            "clm_serve_encoder_changes", "Times the embedder answered with another encoder digest (heads unloaded, "
            "identity reloaded).", registry=r,
        )

    def watch_decision_log(self, recorder) -> None:
        """Expose the decision log's counters (``clm.serving.recording.DecisionRecorder``), read at each scrape."""
        self.registry.register(_DecisionLogCollector(recorder))


class _DecisionLogCollector:
    """The writer keeps plain counters (the core has no metrics library in its threads); they are read here."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder

    def collect(self):
        writer = self.recorder.writer
        entries = CounterMetricFamily("clm_serve_decision_log_entries", "Decisions offered to the decision log, by "
                                      "outcome: logged (buffered for a segment), sampled_out (sample_rate), dropped "
                                      "(the buffer was full: the store is slow or down), failed (the entry could not "
                                      "be built).", labels=["outcome"])
        for outcome, value in (("logged", writer.logged), ("sampled_out", writer.sampled_out),
                               ("dropped", writer.dropped), ("failed", self.recorder.failed)):
            entries.add_metric([outcome], value)
        yield entries
        yield CounterMetricFamily("clm_serve_decision_log_written", "Decisions written into segments.",
                                  value=writer.written)
        yield CounterMetricFamily("clm_serve_decision_log_segments", "Parquet segments written.", value=writer.segments)
        yield CounterMetricFamily("clm_serve_decision_log_flush_failures", "Segment writes the store refused or did "
                                  "not answer (retried with backoff).", value=writer.flush_failures)
        yield GaugeMetricFamily("clm_serve_decision_log_buffered", "Decisions waiting for the next segment.",
                                value=writer.buffered)

