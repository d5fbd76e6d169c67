//! The migrations' admin API (the admin token): `GET /admin/migrations` (every embedding
//! role's live spaces and their progress), `POST /admin/migrations` (opens one: the role, what
//! founds its next space, and that space's policy), and
//! `POST /admin/migrations/{role}/{step}` (`cutover`, `close`, `abort`). A step that cannot apply is a 409
//! naming why and what would let it; a fenced leader answers 503. Errors quote no value a
//! caller typed.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::admin_api::admin;
use super::error::ApiError;
use super::openapi::{AdminErrors, AnyObject};
use crate::hub::Hub;
use crate::hub::gate::{Founder, MigrationRefused, Step};
use crate::hub::migration::{MigrationError, StepDone};
use crate::roles::{Policy, Role};
use crate::secret::redact;

/// A migration to open.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewMigration {
    /// The embedding role (`embedding`, `code-embedding`).
    role: String,
    /// What founds the next space: `{"backend": "local", "model": …}` (a model an agent
    /// serves for the role) or `{"backend": "cloud", "model": …, "provider": …, "dims": …}`.
    founder: Founder,
    /// Who may serve requests pinned to the next space, and the role's policy after the
    /// cutover: `local`, `cloud`, `aggregate` or `backup` (default: `local` for a local
    /// founder, `cloud` for a cloud one).
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    policy: Option<Policy>,
}

fn role_of(name: &str) -> Result<Role, ApiError> {
    name.parse::<Role>().map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no_such_role",
            "no such role (the value was not kept); embedding roles: embedding, code-embedding",
        )
    })
}

fn answer(done: Result<StepDone, MigrationError>) -> Result<Json<Value>, ApiError> {
    match done {
        Ok(done) => Ok(Json(json!(done))),
        Err(MigrationError::State(e)) => Err(ApiError::state_write(&e)),
        Err(MigrationError::Refused(r)) => {
            let status = match r {
                MigrationRefused::NotEmbedding(_) | MigrationRefused::Invalid(_) => {
                    StatusCode::BAD_REQUEST
                }
                _ => StatusCode::CONFLICT,
            };
            Err(ApiError::new(status, r.code(), r.to_string()))
        }
    }
}

/// Every embedding role's live spaces (current, and around a migration next and previous),
/// with who passes each and the rows and tokens it served.
#[utoipa::path(get, path = "/admin/migrations", tag = "admin",
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn list(State(hub): State<Hub>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    Ok(Json(json!({ "roles": hub.migrations() })))
}

/// Opens a migration: the role's next space, founded by `founder` and gated against its own
/// fingerprint; requests pinned to it (`X-Fantom-Space`) are served by providers that pass it.
#[utoipa::path(post, path = "/admin/migrations", tag = "admin", request_body = NewMigration,
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn open(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    let m: NewMigration = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "invalid migration body: {}; send {{\"role\": \"embedding\", \"founder\": {{\"backend\": \"cloud\", \"model\": …, \"provider\": …, \"dims\": …}}, \"policy\": \"cloud\"}}",
            redact(&e.to_string())
        ))
    })?;
    let role = role_of(&m.role)?;
    let policy = m.policy.unwrap_or(match m.founder {
        Founder::Local { .. } => Policy::Local,
        Founder::Cloud { .. } => Policy::Cloud,
    });
    answer(
        hub.migrate(
            role,
            Step::Open {
                founder: m.founder,
                policy,
            },
        )
        .await,
    )
}

/// One step of an open migration: `cutover` makes the next space current in one step
/// (persisted before it answers; the old one stays served to pinned requests as `previous`
/// until closed; refused while nothing connected passes the next space), `close` stops
/// serving the previous space, `abort` drops the next space and the providers built for it.
#[utoipa::path(post, path = "/admin/migrations/{role}/{step}", tag = "admin",
    params(("role" = String, Path, description = "The embedding role"),
           ("step" = String, Path, description = "cutover, close or abort")),
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn step(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Path((role, step)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    admin(&hub, &headers)?;
    let step = match step.as_str() {
        "cutover" => Step::Cutover,
        "close" => Step::Close,
        "abort" => Step::Abort,
        _ => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "no_such_step",
                "a migration's steps are cutover, close and abort",
            ));
        }
    };
    answer(hub.migrate(role_of(&role)?, step).await)
}
