//! `/metrics` in the Prometheus text format (prometheus-client), and the middleware that
//! times every request.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;
use wick::serve::{OnlineStats, SchedulerStats};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteOnly {
    pub route: String,
}

/// Every metric the service exports.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RouteLabels, Counter>,
    pub latency: Family<RouteOnly, Histogram>,
    pub train_steps: Counter,
    pub train_examples: Counter,
    pub train_failed_steps: Counter,
    pub train_loss: Gauge<f64, AtomicU64>,
    pub train_seconds: Gauge<f64, AtomicU64>,
    pub version: Gauge,
    pub queue_depth: Gauge,
    pub publish_seconds: Gauge<f64, AtomicU64>,
    pub publish_seconds_sum: Gauge<f64, AtomicU64>,
    pub publishes: Counter,
    pub tokens: Counter,
    pub tokens_per_second: Gauge<f64, AtomicU64>,
    /// The scheduler's counters (llama), read at each render.
    pub scheduler: std::sync::OnceLock<Arc<SchedulerStats>>,
    engine_steps: Counter,
    running: Gauge,
    waiting: Gauge,
    kv_free_blocks: Gauge,
    batch: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("wick_serve");
        let requests = Family::<RouteLabels, Counter>::default();
        registry.register(
            "requests",
            "HTTP requests by route and status",
            requests.clone(),
        );
        let latency = Family::<RouteOnly, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 16))
        });
        registry.register(
            "request_latency_seconds",
            "Request latency (to the response head) by route",
            latency.clone(),
        );
        let m = Self {
            requests,
            latency,
            train_steps: Counter::default(),
            train_examples: Counter::default(),
            train_failed_steps: Counter::default(),
            train_loss: Gauge::default(),
            train_seconds: Gauge::default(),
            version: Gauge::default(),
            queue_depth: Gauge::default(),
            publish_seconds: Gauge::default(),
            publish_seconds_sum: Gauge::default(),
            publishes: Counter::default(),
            tokens: Counter::default(),
            tokens_per_second: Gauge::default(),
            scheduler: Default::default(),
            engine_steps: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_free_blocks: Gauge::default(),
            batch: Gauge::default(),
            registry,
        };
        let mut m = m;
        let r = &mut m.registry;
        r.register(
            "train_steps",
            "Optimizer steps on feedback",
            m.train_steps.clone(),
        );
        r.register(
            "train_examples",
            "Feedback examples trained on",
            m.train_examples.clone(),
        );
        r.register(
            "train_failed_steps",
            "Steps that failed (batch skipped)",
            m.train_failed_steps.clone(),
        );
        r.register(
            "train_loss",
            "Mean loss of the last step",
            m.train_loss.clone(),
        );
        r.register(
            "train_busy_seconds",
            "Seconds spent in training steps",
            m.train_seconds.clone(),
        );
        r.register(
            "weights_version",
            "Version of the published weights",
            m.version.clone(),
        );
        r.register(
            "feedback_queue_depth",
            "Feedback examples waiting",
            m.queue_depth.clone(),
        );
        r.register(
            "publish_seconds",
            "Time of the last publication: snapshot copy to atomic swap",
            m.publish_seconds.clone(),
        );
        r.register(
            "publish_seconds_sum",
            "Time of all publications together",
            m.publish_seconds_sum.clone(),
        );
        r.register(
            "publishes",
            "Publications of new weights",
            m.publishes.clone(),
        );
        r.register(
            "generated_tokens",
            "Tokens generated (llama)",
            m.tokens.clone(),
        );
        r.register(
            "tokens_per_second",
            "Generated tokens / wall-clock s of the last completion, prompt prefill included (llama)",
            m.tokens_per_second.clone(),
        );
        r.register(
            "engine_steps",
            "Scheduler steps (one batch of decode tokens and prefill chunks each; llama)",
            m.engine_steps.clone(),
        );
        r.register(
            "running_sequences",
            "Sequences being decoded or prefilled (llama)",
            m.running.clone(),
        );
        r.register(
            "waiting_requests",
            "Completions waiting for admission (llama)",
            m.waiting.clone(),
        );
        r.register(
            "kv_free_blocks",
            "Free blocks of the paged KV cache (llama)",
            m.kv_free_blocks.clone(),
        );
        r.register(
            "batch_sequences",
            "Sequences in the last scheduler step (llama)",
            m.batch.clone(),
        );
        m
    }

    /// The text exposition, after copying the trainer's counters in.
    pub fn render(&self, stats: &OnlineStats, version: u64, depth: usize) -> String {
        let catch_up = |c: &Counter, v: u64| {
            let have = c.get();
            if v > have {
                c.inc_by(v - have);
            }
        };
        catch_up(&self.train_steps, stats.steps());
        catch_up(&self.train_examples, stats.examples());
        catch_up(&self.train_failed_steps, stats.failed_steps());
        catch_up(&self.publishes, stats.publishes());
        self.publish_seconds_sum.set(stats.publish_seconds_total());
        let loss = stats.last_loss();
        self.train_loss
            .set(if loss.is_finite() { loss as f64 } else { 0.0 });
        self.train_seconds.set(stats.train_seconds());
        self.version.set(version as i64);
        self.queue_depth.set(depth as i64);
        self.publish_seconds.set(stats.last_publish_seconds());
        if let Some(s) = self.scheduler.get() {
            catch_up(&self.engine_steps, s.steps());
            self.running.set(s.running() as i64);
            self.waiting.set(s.waiting() as i64);
            self.kv_free_blocks.set(s.free_blocks() as i64);
            self.batch.set(s.last_batch() as i64);
        }
        let mut out = String::new();
        if let Err(e) = encode(&mut out, &self.registry) {
            out = format!("# encoding failed: {e}\n");
        }
        out
    }
}

/// Middleware: counts and times each request by its matched route (`unmatched` for 404s).
pub async fn track(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let t = Instant::now();
    let resp = next.run(req).await.into_response();
    m.latency
        .get_or_create(&RouteOnly {
            route: route.clone(),
        })
        .observe(t.elapsed().as_secs_f64());
    m.requests
        .get_or_create(&RouteLabels {
            route,
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}
