//! The relay's commands (§2.2), answered for the slot whose socket carried them: the virtual
//! commands on that master's OpenRouter key and pinned models, the container actions on the
//! local roles, and `Unknown action: <name>` for the rest. Every answer is a `result` echoing
//! the command's `id`.
//!
//! A virtual command never substitutes a model: a `model` that differs from the slot's mapping
//! is refused, and the call is pinned to the slot's provider with no fallbacks. Error texts
//! keep OpenRouter's status first (`429 …`, `402 …`): the master's budget and scheduler match
//! on `429` and `rate limit`.

use std::sync::Arc;
use std::time::Instant;

use super::frames::{
    Action, Command, CommandResult, EmbedResult, Interval, KeyInfo, RateLimit, RerankHit,
    RerankResult, Source, VirtualEmbed, VirtualRerank,
};
use super::sidecar::Sidecar;
use super::slots::Slots;
use super::status::WireMode;
use crate::cloud::error::CloudError;
use crate::cloud::openrouter::OpenRouterClient;
use crate::cloud::route::CloudRoute;
use crate::roles::Role;

/// Answers one command from the master `master`.
pub async fn answer(sidecar: &Sidecar, master: &str, cmd: &Command) -> CommandResult {
    let id = cmd.id.clone();
    let action = match cmd.parse() {
        Ok(action) => action,
        Err(e) => {
            let shown = crate::secret::redact(&e.to_string());
            return CommandResult::err(id, format!("invalid {} payload: {shown}", cmd.action));
        }
    };
    let slots = &sidecar.slots;
    match action {
        Action::VirtualEmbed(args) => reply(id, virtual_embed(slots, master, args).await),
        Action::VirtualRerank(args) => reply(id, virtual_rerank(slots, master, args).await),
        Action::VirtualKeyInfo => reply(id, key_info(slots, master).await),
        Action::Container(verb, a) => {
            let done = sidecar
                .containers
                .act(verb, &a.role, a.model.as_deref())
                .await;
            reply(id, done.map_err(|e| e.to_string()))
        }
        Action::Unknown(name) => CommandResult::unknown_action(id, &name),
    }
}

/// A `result` frame: the body, or the error's text.
fn reply<T: serde::Serialize>(id: String, done: Result<T, String>) -> CommandResult {
    match done {
        Ok(body) => CommandResult::ok(id, &body),
        Err(message) => CommandResult::err(id, message),
    }
}

/// A slot's cloud route for one role, ready to call.
pub struct SlotRoute {
    pub client: Arc<OpenRouterClient>,
    pub route: CloudRoute,
}

/// Why a slot cannot serve a role from the cloud.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SlotRouteError {
    #[error("no slot for master {0}")]
    NoSlot(String),
    #[error("no OpenRouter key pushed by this master")]
    NoKey,
    #[error("role {0} is local-only on this master (modeByRole)")]
    LocalOnly(String),
    #[error("no cloud model for role {0} on this master (allowedModels)")]
    NoModel(Role),
    #[error("model mismatch: requested {requested}, this master's slot serves {serves}")]
    ModelMismatch { requested: String, serves: String },
    #[error("the {role} route cannot be built: {message}")]
    BadRoute { role: Role, message: String },
}

/// The route `master`'s slot serves `role` on. `mode_key` is the role key whose mode decides
/// (`None`: the mode is not checked, as for the chat proxy); a `requested` model must be the
/// slot's.
pub fn slot_route(
    slots: &Slots,
    master: &str,
    role: Role,
    mode_key: Option<&str>,
    requested: Option<&str>,
) -> Result<SlotRoute, SlotRouteError> {
    slots
        .with_slot(master, |slot| {
            let client = slot.client.clone().ok_or(SlotRouteError::NoKey)?;
            if let Some(key) = mode_key
                && slot.mode(key) == WireMode::LocalOnly
            {
                return Err(SlotRouteError::LocalOnly(key.to_string()));
            }
            let allowed = slot.allowed(role).ok_or(SlotRouteError::NoModel(role))?;
            if let Some(requested) = requested.map(str::trim).filter(|m| !m.is_empty())
                && requested != allowed.model
            {
                return Err(SlotRouteError::ModelMismatch {
                    requested: requested.to_string(),
                    serves: allowed.model.clone(),
                });
            }
            let route =
                CloudRoute::from_allowed(role, allowed).map_err(|e| SlotRouteError::BadRoute {
                    role,
                    message: e.to_string(),
                })?;
            Ok(SlotRoute { client, route })
        })
        .unwrap_or_else(|| Err(SlotRouteError::NoSlot(master.to_string())))
}

/// `429 upstream rate limit (…): …`: the status first, then our words.
pub fn relay_error(e: &CloudError) -> String {
    format!("{} {e}", e.http_status())
}

/// Runs one metered cloud call of `master`'s `role_key`. Dropped before it ends (its caller
/// went away), the call is still counted as ended.
pub async fn metered<T>(
    slots: &Slots,
    master: &str,
    role_key: &str,
    call: impl Future<Output = Result<T, CloudError>>,
) -> Result<T, CloudError> {
    let mut meter = Meter {
        slots,
        master,
        role_key,
        started: Instant::now(),
        ended: false,
    };
    slots.begin_call(master, role_key);
    let result = call.await;
    meter.end(result.as_ref().err().map(relay_error));
    result
}

/// One call's place in its slot's usage, ended exactly once.
struct Meter<'a> {
    slots: &'a Slots,
    master: &'a str,
    role_key: &'a str,
    started: Instant,
    ended: bool,
}

impl Meter<'_> {
    fn end(&mut self, error: Option<String>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.slots.end_call(self.master, self.role_key, ms, error);
    }
}

impl Drop for Meter<'_> {
    fn drop(&mut self) {
        self.end(Some("499 the caller went away".into()));
    }
}

async fn virtual_embed(
    slots: &Slots,
    master: &str,
    args: VirtualEmbed,
) -> Result<EmbedResult, String> {
    if !args.role.is_embedding() {
        return Err(format!(
            "virtual-embed serves embedding roles, not {}",
            args.role
        ));
    }
    let key = args.role.as_str();
    let SlotRoute { client, route } = slot_route(
        slots,
        master,
        args.role,
        Some(key),
        args.common.model.as_deref(),
    )
    .map_err(|e| e.to_string())?;
    let dims = route.dims().unwrap_or_default();
    let call = client.embed(&route, &args.texts, None, None);
    let embedded = metered(slots, master, key, call)
        .await
        .map_err(|e| relay_error(&e))?;
    Ok(EmbedResult {
        source: Source::Openrouter,
        embeddings: embedded.vectors,
        model: route.model().to_string(),
        dims,
        total_tokens: Some(embedded.tokens),
    })
}

async fn virtual_rerank(
    slots: &Slots,
    master: &str,
    args: VirtualRerank,
) -> Result<RerankResult, String> {
    let role = args.role.unwrap_or(Role::Reranker);
    if role != Role::Reranker {
        return Err(format!(
            "virtual-rerank serves the reranker role, not {role}"
        ));
    }
    let key = role.as_str();
    let SlotRoute { client, route } =
        slot_route(slots, master, role, Some(key), args.common.model.as_deref())
            .map_err(|e| e.to_string())?;
    let call = client.rerank(&route, &args.query, &args.documents);
    let reranked = metered(slots, master, key, call)
        .await
        .map_err(|e| relay_error(&e))?;
    Ok(RerankResult {
        source: Source::Openrouter,
        results: ranked(&reranked.scores, args.top_n),
        model: route.model().to_string(),
        total_tokens: Some(reranked.tokens),
    })
}

/// Scores in document order → hits by score, highest first, `top_n` of them.
pub fn ranked(scores: &[f32], top_n: Option<usize>) -> Vec<RerankHit> {
    let mut hits: Vec<RerankHit> = scores
        .iter()
        .enumerate()
        .map(|(index, &relevance_score)| RerankHit {
            index,
            relevance_score,
        })
        .collect();
    hits.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    hits.truncate(top_n.unwrap_or(hits.len()));
    hits
}

/// `virtual-key-info`: the numbers of this master's key, never the key nor its label.
async fn key_info(slots: &Slots, master: &str) -> Result<KeyInfo, String> {
    let client = slots
        .with_slot(master, |s| s.client.clone())
        .flatten()
        .ok_or_else(|| SlotRouteError::NoKey.to_string())?;
    let info = client.key_info().await.map_err(|e| relay_error(&e))?;
    Ok(KeyInfo {
        rate_limit: info.rate_limit_requests.map(|requests| RateLimit {
            requests,
            interval: info
                .rate_limit_interval
                .clone()
                .map_or(Interval::Seconds(60.0), Interval::Text),
        }),
        total_credits: info.total_credits_usd,
        total_usage: info.total_usage_usd,
        limit: info.limit_usd,
        usage: info.usage_usd,
        limit_remaining: info.limit_remaining_usd,
        is_free_tier: info.is_free_tier,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_ranked_and_cut_to_top_n() {
        let hits = ranked(&[0.1, 0.9, 0.5], Some(2));
        let order: Vec<usize> = hits.iter().map(|h| h.index).collect();
        assert_eq!(order, vec![1, 2]);
        assert_eq!(ranked(&[0.1, 0.9], None).len(), 2);
    }

    #[test]
    fn errors_lead_with_the_status_the_master_matches_on() {
        let e = CloudError::UpstreamRateLimited {
            provider_name: Some("Nebius".into()),
            capacity_exhausted: false,
            retry_after_ms: None,
            message: "busy".into(),
        };
        let text = relay_error(&e);
        assert!(text.starts_with("429 "), "{text}");
        assert!(text.contains("rate limit"), "{text}");
    }
}
