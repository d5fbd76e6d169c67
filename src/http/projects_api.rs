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
use crate::hub::Hub;
use crate::hub::project_admin::ProjectPatch;
use crate::hub::projects::{ProjectError, ProjectLimits, ProjectSettings};
use crate::secret::{Secret, redact};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewProject {
    name: String,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    limits: ProjectLimits,
    #[serde(default)]
    sub_projects: bool,
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
        ProjectError::State(_) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "state_write", message)
        }
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

pub async fn list(State(hub): State<Hub>, headers: HeaderMap) -> Result<Response, ApiError> {
    admin(&hub, &headers)?;
    Ok(Json(json!({ "projects": hub.projects_view() })).into_response())
}

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
