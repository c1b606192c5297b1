//! `--model llama`: SmolLM2 (GGUF) with a LoRA adapter that keeps training on feedback.
//! The OpenAI routes (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`:
//! [`crate::openai`]) run on one continuous-batching scheduler; `POST /v1/feedback`,
//! `GET /v1/adapters`, `POST /v1/adapters/{name}` (load `--adapters-dir/name`),
//! `POST /v1/adapters/{name}/save` (save the live adapter there), `DELETE /v1/adapters/{name}`,
//! `GET /v1/snapshots/{version}` (the live adapter of a retained version, safetensors).
//!
//! Every answer names the adapter and its version: `live` (the one being trained; its version
//! is the publication number) or a loaded name (its version counts loads). A completion runs
//! entirely on the snapshot it loaded when it arrived: the scheduler keeps that model for
//! the request to its end, and its keys in the paged cache come from those weights only.

use crate::http::{blocking, ApiError, ApiJson};
use crate::metrics::Metrics;
use crate::Args;
use anyhow::{Context, Result};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_core::Device;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use wick::data::packing::{Tokenized, TrainBatch, IGNORE_INDEX};
use wick::lora::{self, LoraConfig};
use wick::models::tokenizer::TextTokenizer;
use wick::models::Source;
use wick::models::{Decoder, DecoderConfig, DecoderWeights, FineTune};
use wick::serve::{
    FeedbackSender, OnlineLearner, Published, QueueError, Scheduler, SchedulerConfig,
};
use wick::{Engine, ParamStore};

/// A feedback example: prompt and preferred completion as one sequence, the loss on the
/// completion's tokens only (the prompt's labels masked).
pub struct Example {
    tokens: Tokenized,
}

pub struct Learner {
    model: Decoder,
    dev: Device,
}

impl OnlineLearner for Learner {
    type Example = Example;
    type Snapshot = Arc<Decoder>;

    /// One sequence per micro-batch (no padding), weighted by its trained (completion)
    /// tokens; the last one closes the accumulation window: one optimizer step per batch.
    fn train_step(&mut self, engine: &mut Engine, batch: &[Example]) -> Result<f32> {
        let (mut loss_sum, mut weight_sum) = (0.0f64, 0.0f64);
        for (i, e) in batch.iter().enumerate() {
            let b = TrainBatch::packed(&[&e.tokens], &self.dev)?;
            let w = b.trained_targets() as f64;
            let f = |_: &wick::StepCtx| self.model.batch_loss(&b);
            let r = if i + 1 == batch.len() {
                engine.step_weighted_closing(w, f)?
            } else {
                engine.step_weighted(w, f)?
            };
            loss_sum += r.loss()? as f64 * w;
            weight_sum += w;
        }
        Ok((loss_sum / weight_sum) as f32)
    }

    fn snapshot(&self, _engine: &Engine) -> Result<Arc<Decoder>> {
        Ok(Arc::new(self.model.snapshot()?))
    }
}

/// A loaded named adapter.
pub struct Named {
    model: Arc<Decoder>,
    pub version: u64,
}

#[derive(Clone)]
pub struct LlamaState {
    pub published: Arc<Published<Arc<Decoder>>>,
    pub named: Arc<RwLock<HashMap<String, Named>>>,
    loads: Arc<AtomicU64>,
    pub tok: Arc<TextTokenizer>,
    lora: LoraConfig,
    adapters_dir: std::path::PathBuf,
    pub max_tokens_limit: usize,
    pub metrics: Arc<Metrics>,
    /// The engine thread every completion runs on.
    pub scheduler: Arc<Scheduler<Decoder>>,
    /// The served model's file or folder name (`/v1/models`' `root`).
    pub base_name: String,
}

#[derive(Clone)]
pub struct Routes {
    pub s: LlamaState,
    feedback: FeedbackSender<Example>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FeedbackRequest {
    prompt: String,
    completion: String,
}

/// The model, adapter name and version a request runs on: the live adapter's current
/// snapshot (`None`, `live`) or a loaded adapter.
pub fn resolve(
    s: &LlamaState,
    adapter: Option<&str>,
) -> Result<(Arc<Decoder>, String, u64), ApiError> {
    match adapter {
        None | Some("live") => {
            let v = s.published.load();
            Ok((v.value.clone(), "live".into(), v.version))
        }
        Some(name) => {
            let named = s.named.read().unwrap_or_else(|e| e.into_inner());
            let n = named.get(name).ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("unknown adapter {name:?} (load it with POST /v1/adapters/{name})"),
                )
            })?;
            Ok((n.model.clone(), name.to_string(), n.version))
        }
    }
}

async fn post_feedback(
    State(r): State<Routes>,
    ApiJson(req): ApiJson<FeedbackRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let s = r.s;
    if req.prompt.is_empty() || req.completion.is_empty() {
        return Err(ApiError::invalid(
            "prompt and completion must both be non-empty",
        ));
    }
    // one BOS at the start (if the file adds one), never between prompt and completion
    let (ids, prompt_len) = s
        .tok
        .encode_prompt_completion_parts(&req.prompt, &req.completion)
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    let positions = s.published.load().value.config().max_position_embeddings;
    if ids.len() > positions + 1 {
        return Err(ApiError::invalid(format!(
            "prompt + completion are {} tokens; at most {} fit the model",
            ids.len(),
            positions + 1
        )));
    }
    let n = ids.len();
    // the loss reads the completion's labels only (and the EOS the file may add after it)
    let labels = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            if k < prompt_len {
                IGNORE_INDEX
            } else {
                id as i64
            }
        })
        .collect();
    let tokens = Tokenized {
        ids,
        labels,
        merged_boundaries: 0,
    };
    r.feedback
        .try_push(Example { tokens })
        .map_err(|e| match e {
            QueueError::Full { .. } => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            QueueError::Closed => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        })?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "queued": 1, "tokens": n, "queue_depth": r.feedback.depth() })),
    ))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !ok {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, format!("adapter name {name:?}: use 1-64 letters, digits, '-', '_', '.' (not starting with '.')")));
    }
    if name == "live" {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "\"live\" is the adapter being trained; pick another name",
        ));
    }
    Ok(())
}

async fn load_adapter(
    State(r): State<Routes>,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let s = r.s;
    check_name(&name)?;
    let dir = s.adapters_dir.join(&name);
    if !dir.join("adapter_config.json").is_file() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "unknown adapter {name:?}: no {}",
                dir.join("adapter_config.json").display()
            ),
        ));
    }
    let (base, lora) = (s.published.load().value.clone(), s.lora.clone());
    let model = blocking(move || {
        let (cfg, tensors) = lora::load_adapters(&dir)?;
        anyhow::ensure!(
            (cfg.scaling() - lora.scaling()).abs() < 1e-12,
            "its scaling alpha/r = {} differs from the served model's {}",
            cfg.scaling(),
            lora.scaling()
        );
        let model = base.with_adapters(&tensors.into_iter().collect())?;
        // CUDA: the copies ran on this thread's stream; other request threads read the model
        model.device().synchronize()?;
        Ok(model)
    })
    .await
    .map_err(|e| ApiError::invalid(format!("adapter {name:?}: {}", e.message)))?;
    let version = s.loads.fetch_add(1, Ordering::SeqCst) + 1;
    s.named.write().unwrap_or_else(|e| e.into_inner()).insert(
        name.clone(),
        Named {
            model: Arc::new(model),
            version,
        },
    );
    Ok(Json(
        serde_json::json!({ "adapter": name, "version": version }),
    ))
}

async fn save_live(
    State(r): State<Routes>,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let s = r.s;
    check_name(&name)?;
    let live = s.published.load();
    let (dir, lora, version) = (s.adapters_dir.join(&name), s.lora.clone(), live.version);
    blocking(move || {
        lora::save_adapter_tensors(
            live.value.adapter_tensors(),
            &lora,
            "SmolLM2-135M-Instruct (served)",
            &dir,
        )
    })
    .await?;
    Ok(Json(
        serde_json::json!({ "adapter": name, "saved_from": "live", "version": version }),
    ))
}

async fn drop_adapter(
    State(r): State<Routes>,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let removed =
        r.s.named
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&name);
    match removed {
        Some(n) => Ok(Json(
            serde_json::json!({ "adapter": name, "version": n.version, "dropped": true }),
        )),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown adapter {name:?}"),
        )),
    }
}

async fn list_adapters(State(r): State<Routes>) -> impl IntoResponse {
    let named = r.s.named.read().unwrap_or_else(|e| e.into_inner());
    let mut list: Vec<serde_json::Value> = named
        .iter()
        .map(|(k, v)| serde_json::json!({ "adapter": k, "version": v.version }))
        .collect();
    list.push(serde_json::json!({ "adapter": "live", "version": r.s.published.version() }));
    Json(serde_json::json!({ "adapters": list }))
}

async fn snapshot_weights(
    State(r): State<Routes>,
    Path(version): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let version = crate::http::snapshot_version(&version)?;
    let p = &r.s.published;
    let snap = p.get(version).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "version {version} is not retained (current {})",
                p.version()
            ),
        )
    })?;
    let bytes =
        blocking(move || wick::checkpoint::safetensors_bytes(snap.value.adapter_tensors())).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes))
}

pub fn router(s: LlamaState, feedback: FeedbackSender<Example>) -> Router {
    Router::new()
        .route("/v1/completions", post(crate::openai::completions))
        .route(
            "/v1/chat/completions",
            post(crate::openai::chat_completions),
        )
        .route("/v1/models", get(crate::openai::models))
        .route("/v1/feedback", post(post_feedback))
        .route("/v1/adapters", get(list_adapters))
        .route(
            "/v1/adapters/{name}",
            post(load_adapter).delete(drop_adapter),
        )
        .route("/v1/adapters/{name}/save", post(save_live))
        .route("/v1/snapshots/{version}", get(snapshot_weights))
        .with_state(Routes { s, feedback })
}

/// Loads the tokenizer and the model (`--gguf` or `--hf`, any decoder family, or `--tiny`),
/// LoRA on every block linear.
pub fn build(
    a: &Args,
    dev: &Device,
    metrics: Arc<Metrics>,
) -> Result<(Engine, Learner, LlamaState)> {
    let default = std::path::PathBuf::from("data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let gguf = match (&a.gguf, &a.hf) {
        (None, None) => Some(default.as_path()),
        (g, _) => g.as_deref(),
    };
    let source = Source::from_args(gguf, a.hf.as_deref())?;
    let config = source.config().with_context(|| {
        format!(
            "{} (for the default model, run scripts/fetch_smollm2.sh)",
            source.path().display()
        )
    })?;
    let tok = Arc::new(source.tokenizer()?);
    let weights = if a.tiny {
        let mut c = DecoderConfig::tiny_family(config.model_type, config.vocab_size);
        c.eos_token_id = config.eos_token_id;
        DecoderWeights::random(c, a.seed)?
    } else {
        source.weights()?
    };
    let lora = LoraConfig::all_linear(a.lora_rank, 2.0 * a.lora_rank as f64);
    let store = ParamStore::new(a.precision, dev.clone(), a.seed);
    let model = Decoder::new(&store, &weights, &FineTune::Lora(lora.clone()))?;
    drop(weights);
    let mut config = crate::engine_config(a);
    config.accumulation_steps = a.train_batch.max(1);
    let mut engine = Engine::new(store, config)?;
    let version = crate::resume(a, &mut engine)?;
    let learner = Learner {
        model,
        dev: dev.clone(),
    };
    let first = learner.snapshot(&engine)?;
    let sched = SchedulerConfig {
        block_size: a.kv_block_size,
        num_blocks: a.kv_blocks,
        max_running: a.max_running,
        max_waiting: a.max_waiting,
        step_tokens: a.step_tokens,
    };
    let detok = tok.clone();
    let detokenize: wick::serve::Detokenize = Arc::new(move |ids: &[u32]| detok.decode(ids));
    let scheduler = Scheduler::spawn(first.clone(), sched, Some(detokenize)).context(
        "starting the scheduler (flags --kv-block-size, --kv-blocks, --max-running, \
         --max-waiting, --step-tokens)",
    )?;
    let _ = metrics.scheduler.set(scheduler.stats().clone());
    let base_name = source
        .path()
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let state = LlamaState {
        published: Arc::new(Published::starting_at(first, version, a.keep_versions)),
        named: Default::default(),
        loads: Default::default(),
        tok,
        lora,
        adapters_dir: a.adapters_dir.clone(),
        max_tokens_limit: a.max_tokens_limit,
        metrics,
        scheduler: Arc::new(scheduler),
        base_name,
    };
    Ok((engine, learner, state))
}
