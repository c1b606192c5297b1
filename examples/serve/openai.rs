//! OpenAI-compatible routes of `--model llama`, served by the continuous-batching scheduler:
//! `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template), both
//! as JSON or server-sent events (`"stream": true`), and `GET /v1/models` (the live adapter
//! and the loaded ones, with their versions).
//!
//! Requests follow OpenAI's fields: `model` (`live`, a loaded adapter's name, or the served
//! model's id, which is `live`), `prompt` / `messages`, `max_tokens`, `temperature`,
//! `top_p`, `seed`, `stop` (a string or up to 4), `stream`, `n` (1 only), `user`. A field
//! OpenAI has and wick does not implement (`logprobs`, `presence_penalty`, ...) is refused
//! with 422 naming it, never ignored. Answers add wick's `adapter` and `version` (the
//! snapshot that computed the whole answer) and `token_ids`.

use crate::http::{ApiError, ApiJson};
use crate::llama::{resolve, LlamaState, Routes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use wick::models::tokenizer::ChatMessage;
use wick::serve::{Event, Request, SamplingParams, SubmitError};

fn default_max_tokens() -> usize {
    16
}
fn default_top_p() -> f64 {
    1.0
}

/// `stop`: one string or a list.
#[derive(Deserialize, Default)]
#[serde(untagged)]
enum Stop {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

/// A request of either route: `prompt` for completions, `messages` for chat (the other
/// refused), and the sampling fields they share.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiRequest {
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    model: Option<String>,
    /// wick's name for `model` (kept from before the OpenAI routes).
    adapter: Option<String>,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default)]
    temperature: f64,
    #[serde(default = "default_top_p")]
    top_p: f64,
    /// Absent: a fresh random seed per request (OpenAI's behaviour).
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Stop,
    #[serde(default)]
    stream: bool,
    n: Option<usize>,
    #[allow(dead_code)] // accepted: it names the caller, it does not change the answer
    user: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: String,
}

/// Which route answers: its object names and how text is carried.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// Everything a streamed or collected answer needs besides the events.
struct Answering {
    kind: Kind,
    id: String,
    created: u64,
    adapter: String,
    version: u64,
}

impl Answering {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A choice carrying `text` (a delta when streaming).
    fn choice(&self, text: &str, finish: Option<&str>, chunk: bool) -> Value {
        match (self.kind, chunk) {
            (Kind::Completion, _) => {
                json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish })
            }
            (Kind::Chat, false) => json!({
                "index": 0, "message": { "role": "assistant", "content": text },
                "finish_reason": finish,
            }),
            (Kind::Chat, true) => json!({
                "index": 0, "delta": { "role": "assistant", "content": text },
                "finish_reason": finish,
            }),
        }
    }

    fn envelope(&self, chunk: bool, choice: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(chunk), "created": self.created,
            "model": self.adapter, "adapter": self.adapter, "version": self.version,
            "choices": [choice],
        })
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn params(s: &OpenAiRequest, limit: usize) -> Result<SamplingParams, ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n: only 1 choice per request is served"));
    }
    if s.max_tokens == 0 || s.max_tokens > limit {
        return Err(ApiError::invalid(format!(
            "max_tokens {} is out of range: 1..={limit} (--max-tokens-limit)",
            s.max_tokens
        )));
    }
    if !(s.temperature.is_finite() && (0.0..=100.0).contains(&s.temperature)) {
        return Err(ApiError::invalid(format!(
            "temperature {} must be in 0..=100 (0: greedy)",
            s.temperature
        )));
    }
    let stop = match &s.stop {
        Stop::None => vec![],
        Stop::One(x) => vec![x.clone()],
        Stop::Many(v) => v.clone(),
    };
    let p = SamplingParams {
        max_tokens: s.max_tokens,
        temperature: s.temperature,
        top_p: s.top_p,
        seed: s.seed.unwrap_or_else(rand::random),
        stop,
    };
    p.validate()
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    Ok(p)
}

/// `model` and `adapter` name the same thing; both given, they must agree.
fn adapter_name(s: &OpenAiRequest) -> Result<Option<&str>, ApiError> {
    match (s.model.as_deref(), s.adapter.as_deref()) {
        (Some(m), Some(a)) if m != a => Err(ApiError::invalid(format!(
            "model {m:?} and adapter {a:?} disagree; give one of them"
        ))),
        (m, a) => Ok(m.or(a)),
    }
}

pub async fn completions(
    State(r): State<Routes>,
    ApiJson(req): ApiJson<OpenAiRequest>,
) -> Result<Response, ApiError> {
    if req.messages.is_some() {
        return Err(ApiError::invalid(
            "messages is for POST /v1/chat/completions; /v1/completions takes prompt",
        ));
    }
    let text = req.prompt.as_deref().unwrap_or("");
    if text.is_empty() {
        return Err(ApiError::invalid("prompt is missing or empty"));
    }
    let prompt =
        r.s.tok
            .encode(text)
            .map_err(|e| ApiError::invalid(format!("prompt: {e:#}")))?;
    answer(&r.s, Kind::Completion, prompt, &req).await
}

pub async fn chat_completions(
    State(r): State<Routes>,
    ApiJson(req): ApiJson<OpenAiRequest>,
) -> Result<Response, ApiError> {
    if req.prompt.is_some() {
        return Err(ApiError::invalid(
            "prompt is for POST /v1/completions; /v1/chat/completions takes messages",
        ));
    }
    let messages: Vec<ChatMessage> = req
        .messages
        .iter()
        .flatten()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m.content.clone(),
        })
        .collect();
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages is missing or empty; give at least one",
        ));
    }
    let text =
        r.s.tok
            .apply_chat_template(&messages, true)
            .map_err(|e| ApiError::invalid(format!("messages: {e:#}")))?;
    // the template writes the special tokens itself (transformers tokenizes it without any)
    let prompt =
        r.s.tok
            .encode_with(&text, false)
            .map_err(|e| ApiError::invalid(format!("messages: {e:#}")))?;
    answer(&r.s, Kind::Chat, prompt, &req).await
}

/// Submits the request to the scheduler and answers as JSON or SSE.
async fn answer(
    s: &LlamaState,
    kind: Kind,
    prompt: Vec<u32>,
    sampling: &OpenAiRequest,
) -> Result<Response, ApiError> {
    let (model, adapter, version) = resolve(s, adapter_name(sampling)?)?;
    let params = params(sampling, s.max_tokens_limit)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let request = Request {
        model,
        prompt,
        params,
        on_event: Box::new(move |e| tx.send(e).is_ok()),
    };
    s.scheduler.submit(request).map_err(|e| match e {
        SubmitError::Busy { .. } => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
        SubmitError::Closed => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        SubmitError::TooLong { .. } | SubmitError::Invalid(_) => ApiError::invalid(e.to_string()),
    })?;
    let a = Answering {
        kind,
        id: format!(
            "{}-{}",
            match kind {
                Kind::Completion => "cmpl",
                Kind::Chat => "chatcmpl",
            },
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        adapter,
        version,
    };
    let metrics = s.metrics.clone();
    let t = Instant::now();
    if sampling.stream {
        let events = async_stream(a, rx, move |n| {
            metrics.tokens.inc_by(n as u64);
            metrics
                .tokens_per_second
                .set(n as f64 / t.elapsed().as_secs_f64().max(1e-9));
        });
        return Ok(Sse::new(events).into_response());
    }
    let (mut text, mut ids) = (String::new(), Vec::new());
    while let Some(e) = rx.recv().await {
        match e {
            Event::Token { id, text: t } => {
                ids.push(id);
                text.push_str(&t);
            }
            Event::Done {
                reason,
                text: rest,
                prompt_tokens,
                completion_tokens,
            } => {
                text.push_str(&rest);
                metrics.tokens.inc_by(completion_tokens as u64);
                metrics
                    .tokens_per_second
                    .set(completion_tokens as f64 / t.elapsed().as_secs_f64().max(1e-9));
                let mut v = a.envelope(false, a.choice(&text, Some(reason.as_str()), false));
                v["usage"] = json!({
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                });
                v["token_ids"] = json!(ids);
                return Ok(Json(v).into_response());
            }
            Event::Failed(m) => return Err(ApiError::internal(m)),
        }
    }
    Err(ApiError::internal(
        "the scheduler stopped before the answer was complete",
    ))
}

/// The scheduler's events as SSE chunks: one per token (its text delta, `token_id`), a last
/// one with `finish_reason` and `usage`, then `data: [DONE]`; an `error` event if the model
/// fails. `done(n)` is called with the completion's token count at the end. A forwarding
/// task converts them; when the client goes away, the task ends, the scheduler's next send
/// fails and the request is cancelled.
fn async_stream(
    a: Answering,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    done: impl FnOnce(usize) + Send + 'static,
) -> impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    let (tx, out) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            let data = match e {
                Event::Token { id, text } => {
                    let mut v = a.envelope(true, a.choice(&text, None, true));
                    v["token_id"] = json!(id);
                    v
                }
                Event::Done {
                    reason,
                    text,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    done(completion_tokens);
                    let mut v = a.envelope(true, a.choice(&text, Some(reason.as_str()), true));
                    v["usage"] = json!({
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    });
                    let _ = tx.send(SseEvent::default().data(v.to_string())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                Event::Failed(m) => {
                    let error = json!({ "error": m }).to_string();
                    let _ = tx
                        .send(SseEvent::default().event("error").data(error))
                        .await;
                    return;
                }
            };
            if tx
                .send(SseEvent::default().data(data.to_string()))
                .await
                .is_err()
            {
                return; // the client went away
            }
        }
    });
    tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(out), Ok)
}

/// `GET /v1/models`: the live adapter (the one being trained, its version the publication
/// number) and each loaded adapter with its version, on the served base model.
pub async fn models(State(r): State<Routes>) -> impl IntoResponse {
    let s = &r.s;
    let mut data = vec![json!({
        "id": "live", "object": "model", "owned_by": "wick", "root": s.base_name,
        "version": s.published.version(), "training": true,
    })];
    let named = s.named.read().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<_> = named.iter().collect();
    names.sort_by(|a, b| a.0.cmp(b.0));
    for (name, n) in names {
        data.push(json!({
            "id": name, "object": "model", "owned_by": "wick", "root": s.base_name,
            "version": n.version, "training": false,
        }));
    }
    Json(json!({ "object": "list", "data": data }))
}
