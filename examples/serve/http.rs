//! JSON errors for every bad request: a body extractor whose rejections name the problem,
//! the 404/405 fallbacks and the panic handler.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;

/// An error answer: `{"error": {"status": 422, "message": "..."}}` with that status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    /// 422: a well-formed body whose values are not acceptable.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
    }
    /// 500: the server failed (the message says where).
    pub fn internal(e: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": { "status": self.status.as_u16(), "message": self.message }
        });
        (self.status, Json(body)).into_response()
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s: 400 (not JSON), 413 (over the body limit),
/// 415 (no JSON content type), 422 (a missing field or a wrong type, named with its path).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(r) => Err(rejection(r)),
        }
    }
}

fn rejection(r: JsonRejection) -> ApiError {
    let status = r.status();
    let message = match status {
        StatusCode::PAYLOAD_TOO_LARGE => format!(
            "the request body is over the size limit ({})",
            r.body_text()
        ),
        _ => r.body_text(),
    };
    ApiError::new(status, message)
}

/// The `{version}` of `GET /v1/snapshots/{version}`: a whole number, else 400 with a JSON
/// error (axum's `Path<u64>` would answer plain text).
pub fn snapshot_version(text: &str) -> Result<u64, ApiError> {
    text.parse().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("snapshot version {text:?} is not a version number: use a whole number >= 0, e.g. /v1/snapshots/0"),
        )
    })
}

/// 404 for a route that does not exist.
pub async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

/// 405 for a known route with another method.
pub async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// The answer to a request whose handler panicked (tower-http's `CatchPanicLayer`): 500 with
/// the panic message; the server goes on.
pub fn panic_response(err: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    ApiError::internal(format!("the request handler panicked: {what}")).into_response()
}

/// Runs `f` (model compute) on the blocking pool; a panic inside becomes a 500.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ApiError::internal(format!("{e:#}"))),
        Err(e) => Err(ApiError::internal(format!("the computation failed: {e}"))),
    }
}
