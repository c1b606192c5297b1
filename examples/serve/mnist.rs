//! `--model mnist`: an MLP or CNN classifier. `POST /predict`, `POST /feedback`,
//! `GET /v1/snapshots/{version}` (the weights that produced a version's answers).

use crate::http::{blocking, ApiError, ApiJson};
use crate::Args;
use anyhow::{Context, Result};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_core::{DType, Device, Tensor, D};
use serde::Deserialize;
use std::sync::Arc;
use wick::serve::{
    copy_params, FeedbackSender, OnlineLearner, ParamSnapshot, Published, QueueError,
};
use wick::{loss, nn, Engine, ParamStore, Precision};

pub use crate::mnist_net::{Arch, Net, CLASSES, PIXELS};

/// The network's layers over a snapshot's copies (no store, no gradients).
fn net_from_snapshot(arch: Arch, s: &ParamSnapshot, p: Precision) -> Result<Net> {
    let t = |n: &str| -> Result<Tensor> { Ok(s.get(n)?.clone()) };
    let lin = |n: &str| -> Result<nn::Linear> {
        Ok(nn::Linear::from_tensors(
            t(&format!("{n}.weight"))?,
            Some(t(&format!("{n}.bias"))?),
            p,
        )?)
    };
    let conv = |n: &str| -> Result<nn::Conv2d> {
        let cfg = candle_nn::Conv2dConfig::default();
        Ok(nn::Conv2d::from_tensors(
            t(&format!("{n}.weight"))?,
            Some(t(&format!("{n}.bias"))?),
            cfg,
            p,
        )?)
    };
    Ok(match arch {
        Arch::Mlp => Net::Mlp(lin("l1")?, lin("l2")?, lin("l3")?),
        Arch::Cnn => Net::Cnn(conv("c1")?, conv("c2")?, lin("fc")?),
    })
}

/// One published version: the inference network and the tensors it runs on.
pub struct Snapshot {
    net: Net,
    weights: ParamSnapshot,
}

impl Snapshot {
    pub fn new(arch: Arch, weights: ParamSnapshot, p: Precision) -> Result<Self> {
        Ok(Self {
            net: net_from_snapshot(arch, &weights, p)?,
            weights,
        })
    }

    /// Classes and softmax probabilities (f32) of `images` (B rows of 784).
    pub fn predict(&self, images: &[Vec<f32>], dev: &Device) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        let flat: Vec<f32> = images.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (images.len(), PIXELS), dev)?;
        let logits = self.net.forward(&x)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
        let classes = probs.argmax(D::Minus1)?.to_vec1::<u32>()?;
        Ok((classes, probs.to_vec2::<f32>()?))
    }
}

/// A labelled image from `/feedback`.
pub struct Example {
    image: Vec<f32>,
    label: u32,
}

/// The trainer thread's side: the training network and its snapshot recipe.
pub struct Learner {
    pub net: Net,
    pub arch: Arch,
    pub dev: Device,
}

impl OnlineLearner for Learner {
    type Example = Example;
    type Snapshot = Snapshot;

    fn train_step(&mut self, engine: &mut Engine, batch: &[Example]) -> Result<f32> {
        let flat: Vec<f32> = batch.iter().flat_map(|e| e.image.iter().copied()).collect();
        let labels: Vec<u32> = batch.iter().map(|e| e.label).collect();
        let x = Tensor::from_vec(flat, (batch.len(), PIXELS), &self.dev)?;
        let y = Tensor::from_vec(labels, batch.len(), &self.dev)?;
        let report = engine.step(|_| loss::cross_entropy(&self.net.forward(&x)?, &y))?;
        report.loss()
    }

    fn snapshot(&self, engine: &Engine) -> Result<Snapshot> {
        let store = engine.store();
        Snapshot::new(self.arch, copy_params(store, |_| true)?, store.precision())
    }
}

#[derive(Clone)]
pub struct MnistState {
    pub published: Arc<Published<Snapshot>>,
    pub feedback: FeedbackSender<Example>,
    pub dev: Device,
    pub max_batch: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PredictRequest {
    /// B rows of 784 pixel values (0..1, as data/mnist holds them).
    images: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FeedbackRequest {
    images: Vec<Vec<f32>>,
    labels: Vec<i64>,
}

fn check_images(images: &[Vec<f32>], max_batch: usize) -> Result<(), ApiError> {
    if images.is_empty() {
        return Err(ApiError::invalid(
            "images is empty: send 1 or more rows of 784 pixels",
        ));
    }
    if images.len() > max_batch {
        return Err(ApiError::invalid(format!(
            "batch of {} images is too large: at most {max_batch} per request",
            images.len()
        )));
    }
    for (i, row) in images.iter().enumerate() {
        if row.len() != PIXELS {
            return Err(ApiError::invalid(format!(
                "images[{i}] has {} values; each image must have 784 (28x28 pixels)",
                row.len()
            )));
        }
        if let Some(j) = row.iter().position(|v| !v.is_finite()) {
            return Err(ApiError::invalid(format!(
                "images[{i}][{j}] is not a finite number"
            )));
        }
    }
    Ok(())
}

async fn predict(
    State(s): State<MnistState>,
    ApiJson(req): ApiJson<PredictRequest>,
) -> Result<impl IntoResponse, ApiError> {
    check_images(&req.images, s.max_batch)?;
    let snap = s.published.load(); // one version for the whole answer
    let dev = s.dev.clone();
    let version = snap.version;
    let (classes, probabilities) = blocking(move || snap.value.predict(&req.images, &dev)).await?;
    Ok(Json(serde_json::json!({
        "version": version,
        "classes": classes,
        "probabilities": probabilities,
    })))
}

async fn feedback(
    State(s): State<MnistState>,
    ApiJson(req): ApiJson<FeedbackRequest>,
) -> Result<impl IntoResponse, ApiError> {
    check_images(&req.images, s.max_batch)?;
    if req.labels.len() != req.images.len() {
        return Err(ApiError::invalid(format!(
            "{} labels for {} images: give one label per image",
            req.labels.len(),
            req.images.len()
        )));
    }
    if let Some((i, l)) = req
        .labels
        .iter()
        .enumerate()
        .find(|(_, &l)| !(0..CLASSES as i64).contains(&l))
    {
        return Err(ApiError::invalid(format!(
            "labels[{i}] = {l} is not a class 0..=9"
        )));
    }
    let n = req.labels.len();
    let capacity = s.feedback.capacity();
    if n > capacity {
        // a 429 would say "retry later", but this request can never fit
        return Err(ApiError::invalid(format!(
            "{n} examples in one request; the feedback queue holds at most {capacity} \
             (--queue-capacity): send at most {capacity} per request"
        )));
    }
    for (k, (image, label)) in req.images.into_iter().zip(req.labels).enumerate() {
        if let Err(e) = s.feedback.try_push(Example {
            image,
            label: label as u32,
        }) {
            let status = match e {
                QueueError::Full { .. } => StatusCode::TOO_MANY_REQUESTS,
                QueueError::Closed => StatusCode::SERVICE_UNAVAILABLE,
            };
            return Err(ApiError::new(
                status,
                format!("{e} ({k} of {n} examples queued)"),
            ));
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "queued": n, "queue_depth": s.feedback.depth() })),
    ))
}

/// The tensors of a retained version as safetensors (so an answer can be recomputed).
async fn snapshot_weights(
    State(s): State<MnistState>,
    Path(version): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let version = crate::http::snapshot_version(&version)?;
    let snap = s.published.get(version).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "version {version} is not retained (current {}; see --keep-versions)",
                s.published.version()
            ),
        )
    })?;
    let bytes = blocking(move || snap.value.weights.to_safetensors()).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes))
}

pub fn router(state: MnistState) -> Router {
    Router::new()
        .route("/predict", post(predict))
        .route("/feedback", post(feedback))
        .route("/v1/snapshots/{version}", get(snapshot_weights))
        .with_state(state)
}

/// `--init` takes safetensors; a GGUF file (llama.cpp's format, by its magic bytes) would
/// otherwise fail inside the safetensors reader with "header too large".
fn refuse_gguf(init: &std::path::Path) -> Result<()> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(init)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF";
    anyhow::ensure!(
        !is_gguf,
        "--init {}: this is a GGUF file (llama.cpp's format); --init takes the \
         model.safetensors of an examples/mnist.rs checkpoint. To serve a GGUF Decoder, use \
         --model llama --gguf {}",
        init.display(),
        init.display()
    );
    Ok(())
}

/// Builds the store, the network and the engine; resumes from `--save-dir` when it holds a
/// checkpoint, else starts from `--init` (a model.safetensors of examples/mnist.rs) or fresh.
pub fn build(a: &Args, dev: &Device) -> Result<(Engine, Learner, Snapshot, u64)> {
    let store = ParamStore::new(a.precision, dev.clone(), a.seed);
    let net = Net::new(a.arch, a.hidden, &store)?;
    if let Some(init) = &a.init {
        refuse_gguf(init)?;
        let tensors = candle_core::safetensors::load(init, &Device::Cpu)
            .with_context(|| format!("--init {}", init.display()))?;
        store
            .load_masters(&tensors)
            .with_context(|| format!("--init {}", init.display()))?;
    }
    let mut engine = Engine::new(store, crate::engine_config(a))?;
    let version = crate::resume(a, &mut engine)?;
    let learner = Learner {
        net,
        arch: a.arch,
        dev: dev.clone(),
    };
    let first = learner.snapshot(&engine)?;
    Ok((engine, learner, first, version))
}
