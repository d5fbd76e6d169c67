//! A cloud route: one role served by one OpenRouter model, optionally pinned to one upstream
//! endpoint (a full endpoint slug and, optionally, a quantization).
//!
//! Owns the pin's validation, the route's budget key and provenance text, and the `provider`
//! preferences object OpenRouter receives. An embedding route cannot exist without a pin and
//! dims (fail closed: two upstreams of one model can return different vectors).

use serde_json::{Map, Value};

use crate::config::push::{AllowedModel, MAX_DIMS};
use crate::roles::{Op, Role};

/// OpenRouter's `ProviderPreferences.quantizations` values.
pub const QUANTIZATIONS: [&str; 12] = [
    "int4", "int8", "fp4", "mxfp4", "nvfp4", "fp6", "fp8", "mxfp8", "fp16", "bf16", "fp32",
    "unknown",
];

/// The longest upstream endpoint slug a pin may name.
pub const MAX_SLUG_CHARS: usize = 200;

/// One upstream endpoint of a model: the full endpoint slug (e.g. `deepinfra/bf16`; a base slug
/// such as `deepinfra` matches every endpoint of that provider) and an optional quantization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pin {
    slug: String,
    quantization: Option<String>,
}

impl Pin {
    /// Validates a pin: the slug is non-empty, has no whitespace and at most
    /// [`MAX_SLUG_CHARS`] characters (surrounding whitespace is trimmed); the quantization,
    /// when given, is one of [`QUANTIZATIONS`] (case-insensitive).
    pub fn new(slug: &str, quantization: Option<&str>) -> Result<Pin, RouteError> {
        let slug = slug.trim();
        let refuse = |reason: &'static str| RouteError::BadSlug { reason };
        if slug.is_empty() {
            return Err(refuse("it is empty"));
        }
        if slug.chars().any(char::is_whitespace) {
            return Err(refuse("it contains whitespace"));
        }
        if slug.chars().count() > MAX_SLUG_CHARS {
            return Err(refuse("it is longer than 200 characters"));
        }
        let quantization = match quantization {
            None => None,
            Some(q) => {
                let q = q.trim().to_ascii_lowercase();
                if !QUANTIZATIONS.contains(&q.as_str()) {
                    return Err(RouteError::BadQuantization);
                }
                Some(q)
            }
        };
        Ok(Pin {
            slug: slug.to_string(),
            quantization,
        })
    }

    pub fn slug(&self) -> &str {
        &self.slug
    }

    pub fn quantization(&self) -> Option<&str> {
        self.quantization.as_deref()
    }
}

/// A role's cloud model, ready to call.
#[derive(Clone, Debug, PartialEq)]
pub enum CloudRoute {
    /// Stored vectors: always pinned, always a known width.
    Embedding {
        role: Role,
        model: String,
        pin: Pin,
        dims: usize,
    },
    Rerank {
        model: String,
        pin: Option<Pin>,
    },
    Chat {
        role: Role,
        model: String,
        pin: Option<Pin>,
    },
}

impl CloudRoute {
    /// From a role's pushed model. The role's [`Op`] decides the variant; an embedding role
    /// without a provider pin or dims is refused.
    pub fn from_allowed(role: Role, m: &AllowedModel) -> Result<CloudRoute, RouteError> {
        let model = m.model.trim();
        if model.is_empty() {
            return Err(RouteError::EmptyModel { role });
        }
        if model.chars().any(char::is_whitespace) {
            return Err(RouteError::BadModel { role });
        }
        let model = model.to_string();
        let provider = m
            .provider
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty());
        let quantization = m.quantization.as_deref();
        match role.op() {
            Op::Embed => {
                let Some(slug) = provider else {
                    return Err(RouteError::Unpinned { role });
                };
                let dims = match m.dims {
                    None => return Err(RouteError::MissingDims { role }),
                    Some(dims) if dims == 0 || dims > MAX_DIMS => {
                        return Err(RouteError::BadDims { role, dims });
                    }
                    Some(dims) => dims,
                };
                let pin = Pin::new(slug, quantization)?;
                Ok(CloudRoute::Embedding {
                    role,
                    model,
                    pin,
                    dims,
                })
            }
            Op::Rerank => Ok(CloudRoute::Rerank {
                model,
                pin: optional_pin(role, provider, quantization)?,
            }),
            Op::Chat => Ok(CloudRoute::Chat {
                role,
                model,
                pin: optional_pin(role, provider, quantization)?,
            }),
        }
    }

    pub fn role(&self) -> Role {
        match self {
            CloudRoute::Embedding { role, .. } | CloudRoute::Chat { role, .. } => *role,
            CloudRoute::Rerank { .. } => Role::Reranker,
        }
    }

    /// The OpenRouter model slug.
    pub fn model(&self) -> &str {
        match self {
            CloudRoute::Embedding { model, .. }
            | CloudRoute::Rerank { model, .. }
            | CloudRoute::Chat { model, .. } => model,
        }
    }

    pub fn pin(&self) -> Option<&Pin> {
        match self {
            CloudRoute::Embedding { pin, .. } => Some(pin),
            CloudRoute::Rerank { pin, .. } | CloudRoute::Chat { pin, .. } => pin.as_ref(),
        }
    }

    /// The vector width of an embedding route.
    pub fn dims(&self) -> Option<usize> {
        match self {
            CloudRoute::Embedding { dims, .. } => Some(*dims),
            CloudRoute::Rerank { .. } | CloudRoute::Chat { .. } => None,
        }
    }

    /// Provenance text of the pinned upstream: `slug`, or `slug:quantization`.
    pub fn upstream(&self) -> Option<String> {
        self.pin().map(|pin| match pin.quantization() {
            Some(q) => format!("{}:{q}", pin.slug()),
            None => pin.slug().to_string(),
        })
    }

    /// The budget route key, stable across pushes of the same route:
    /// `role:model` or `role:model@upstream`.
    pub fn key(&self) -> String {
        match self.upstream() {
            Some(upstream) => format!("{}:{}@{upstream}", self.role(), self.model()),
            None => format!("{}:{}", self.role(), self.model()),
        }
    }

    /// OpenRouter's `provider` object for a pinned route: only the pinned endpoint, no
    /// fallbacks, every sent parameter honoured, and the quantization filter when set.
    pub fn provider_preferences(&self) -> Option<Value> {
        let pin = self.pin()?;
        let mut prefs = Map::new();
        prefs.insert(
            "only".to_string(),
            Value::Array(vec![Value::from(pin.slug())]),
        );
        prefs.insert("allow_fallbacks".to_string(), Value::Bool(false));
        prefs.insert("require_parameters".to_string(), Value::Bool(true));
        if let Some(q) = pin.quantization() {
            prefs.insert(
                "quantizations".to_string(),
                Value::Array(vec![Value::from(q)]),
            );
        }
        Some(Value::Object(prefs))
    }
}

/// Why a pushed model cannot become a route.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error("role {role}: the model is empty")]
    EmptyModel { role: Role },
    // No refusal repeats the value: it may be something typed into the wrong field.
    #[error("role {role}: the model contains whitespace")]
    BadModel { role: Role },
    #[error("role {role}: an embedding route needs a pinned upstream provider (fail closed)")]
    Unpinned { role: Role },
    #[error("role {role}: an embedding route needs dims, the width of its vectors (fail closed)")]
    MissingDims { role: Role },
    #[error("role {role}: dims is outside 1..={max}", max = MAX_DIMS)]
    BadDims { role: Role, dims: usize },
    #[error("the upstream provider slug is refused: {reason}")]
    BadSlug { reason: &'static str },
    #[error("the quantization is not one of: {list}", list = QUANTIZATIONS.join(", "))]
    BadQuantization,
    #[error("role {role}: a quantization filter needs a pinned upstream provider")]
    QuantizationWithoutPin { role: Role },
}

fn optional_pin(
    role: Role,
    provider: Option<&str>,
    quantization: Option<&str>,
) -> Result<Option<Pin>, RouteError> {
    match (provider, quantization) {
        (Some(slug), q) => Ok(Some(Pin::new(slug, q)?)),
        (None, Some(_)) => Err(RouteError::QuantizationWithoutPin { role }),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn allowed(json: &str) -> AllowedModel {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn embedding_routes_without_pin_or_dims_are_refused() {
        let unpinned = allowed(r#"{"model":"qwen/qwen3-embedding-4b","dims":2560}"#);
        let err = CloudRoute::from_allowed(Role::CodeEmbedding, &unpinned).unwrap_err();
        assert_eq!(
            err,
            RouteError::Unpinned {
                role: Role::CodeEmbedding
            }
        );
        assert!(err.to_string().contains("fail closed"), "{err}");

        let blank = allowed(r#"{"model":"m","provider":"  ","dims":2560}"#);
        assert!(matches!(
            CloudRoute::from_allowed(Role::Embedding, &blank),
            Err(RouteError::Unpinned { .. })
        ));

        let no_dims = allowed(r#"{"model":"m","provider":"deepinfra/bf16"}"#);
        assert_eq!(
            CloudRoute::from_allowed(Role::Embedding, &no_dims),
            Err(RouteError::MissingDims {
                role: Role::Embedding
            })
        );

        let zero = allowed(r#"{"model":"m","provider":"deepinfra/bf16","dims":0}"#);
        assert!(matches!(
            CloudRoute::from_allowed(Role::Embedding, &zero),
            Err(RouteError::BadDims { dims: 0, .. })
        ));

        let empty = allowed(r#"{"model":" ","provider":"p","dims":8}"#);
        assert!(matches!(
            CloudRoute::from_allowed(Role::Embedding, &empty),
            Err(RouteError::EmptyModel { .. })
        ));
    }

    #[test]
    fn a_pinned_embedding_route_sends_exactly_the_pin() {
        let m = allowed(
            r#"{"model":"qwen/qwen3-embedding-4b","provider":"deepinfra/bf16","dims":2560}"#,
        );
        let route = CloudRoute::from_allowed(Role::CodeEmbedding, &m).unwrap();
        assert_eq!(route.role(), Role::CodeEmbedding);
        assert_eq!(route.model(), "qwen/qwen3-embedding-4b");
        assert_eq!(route.dims(), Some(2560));
        assert_eq!(route.upstream().as_deref(), Some("deepinfra/bf16"));
        assert_eq!(
            route.key(),
            "code-embedding:qwen/qwen3-embedding-4b@deepinfra/bf16"
        );
        assert_eq!(
            route.provider_preferences(),
            Some(json!({
                "only": ["deepinfra/bf16"],
                "allow_fallbacks": false,
                "require_parameters": true
            }))
        );
    }

    #[test]
    fn quantization_is_validated_and_sent() {
        let m = allowed(r#"{"model":"m","provider":"nebius","dims":4096,"quantization":"FP8"}"#);
        let route = CloudRoute::from_allowed(Role::Embedding, &m).unwrap();
        assert_eq!(route.pin().and_then(Pin::quantization), Some("fp8"));
        assert_eq!(route.upstream().as_deref(), Some("nebius:fp8"));
        assert_eq!(route.key(), "embedding:m@nebius:fp8");
        assert_eq!(
            route.provider_preferences(),
            Some(json!({
                "only": ["nebius"],
                "allow_fallbacks": false,
                "require_parameters": true,
                "quantizations": ["fp8"]
            }))
        );

        let bad = allowed(r#"{"model":"m","provider":"nebius","dims":4096,"quantization":"q4"}"#);
        assert!(matches!(
            CloudRoute::from_allowed(Role::Embedding, &bad),
            Err(RouteError::BadQuantization)
        ));
        assert!(Pin::new("deep infra", None).is_err());
        assert!(Pin::new(&"x".repeat(MAX_SLUG_CHARS + 1), None).is_err());
        assert!(Pin::new(&"x".repeat(MAX_SLUG_CHARS), Some("bf16")).is_ok());
    }

    #[test]
    fn rerank_and_chat_routes_may_be_unpinned() {
        let m = allowed(r#"{"model":"cohere/rerank-v3.5"}"#);
        let rerank = CloudRoute::from_allowed(Role::Reranker, &m).unwrap();
        assert!(matches!(rerank, CloudRoute::Rerank { pin: None, .. }));
        assert_eq!(rerank.role(), Role::Reranker);
        assert_eq!(rerank.key(), "reranker:cohere/rerank-v3.5");
        assert_eq!(rerank.provider_preferences(), None);
        assert_eq!(rerank.upstream(), None);
        assert_eq!(rerank.dims(), None);

        let m = allowed(r#"{"model":"poolside/laguna-s-2.1","dims":12}"#);
        let chat = CloudRoute::from_allowed(Role::CodeAssistant, &m).unwrap();
        assert!(matches!(chat, CloudRoute::Chat { pin: None, .. }));
        assert_eq!(chat.provider_preferences(), None);
        assert_eq!(chat.key(), "code-assistant:poolside/laguna-s-2.1");

        let pinned = allowed(r#"{"model":"m","provider":"together"}"#);
        let chat = CloudRoute::from_allowed(Role::RlmSandbox, &pinned).unwrap();
        assert_eq!(chat.key(), "rlm-sandbox:m@together");
        assert!(chat.provider_preferences().is_some());

        let q_only = allowed(r#"{"model":"m","quantization":"fp8"}"#);
        assert_eq!(
            CloudRoute::from_allowed(Role::CodeAssistant, &q_only),
            Err(RouteError::QuantizationWithoutPin {
                role: Role::CodeAssistant
            })
        );
    }
}
