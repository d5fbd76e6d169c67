//! API errors as HTTP responses: a status, the error body of the client family whose route
//! answers ([`ErrorShape`]: OpenAI's by default, Cohere's, TEI's, Ollama's), `Retry-After`
//! where the client should come back, and `x-should-retry: false` where coming back cannot
//! help (the openai SDK obeys it instead of retrying a 503 twice).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::hub::HubError;
use crate::hub::core::{RequestFailure, SubmitError, Unservable, UnservableCode};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after_s: Option<u64>,
    /// Sending the same request again cannot succeed soon (`x-should-retry: false`).
    pub final_answer: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
            final_answer: false,
        }
    }

    /// The state store did not take a write: 503 with `Retry-After` while a leader on etcd is
    /// fenced (the write can succeed once etcd answers), 409 once it no longer leads (send it
    /// to the hub that leads), else 500.
    pub fn state_write(e: &crate::hub::state::StateError) -> Self {
        use crate::hub::state::StateError;
        match e {
            StateError::Fenced(_)
            | StateError::Etcd(crate::hub::store::etcd::client::EtcdError::Unavailable {
                ..
            }) => {
                let mut err = Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unreachable",
                    e.to_string(),
                );
                err.retry_after_s = Some(5);
                err
            }
            StateError::Deposed { .. } => {
                Self::new(StatusCode::CONFLICT, "not_leader", e.to_string())
            }
            _ => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "state_write",
                e.to_string(),
            ),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// OpenAI's error body: `{"error": {"message", "type", "code"}}` (also a stream's last
    /// event when it is cut short).
    pub fn body(&self) -> serde_json::Value {
        let kind = if self.status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        json!({"error": {"message": self.message, "type": kind, "param": null, "code": self.code}})
    }
}

/// Which client family's error body a route answers with (each client reads its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`
    OpenAi,
    /// `{"message", "code"}`
    Cohere,
    /// `{"error": "...", "error_type": "Validation"}`
    Tei,
    /// `{"error": "..."}`
    Ollama,
}

/// An [`ApiError`] in the body shape of one client family.
#[derive(Debug)]
pub struct Shaped(pub ApiError, pub ErrorShape);

impl ApiError {
    pub fn shaped(self, shape: ErrorShape) -> Shaped {
        Shaped(self, shape)
    }

    fn body_in(&self, shape: ErrorShape) -> serde_json::Value {
        match shape {
            ErrorShape::OpenAi => self.body(),
            ErrorShape::Cohere => json!({"message": self.message, "code": self.code}),
            ErrorShape::Tei => {
                let kind = match self.status {
                    StatusCode::TOO_MANY_REQUESTS => "Overloaded",
                    StatusCode::SERVICE_UNAVAILABLE => "Unhealthy",
                    s if s.is_server_error() => "Backend",
                    _ => "Validation",
                };
                json!({"error": self.message, "error_type": kind, "code": self.code})
            }
            ErrorShape::Ollama => json!({"error": self.message}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        Shaped(self, ErrorShape::OpenAi).into_response()
    }
}

impl IntoResponse for Shaped {
    fn into_response(self) -> Response {
        let Shaped(err, shape) = self;
        let body = err.body_in(shape);
        let mut response = (err.status, Json(body)).into_response();
        let headers = response.headers_mut();
        if let Some(s) = err.retry_after_s
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            headers.insert(header::RETRY_AFTER, v);
        }
        if err.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if err.final_answer {
            headers.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        response
    }
}

/// What a panicking handler answers: a 500 in OpenAI's shape (the panic is logged; the
/// connection and the process stay up).
pub fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(panic = %crate::secret::redact(&what), "a request handler panicked");
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
        "the server failed while answering this request (its log says where); the request may \
         be sent again",
    )
    .into_response()
}

impl From<HubError> for Shaped {
    fn from(e: HubError) -> Self {
        Shaped(e.into(), ErrorShape::OpenAi)
    }
}

impl From<HubError> for ApiError {
    fn from(e: HubError) -> Self {
        let (message, code) = (e.to_string(), e.code());
        let status = match &e {
            HubError::Submit(SubmitError::Unservable(u) | SubmitError::NotYet(u))
            | HubError::Failed(RequestFailure::Unservable(u)) => {
                return Self::unservable(u.clone());
            }
            HubError::Submit(SubmitError::DimensionsTooLarge { .. })
            | HubError::Submit(SubmitError::PinNotEmbedding(_)) => StatusCode::BAD_REQUEST,
            HubError::Submit(
                SubmitError::QueueFull { .. }
                | SubmitError::HeldBytesFull { .. }
                | SubmitError::Project(_),
            )
            | HubError::Failed(RequestFailure::Project(_)) => StatusCode::TOO_MANY_REQUESTS,
            HubError::Submit(
                SubmitError::TooLarge { .. }
                | SubmitError::TooManyInputs { .. }
                | SubmitError::InputTooLong { .. }
                | SubmitError::InputTooLargeForFrame { .. }
                | SubmitError::TooManyBytes { .. },
            ) => StatusCode::PAYLOAD_TOO_LARGE,
            HubError::Failed(RequestFailure::Fatal { .. }) => StatusCode::UNPROCESSABLE_ENTITY,
            HubError::Failed(
                RequestFailure::TooManyAttempts { .. } | RequestFailure::StreamCut { .. },
            ) => StatusCode::BAD_GATEWAY,
            HubError::Failed(RequestFailure::Stopped) => StatusCode::SERVICE_UNAVAILABLE,
            HubError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
        };
        let mut err = Self::new(status, code, message);
        match e {
            HubError::Submit(
                SubmitError::QueueFull { retry_after_s, .. }
                | SubmitError::HeldBytesFull { retry_after_s, .. },
            ) => err.retry_after_s = Some(retry_after_s),
            HubError::Submit(SubmitError::Project(refusal))
            | HubError::Failed(RequestFailure::Project(refusal)) => {
                err.retry_after_s = Some(refusal.retry_after_s());
                // An allowance resets at midnight UTC: retrying before then cannot help.
                err.final_answer = refusal.code() == "project_quota";
            }
            _ => {}
        }
        err
    }
}

impl ApiError {
    /// Nothing can serve the request: 409 when its vector space changed under it (sending it
    /// again serves it in the new one) or it is pinned to a space its role does not serve,
    /// else 503; `Retry-After` when waiting can help.
    fn unservable(u: Unservable) -> Self {
        let status = match u.code {
            UnservableCode::SpaceChanged | UnservableCode::SpaceNotServed => StatusCode::CONFLICT,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        let mut err = Self::new(status, u.code.as_str(), u.to_string());
        err.retry_after_s = u.retry_after_s;
        // Nothing is coming that could serve it: a retry would only wait to hear it again.
        err.final_answer = status.is_server_error() && u.retry_after_s.is_none();
        err
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::routing::get;

    /// A handler that panics answers 500 in OpenAI's shape, and the connection and the server
    /// stay up for the next request.
    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_the_server_goes_on() {
        async fn boom() -> &'static str {
            panic!("a bug with sk-or-v1-0123456789abcdef0123456789abcdef in its message")
        }
        let app = Router::new()
            .route("/boom", get(boom))
            .route("/ok", get(|| async { "fine" }))
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(
                super::panic_response,
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        for _ in 0..2 {
            let r = client
                .get(format!("http://{addr}/boom"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 500);
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["error"]["code"], "internal_error");
            assert!(!body.to_string().contains("sk-or"), "{body}");
        }
        let ok = client
            .get(format!("http://{addr}/ok"))
            .send()
            .await
            .unwrap();
        assert_eq!(ok.text().await.unwrap(), "fine");
        server.abort();
    }
}
