//! Cloud routes served through OpenRouter: a role's pushed model as a [`CloudRoute`] (pinned
//! to one upstream endpoint where vectors are stored), the HTTP client that calls it
//! ([`OpenRouterClient`]; a streamed chat in [`chat_stream`], its server-sent events decoded in
//! [`sse`]), the OpenAI-shaped wire format
//! ([`wire`], which the agent's fronted model servers speak too), and the classification of its
//! failures ([`CloudError`]) into rate limits, spending limits, config problems and transient
//! errors.

pub mod chat_stream;
pub mod error;
pub mod openrouter;
pub mod retry_after;
pub mod route;
pub mod sse;
pub mod wire;

pub use error::{CloudError, HardLimit};
pub use openrouter::{Chatted, DEFAULT_BASE_URL, Embedded, KeyInfo, OpenRouterClient, Reranked};
pub use route::{CloudRoute, Pin, RouteError};
