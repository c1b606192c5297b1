//! An inference service that keeps learning: serves a model over HTTP, queues feedback, trains
//! on it in a background thread through `Engine::step`, and publishes new weights atomically
//! (`wick::serve`). One binary; the model is chosen by flag.
//!
//! ```text
//! scripts/fetch_mnist.sh
//! cargo run --release --example serve -- --model mnist --port 8080 --save-dir runs/serve-mnist
//! scripts/fetch_smollm2.sh
//! cargo run --release --example serve -- --model llama --port 8080 --save-dir runs/serve-llama
//! ```
//! Routes: `GET /health`, `GET /metrics` (Prometheus text); mnist: `POST /predict`,
//! `POST /feedback`, `GET /v1/snapshots/{version}`; llama: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models` (OpenAI's), `POST /v1/feedback`, `POST|DELETE /v1/adapters/{name}`, `GET /v1/snapshots/{version}`.
//! docs/serving.md has curl examples. Prints
//! `listening on http://ADDR` on stdout once the port is bound (`--port 0`: any free port).
//! SIGTERM / Ctrl-C: stop accepting, let the trainer finish its step, publish, save a
//! checkpoint (with `--save-dir`), exit with 128 + the signal (143 / 130).

mod http;
mod llama;
mod metrics;
mod mnist;
#[path = "../common/mnist_net.rs"]
mod mnist_net;
mod openai;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use clap::{Parser, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tower_http::catch_panic::CatchPanicLayer;
use wick::checkpoint::Checkpointer;
use wick::serve::{OnlineConfig, OnlineParts, OnlineStats};
use wick::{Engine, EngineConfig, Precision};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelKind {
    /// MNIST classifier (MLP or CNN): the CPU test fixture.
    Mnist,
    /// SmolLM2-135M (GGUF) with a LoRA adapter.
    Llama,
}

#[derive(Parser, Debug)]
#[command(about = "Serve a model and keep fine-tuning it from feedback")]
pub struct Args {
    /// Which model to serve.
    #[arg(long, value_enum, default_value = "mnist")]
    model: ModelKind,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the bound address is printed on stdout).
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true)]
    port: u16,
    /// cpu or cuda (a --features cuda build).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// AdamW learning rate (> 0).
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    lr: f64,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// Most feedback examples per training step (>= 1).
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    train_batch: usize,
    /// Publish new weights every N training steps (>= 1).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    publish_every: usize,
    /// Checkpoint every N training steps (0: only on shutdown); needs --save-dir.
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    checkpoint_every: usize,
    /// Checkpoints go here; a checkpoint already there is resumed.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Fraction of wall time training may take, in (0, 1].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = wick::cli::fraction)]
    train_share: f64,
    /// Feedback examples that may wait (>= 1); beyond it feedback is answered 429.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    queue_capacity: usize,
    /// Published versions kept retrievable at /v1/snapshots/{version} (>= 1).
    #[arg(long, default_value_t = 8, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    keep_versions: usize,
    /// Largest request body in bytes (>= 1; larger: 413).
    #[arg(long, default_value_t = 4 << 20, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    body_limit: usize,
    /// Most images per /predict or /feedback request (>= 1).
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_batch: usize,
    /// Most tokens per completion (llama; >= 1).
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_tokens_limit: usize,
    /// Enable GET /debug/panic (a handler that panics: checks that the server survives).
    #[arg(long)]
    debug_routes: bool,
    /// mnist: the network.
    #[arg(long, value_enum, default_value = "mlp")]
    arch: mnist::Arch,
    /// mnist: hidden width of the MLP (>= 1).
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    hidden: usize,
    /// mnist: start from these weights (model.safetensors of an examples/mnist.rs checkpoint;
    /// for llama, --gguf names the weights).
    #[arg(long)]
    init: Option<PathBuf>,
    /// llama (any decoder family): the GGUF (weights, tokenizer); SmolLM2-135M-Instruct's
    /// (data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf) when neither it nor --hf is given.
    #[arg(long, conflicts_with = "hf")]
    gguf: Option<PathBuf>,
    /// llama (any decoder family): an HF folder instead (config.json, *.safetensors,
    /// tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    hf: Option<PathBuf>,
    /// llama: a random 2-block model over the GGUF's tokenizer (CPU tests).
    #[arg(long)]
    tiny: bool,
    /// llama: LoRA rank (>= 1).
    #[arg(long, default_value_t = 8, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    lora_rank: usize,
    /// llama: positions per paged KV-cache block (>= 1).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    kv_block_size: usize,
    /// llama: blocks in the paged KV cache (>= 1); memory: 2 x layers x blocks x block size x
    /// KV heads x head width elements of the compute dtype.
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    kv_blocks: usize,
    /// llama: most sequences decoding at once (>= 1, <= --step-tokens).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_running: usize,
    /// llama: most completions waiting for the model (>= 1); beyond them, 429.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_waiting: usize,
    /// llama: tokens per engine step, decode tokens and prefill chunks together (>= 1).
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    step_tokens: usize,
    /// llama: folder of named adapters for POST /v1/adapters/{name}.
    #[arg(long, default_value = "runs/adapters")]
    adapters_dir: PathBuf,
}

/// AdamW over the flags; every step is one accumulation window unless the learner closes it.
pub fn engine_config(a: &Args) -> EngineConfig {
    let mut c = EngineConfig::adamw(a.lr);
    c.max_grad_norm = Some(1.0);
    c
}

/// Loads the newest checkpoint of `--save-dir` into `engine`, when there is one, and returns
/// the version it had published (0 without a checkpoint): publication numbers go on from it.
pub fn resume(a: &Args, engine: &mut Engine) -> Result<u64> {
    if let Some(dir) = &a.save_dir {
        if let Some(resumed) = Checkpointer::new(dir, 3).resume(engine)? {
            let version = resumed.extra["published_version"].as_u64().unwrap_or(0);
            eprintln!("resumed from {resumed} (version {version})");
            return Ok(version);
        }
    }
    Ok(0)
}

/// What /health and /metrics read.
#[derive(Clone)]
struct Common {
    model: &'static str,
    metrics: Arc<metrics::Metrics>,
    stats: Arc<OnlineStats>,
    version: Arc<dyn Fn() -> u64 + Send + Sync>,
    depth: Arc<dyn Fn() -> usize + Send + Sync>,
}

async fn health(State(c): State<Common>) -> impl IntoResponse {
    let ok = c.stats.running();
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if ok { "ok" } else { "trainer stopped" },
        "model": c.model,
        "version": (c.version)(),
        "train_steps": c.stats.steps(),
        "train_examples": c.stats.examples(),
        "queue_depth": (c.depth)(),
    });
    (status, Json(body))
}

async fn metrics_text(State(c): State<Common>) -> impl IntoResponse {
    let text = c.metrics.render(&c.stats, (c.version)(), (c.depth)());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
}

async fn debug_panic() -> &'static str {
    panic!("deliberate panic from /debug/panic")
}

/// The model-specific router and the trainer thread, started.
struct Started {
    router: Router,
    common: Common,
    trainer: std::thread::JoinHandle<Result<wick::serve::OnlineSummary>>,
}

/// The trainer thread over `published`, with its bounded feedback queue, and the state the
/// shared routes read.
struct Trainer<E> {
    handle: std::thread::JoinHandle<Result<wick::serve::OnlineSummary>>,
    feedback: wick::serve::FeedbackSender<E>,
    common: Common,
}

fn spawn_trainer<L: wick::serve::OnlineLearner>(
    a: &Args,
    model: &'static str,
    (engine, learner): (wick::Engine, L),
    published: Arc<wick::serve::Published<L::Snapshot>>,
    stop: Arc<AtomicBool>,
    metrics: Arc<metrics::Metrics>,
) -> Result<Trainer<L::Example>> {
    let stats = Arc::new(OnlineStats::default());
    let online = OnlineConfig {
        batch_size: a.train_batch,
        publish_every: a.publish_every as u64,
        checkpoint_every: a.checkpoint_every as u64,
        train_share: a.train_share,
        poll: Duration::from_millis(20),
    };
    let (tx, rx) = wick::serve::feedback_queue(a.queue_capacity);
    let parts = OnlineParts {
        feedback: rx,
        checkpointer: a.save_dir.as_ref().map(|d| Checkpointer::new(d, 3)),
        stop,
        stats: stats.clone(),
    };
    let handle = wick::serve::spawn(engine, learner, published.clone(), parts, online)?;
    let q = tx.clone();
    let common = Common {
        model,
        metrics,
        stats,
        version: Arc::new(move || published.version()),
        depth: Arc::new(move || q.depth()),
    };
    Ok(Trainer {
        handle,
        feedback: tx,
        common,
    })
}

fn start(a: &Args, stop: Arc<AtomicBool>, m: Arc<metrics::Metrics>) -> Result<Started> {
    let dev = wick::device_from_flag(&a.device)?;
    match a.model {
        ModelKind::Mnist => {
            let (engine, learner, first, version) = mnist::build(a, &dev)?;
            dev.synchronize()?; // CUDA: the threads below run on their own per-thread streams
            let published = Arc::new(wick::serve::Published::starting_at(
                first,
                version,
                a.keep_versions,
            ));
            let t = spawn_trainer(a, "mnist", (engine, learner), published.clone(), stop, m)?;
            let state = mnist::MnistState {
                published,
                feedback: t.feedback,
                dev,
                max_batch: a.max_batch,
            };
            Ok(Started {
                router: mnist::router(state),
                common: t.common,
                trainer: t.handle,
            })
        }
        ModelKind::Llama => {
            let (engine, learner, state) = llama::build(a, &dev, m.clone())?;
            dev.synchronize()?; // CUDA: the threads below run on their own per-thread streams
            let published = state.published.clone();
            let t = spawn_trainer(a, "llama", (engine, learner), published, stop, m)?;
            Ok(Started {
                router: llama::router(state, t.feedback),
                common: t.common,
                trainer: t.handle,
            })
        }
    }
}

async fn shutdown_signal(code: Arc<AtomicI32>, stop: Arc<AtomicBool>, saves: bool) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("could not install the signal handlers; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    let n = tokio::select! {
        _ = term.recv() => 15,
        _ = int.recv() => 2,
    };
    code.store(128 + n, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst); // the trainer finishes its step meanwhile
    let then = if saves {
        ", then saving a checkpoint"
    } else {
        " (no --save-dir: nothing is saved)"
    };
    eprintln!("signal {n}: no new connections; finishing requests and the training step{then}");
}

fn main() -> Result<()> {
    wick::cli::init_logging();
    let a = Args::parse();
    if let (ModelKind::Llama, Some(init)) = (a.model, &a.init) {
        anyhow::bail!(
            "--init {} is for --model mnist (a model.safetensors of examples/mnist.rs); \
             --model llama takes its weights from --gguf or --hf",
            init.display()
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let m = Arc::new(metrics::Metrics::new());
    let started = start(&a, stop.clone(), m.clone())?;
    let mut app = started
        .router
        .merge(
            Router::new()
                .route("/health", get(health))
                .route("/metrics", get(metrics_text))
                .with_state(started.common.clone()),
        )
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed);
    if a.debug_routes {
        app = app.route("/debug/panic", get(debug_panic));
    }
    let app = app
        .layer(axum::middleware::from_fn_with_state(m, metrics::track))
        .layer(CatchPanicLayer::custom(http::panic_response))
        .layer(DefaultBodyLimit::max(a.body_limit));

    let code = Arc::new(AtomicI32::new(0));
    let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        println!("listening on http://{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal(
                code.clone(),
                stop.clone(),
                a.save_dir.is_some(),
            ))
            .await
            .context("serving")
    })?;
    stop.store(true, Ordering::SeqCst);
    let summary = started
        .trainer
        .join()
        .map_err(|_| anyhow::anyhow!("the trainer thread panicked"))??;
    println!(
        "stopped: {} training steps, version {}, checkpoint {}",
        summary.steps,
        summary.version,
        summary
            .checkpoint
            .map_or("none (no --save-dir)".into(), |p| p.display().to_string())
    );
    std::io::stdout().flush()?;
    std::process::exit(code.load(Ordering::SeqCst));
}
