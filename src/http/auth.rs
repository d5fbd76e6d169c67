//! Bearer-token checks for the three audiences: agents (fleet token), operators (admin
//! token), clients (an optional client key). A refusal never says which part was wrong.

use axum::http::{HeaderMap, StatusCode, header};

use super::error::ApiError;
use crate::secret::Secret;

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Requires `expected` as the bearer token; `audience` names it in the error.
pub fn require(headers: &HeaderMap, expected: &Secret, audience: &str) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(token) if expected.matches(token) => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            format!("the {audience} token does not match"),
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            format!("this endpoint needs 'Authorization: Bearer <{audience} token>'"),
        )),
    }
}
