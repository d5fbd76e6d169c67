//! The projects' admin API (the admin token): `GET /admin/projects` (settings and usage,
//! never a key), `POST /admin/projects` (creates one; its key is in this answer only),
//! `PATCH /admin/projects/{name}` (weight, limits, sub-projects; live),
//! `POST /admin/projects/{name}/rotate` (a new key; the old one stops at once) and
//! `DELETE /admin/projects/{name}`. Errors quote no value a caller typed.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::admin_api::admin;
use super::error::ApiError;
use super::openapi::{AdminErrors, AnyObject};
use crate::hub::Hub;
use crate::hub::project_admin::ProjectPatch;
use crate::hub::projects::{ProjectError, ProjectLimits, ProjectSettings};
use crate::secret::{Secret, redact};
use utoipa::ToSchema;

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewProject {
    /// 1 to 64 of `a-z 0-9 - _`, starting with a letter or digit.
    name: String,
    /// Its share of the fleet against other projects (default 1).
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    #[schema(minimum = 1)]
    weight: Option<u32>,
    #[serde(default)]
    limits: ProjectLimits,
    /// Whether `X-FantomMCP-Project` names a sub-project (fair among themselves).
    #[serde(default)]
    sub_projects: bool,
}

/// The one answer that carries a project's key.
#[derive(ToSchema)]
#[allow(dead_code)] // schemas only: the answers are built as JSON
pub struct ProjectKey {
    name: String,
    /// `fsp-` and 64 hex digits: shown once, the hub keeps only its digest.
    key: String,
    note: String,
}

/// A change of a project's settings: absent fields stay; a limit set to null is cleared.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ProjectChange {
    #[schema(minimum = 1)]
    weight: Option<u32>,
    #[schema(value_type = Option<Object>)]
    limits: Option<ProjectLimits>,
    sub_projects: Option<bool>,
}

/// A project removed.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct ProjectRemoved {
    name: String,
    removed: bool,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("invalid project body: {}", redact(&e.to_string())))
    })
}

fn refused(e: ProjectError) -> ApiError {
    let message = e.to_string();
    match e {
        ProjectError::Invalid(_) => ApiError::bad_request(message),
        ProjectError::Exists(_) => ApiError::new(StatusCode::CONFLICT, "project_exists", message),
        ProjectError::NotFound(_) => {
            ApiError::new(StatusCode::NOT_FOUND, "project_not_found", message)
        }
        ProjectError::Default(_) => ApiError::new(StatusCode::CONFLICT, "default_project", message),
        ProjectError::State(e) => ApiError::state_write(&e),
    }
}

/// The one answer that carries a key.
fn with_key(status: StatusCode, name: &str, key: &Secret) -> Response {
    let body = json!({
        "name": name,
        "key": key.expose(),
        "note": "this key is shown once: the hub keeps only its digest",
    });
    (status, Json(body)).into_response()
}
/// Every project with its settings and usage (never a key).
#[utoipa::path(get, path = "/admin/projects", tag = "admin",
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn list(State(hub): State<Hub>, headers: HeaderMap) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    Ok(Json(json!({ "projects": hub.projects_view() })).into_response())
}

/// Creates a project; its key is in this answer only.
#[utoipa::path(post, path = "/admin/projects", tag = "admin", request_body = NewProject,
    responses((status = 201, body = ProjectKey), AdminErrors), security(("admin_token" = [])))]
pub async fn create(
    State(hub): State<Hub>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    let req: NewProject = parse(&body)?;
    let settings = ProjectSettings {
        weight: req.weight.unwrap_or(1),
        limits: req.limits,
        sub_projects: req.sub_projects,
    };
    let name = req.name;
    let key = hub
        .create_project(name.clone(), settings)
        .await
        .map_err(refused)?;
    tracing::info!(project = %name, "project created (its key was shown once)");
    Ok(with_key(StatusCode::CREATED, &name, &key))
}

/// Changes a project's settings, live.
#[utoipa::path(patch, path = "/admin/projects/{name}", tag = "admin", request_body = ProjectChange,
    params(("name" = String, Path, description = "The project")),
    responses((status = 200, body = AnyObject), AdminErrors), security(("admin_token" = [])))]
pub async fn update(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    let patch: ProjectPatch = parse(&body)?;
    hub.update_project(name.clone(), patch)
        .await
        .map_err(refused)?;
    tracing::info!(project = %name, "project settings changed");
    let view = hub.projects_view().into_iter().find(|p| p.name == name);
    Ok(Json(json!({ "project": view })).into_response())
}

/// A new key for a project; the old one stops at once.
#[utoipa::path(post, path = "/admin/projects/{name}/rotate", tag = "admin",
    params(("name" = String, Path, description = "The project")),
    responses((status = 200, body = ProjectKey), AdminErrors), security(("admin_token" = [])))]
pub async fn rotate(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    let key = hub.rotate_project(name.clone()).await.map_err(refused)?;
    tracing::info!(project = %name, "project key rotated (the old key stopped working)");
    Ok(with_key(StatusCode::OK, &name, &key))
}

/// Removes a project; its key stops at once.
#[utoipa::path(delete, path = "/admin/projects/{name}", tag = "admin",
    params(("name" = String, Path, description = "The project")),
    responses((status = 200, body = ProjectRemoved), AdminErrors), security(("admin_token" = [])))]
pub async fn remove(
    State(hub): State<Hub>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    hub.remove_project(name.clone()).await.map_err(refused)?;
    tracing::info!(project = %name, "project removed (its key stopped working)");
    Ok(Json(json!({ "name": name, "removed": true })).into_response())
}
