//! Embedding types on the client routes (`crate::quantize`): the names a request asked for,
//! the space's int8 scale when `int8` or `uint8` is among them, and each vector in each type
//! as JSON. Cohere's `/v2/embed` answers every type in `embeddings`; the OpenAI route takes the
//! quantized ones as an extension (`embedding_types`) and answers them beside `embedding`,
//! never in it (the official SDK decodes `embedding` as float32).

use serde_json::{Value, json};

use super::client_api::Embedded;
use super::error::ApiError;
use super::openai_api::base64_of;
use crate::hub::Hub;
use crate::hub::space_scales::ScaleError;
use crate::quantize::{EmbeddingType, Int8Scale, binary, ubinary};

/// The types named in a request, each once, in the order asked; a name that is not one, or
/// that `allowed` refuses, is a 400 that says what is served (the name is not echoed if it
/// could be a secret).
pub(super) fn parse(
    names: &[String],
    allowed: impl Fn(EmbeddingType) -> bool,
    served: &str,
) -> Result<Vec<EmbeddingType>, ApiError> {
    let mut types = Vec::new();
    for name in names {
        match EmbeddingType::parse(name).filter(|t| allowed(*t)) {
            Some(t) if !types.contains(&t) => types.push(t),
            Some(_) => {}
            None => {
                return Err(ApiError::bad_request(format!(
                    "embedding type '{}' is not served here; use {served}",
                    crate::secret::redact(name)
                )));
            }
        }
    }
    Ok(types)
}

/// The int8 scale of the space the vectors came from, when a type needs it.
pub(super) async fn scale_for(
    hub: &Hub,
    done: &Embedded,
    types: &[EmbeddingType],
) -> Result<Option<Int8Scale>, ApiError> {
    if !types.iter().any(|t| t.needs_scale()) {
        return Ok(None);
    }
    let Some(first) = done.vectors.first() else {
        return Ok(None);
    };
    let Some(space) = first.space.as_deref() else {
        return Err(ApiError::new(
            axum::http::StatusCode::UNPROCESSABLE_ENTITY,
            "no_space",
            "int8 and uint8 are quantized with their vector space's scale, and these vectors \
             came with none; ask for float, base64, binary or ubinary",
        ));
    };
    let width = first.vector.len();
    // One scale per response: vectors of another space, generation or width would be
    // quantized with a scale that is not theirs.
    let same = |v: &super::client_api::Embedding| {
        v.vector.len() == width
            && v.space
                .as_deref()
                .is_some_and(|s| s.id == space.id && s.generation == space.generation)
    };
    if !done.vectors.iter().all(same) {
        return Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "mixed_spaces",
            "these vectors came from more than one vector space or width, and int8 and uint8 \
             are quantized with one space's scale at one width; send the request again",
        ));
    }
    match hub.int8_scale(space, width).await {
        Ok(scale) => Ok(Some(scale)),
        Err(ScaleError::State(e)) => Err(ApiError::state_write(&e)),
        Err(e @ ScaleError::SpaceChanged(_)) => Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "space_changed",
            e.to_string(),
        )),
        Err(
            e @ (ScaleError::NoFingerprint(..)
            | ScaleError::Unusable(..)
            | ScaleError::UnknownRule(..)),
        ) => Err(ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "no_scale",
            e.to_string(),
        )),
    }
}

/// One vector in one type. `scale` is `Some` whenever `t` needs it ([`scale_for`]).
pub(super) fn encode(t: EmbeddingType, v: &[f32], scale: Option<Int8Scale>) -> Value {
    match (t, scale) {
        (EmbeddingType::Float, _) => json!(v),
        (EmbeddingType::Base64, _) => Value::String(base64_of(v)),
        (EmbeddingType::Binary, _) => json!(binary(v)),
        (EmbeddingType::Ubinary, _) => json!(ubinary(v)),
        (EmbeddingType::Int8, Some(s)) => json!(s.int8(v)),
        (EmbeddingType::Uint8, Some(s)) => json!(s.uint8(v)),
        (EmbeddingType::Int8 | EmbeddingType::Uint8, None) => Value::Null,
    }
}
