//! The config push (DESIGN §4): Fantom's `payload.openrouter` shape, and the one merge both
//! front doors (the hub's admin API, an agent's `config` frame) apply.
//!
//! Rules: a field present replaces, a field absent keeps (per role); a JSON `null` for a role
//! in `allowedModels` removes its route. A push to a holder without a key must carry one, or
//! nothing of it applies. An embedding role without an upstream pin or dims gets no cloud
//! route (fail closed). Unknown roles and modes are reported per role, never silently kept.
//!
//! No pushed value is ever echoed: a reason names the field and why, never what was typed
//! into it, and a value shaped like a key ([`looks_like_key`]) in any field but `apiKey` is
//! refused (a role name shaped like one is reported under a withheld label).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::roles::{Policy, Role};
use crate::secret::{self, Secret};

/// Widest embedding a route may declare.
pub const MAX_DIMS: usize = 16384;

/// `payload.openrouter` of a push, as it arrives (admin API body, config frame).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OpenRouterPush {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_models: Option<BTreeMap<String, Option<AllowedModel>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_by_role: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// `true`: every role with no cloud model (held or in this push) takes Fantom's default
    /// ([`seed_defaults`]). Nothing else ever maps a model nobody chose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_defaults: Option<bool>,
    /// The hub's own (never a client's push): cloud routes its embedding roles' other live
    /// spaces need (a migration's next space, the previous one), built beside the role's own
    /// whatever its policy. Only in the whole config a hub sends its agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space_routes: Option<BTreeMap<String, Vec<AllowedModel>>>,
    /// Write-only. Declared last: the frame encoder keeps it out of a frame's head.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::protocol::codec::key_on_the_wire"
    )]
    pub api_key: Option<Secret>,
}

/// One role's cloud model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllowedModel {
    /// The OpenRouter model slug.
    pub model: String,
    /// The pinned upstream provider (required for embedding roles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// The vector width (required for embedding roles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dims: Option<usize>,
    /// The pinned upstream's quantization (`bf16`, `fp8`, ...), sent as a routing filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Fantom's default cloud model per role (its catalogue): the reranker pinned to Fireworks,
/// the code assistant and the RLM sandbox. Embedding roles have none: their model founds a
/// table, which only an operator chooses. Proposed by `GET /admin/config`, in force only after
/// a push with `"useDefaults": true` (the RLM stays `local` unless a push sets its mode).
pub fn seed_defaults() -> BTreeMap<Role, AllowedModel> {
    let model = |model: &str, provider: Option<&str>| AllowedModel {
        model: model.to_string(),
        provider: provider.map(str::to_string),
        dims: None,
        quantization: None,
        note: Some("Fantom's default".to_string()),
    };
    BTreeMap::from([
        (
            Role::Reranker,
            model("qwen/qwen3-reranker-8b", Some("Fireworks")),
        ),
        (Role::CodeAssistant, model("poolside/laguna-s-2.1", None)),
        (Role::RlmSandbox, model("deepseek/deepseek-v4-flash", None)),
    ])
}

/// What a holder keeps of all pushes so far, the key aside: safe to persist and to show.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloudSettings {
    #[serde(default)]
    pub allowed_models: BTreeMap<Role, AllowedModel>,
    #[serde(default)]
    pub policies: BTreeMap<Role, Policy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Cloud routes an embedding role's other live spaces need (set by the hub's migrations,
    /// never by a push): agents build them beside the role's own route, whatever its policy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub space_routes: BTreeMap<Role, Vec<AllowedModel>>,
}

impl CloudSettings {
    /// The policy in force for `role` (its default until a push names one).
    pub fn policy(&self, role: Role) -> Policy {
        self.policies
            .get(&role)
            .copied()
            .unwrap_or_else(|| role.default_policy())
    }

    /// These settings as one whole push (what the hub sends its agents: only what a merge
    /// accepted, never a request's body), with `key` when the push that made them carried one.
    pub fn whole_push(&self, key: Option<Secret>) -> OpenRouterPush {
        OpenRouterPush {
            allowed_models: Some(
                self.allowed_models
                    .iter()
                    .map(|(role, m)| (role.to_string(), Some(m.clone())))
                    .collect(),
            ),
            mode_by_role: Some(
                self.policies
                    .iter()
                    .map(|(role, policy)| (role.to_string(), policy.to_string()))
                    .collect(),
            ),
            domain: self.domain.clone(),
            use_defaults: None,
            space_routes: (!self.space_routes.is_empty()).then(|| {
                self.space_routes
                    .iter()
                    .map(|(role, routes)| (role.to_string(), routes.clone()))
                    .collect()
            }),
            api_key: key,
        }
    }
}

/// Reads a whole config (see [`CloudSettings::whole_push`]) as the settings to hold instead
/// of the present ones; `held_key`: the key the holder keeps (never echoed if typed into a
/// field). An empty whole config is an empty set of settings.
pub fn replace_holding(
    held_key: Option<&Secret>,
    whole: &OpenRouterPush,
) -> Result<(CloudSettings, MergeReport), PushRefused> {
    let mut next = CloudSettings::default();
    // The hub's routes for its other live spaces: kept for embedding roles this build knows.
    let space_routes: BTreeMap<Role, Vec<AllowedModel>> = whole
        .space_routes
        .iter()
        .flatten()
        .filter_map(|(name, routes)| {
            let role = name.parse::<Role>().ok().filter(|r| r.is_embedding())?;
            Some((role, routes.clone()))
        })
        .collect();
    let empty = whole.api_key.is_none()
        && whole.allowed_models.as_ref().is_none_or(BTreeMap::is_empty)
        && whole.mode_by_role.as_ref().is_none_or(BTreeMap::is_empty)
        && whole.domain.is_none();
    if empty {
        next.space_routes = space_routes;
        let report = MergeReport {
            roles: BTreeMap::new(),
            key_included: false,
        };
        return Ok((next, report));
    }
    let report = merge_holding(&mut next, true, held_key, whole)?;
    next.space_routes = space_routes;
    Ok((next, report))
}

/// What became of one part of a push for one role.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    Applied,
    Removed,
    /// Not applied; the role keeps no cloud route for this part.
    Refused {
        reason: String,
    },
    /// Not a role here (e.g. Fantom's `rlm`, which `rlm-sandbox` carries).
    Ignored {
        reason: String,
    },
}

/// The outcomes of one push for one role name.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoleOutcome {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Outcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Outcome>,
}

/// A push that applied (maybe with per-role refusals).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MergeReport {
    pub roles: BTreeMap<String, RoleOutcome>,
    /// Whether this push carried a key.
    pub key_included: bool,
}

/// A push refused whole: nothing of it applied.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PushRefused {
    #[error(
        "pushed with no apiKey and none held: the first push must carry one; nothing was applied"
    )]
    FirstPushWithoutKey,
    #[error("apiKey is empty; nothing was applied")]
    EmptyKey,
    #[error(
        "the push changes nothing: send at least one of apiKey, allowedModels, modeByRole, domain, useDefaults"
    )]
    Empty,
    /// A key-shaped value in a field that is kept and shown; the value is not repeated.
    #[error(
        "{0} looks like an API key: keys go in apiKey only (the value is neither kept nor shown); nothing was applied"
    )]
    KeyInField(&'static str),
    #[error(
        "spaceRoutes is the hub's own (the cloud routes of its migrations): a push cannot set it; open a migration with POST /admin/migrations; nothing was applied"
    )]
    SpaceRoutes,
}

/// Merges `push` onto `held`. `holds_key`: whether the holder already has a key (the hub: a
/// key was pushed before; an agent: one is in memory).
pub fn merge(
    held: &mut CloudSettings,
    holds_key: bool,
    push: &OpenRouterPush,
) -> Result<MergeReport, PushRefused> {
    if push.space_routes.is_some() {
        return Err(PushRefused::SpaceRoutes);
    }
    merge_holding(held, holds_key, None, push)
}

/// [`merge`] for a holder of the key itself (an agent, a relay slot): the held key typed into
/// a field is refused too, whatever its shape.
pub fn merge_holding(
    held: &mut CloudSettings,
    holds_key: bool,
    held_key: Option<&Secret>,
    push: &OpenRouterPush,
) -> Result<MergeReport, PushRefused> {
    if push.api_key.is_none()
        && push.allowed_models.is_none()
        && push.mode_by_role.is_none()
        && push.domain.is_none()
        && push.use_defaults.is_none()
    {
        return Err(PushRefused::Empty);
    }
    match &push.api_key {
        Some(key) if key.is_empty() => return Err(PushRefused::EmptyKey),
        None if !holds_key => return Err(PushRefused::FirstPushWithoutKey),
        _ => {}
    }
    let known: Vec<&Secret> = push.api_key.iter().chain(held_key).collect();
    let secret = |v: &str| secret::holds_key(v, &known);
    if push.domain.as_deref().is_some_and(secret) {
        return Err(PushRefused::KeyInField("domain"));
    }
    let mut next = held.clone();
    let mut roles: BTreeMap<String, RoleOutcome> = BTreeMap::new();
    let mut labels = RoleLabels::default();
    for (name, entry) in push.allowed_models.iter().flatten() {
        let outcome = match parse_role(name) {
            Err(ignored) => ignored,
            Ok(role) => match entry.as_ref().and_then(|m| key_shaped_field(m, &secret)) {
                Some(field) => {
                    // Fail closed, as for any refused route.
                    next.allowed_models.remove(&role);
                    Outcome::Refused {
                        reason: key_in(field),
                    }
                }
                None => merge_model(&mut next, role, entry.as_ref()),
            },
        };
        roles.entry(labels.of(name, &secret)).or_default().model = Some(outcome);
    }
    for (name, mode) in push.mode_by_role.iter().flatten() {
        let outcome = match parse_role(name) {
            Err(ignored) => ignored,
            Ok(_) if secret(mode) => Outcome::Refused {
                reason: key_in("the mode"),
            },
            Ok(role) => match Policy::parse_mode(mode) {
                Ok(Some(policy)) => {
                    next.policies.insert(role, policy);
                    Outcome::Applied
                }
                Ok(None) => {
                    next.policies.remove(&role);
                    Outcome::Applied
                }
                Err(reason) => Outcome::Refused { reason },
            },
        };
        roles.entry(labels.of(name, &secret)).or_default().mode = Some(outcome);
    }
    if let Some(domain) = &push.domain {
        next.domain = Some(domain.clone());
    }
    if push.use_defaults == Some(true) {
        for (role, model) in seed_defaults() {
            let named = push
                .allowed_models
                .as_ref()
                .is_some_and(|m| m.contains_key(role.as_str()));
            if !named && !next.allowed_models.contains_key(&role) {
                next.allowed_models.insert(role, model);
                roles.entry(role.to_string()).or_default().model = Some(Outcome::Applied);
            }
        }
    }
    *held = next;
    Ok(MergeReport {
        roles,
        key_included: push.api_key.is_some(),
    })
}

fn parse_role(name: &str) -> Result<Role, Outcome> {
    if name == "rlm" {
        return Err(Outcome::Ignored {
            reason: "Fantom's rlm policy role; rlm-sandbox carries it here".into(),
        });
    }
    name.parse::<Role>().map_err(|_| Outcome::Ignored {
        reason: format!(
            "not a role this agent serves; the roles are: {}",
            Role::names()
        ),
    })
}

/// The first field of a route that holds a key-shaped value.
fn key_shaped_field(m: &AllowedModel, secret: &impl Fn(&str) -> bool) -> Option<&'static str> {
    [
        ("model", Some(m.model.as_str())),
        ("provider", m.provider.as_deref()),
        ("quantization", m.quantization.as_deref()),
        ("note", m.note.as_deref()),
    ]
    .into_iter()
    .find_map(|(field, v)| v.is_some_and(secret).then_some(field))
}

/// The reason of a refused key-shaped value.
fn key_in(field: &str) -> String {
    format!(
        "{field} looks like an API key: keys go in apiKey only (the value is neither kept nor shown)"
    )
}

/// How a pushed role name is named in a report: as itself when it reads as a role name, else
/// under a withheld label (a key pasted as a role name is never echoed).
#[derive(Default)]
struct RoleLabels {
    withheld: BTreeMap<String, String>,
}

impl RoleLabels {
    fn of(&mut self, name: &str, secret: &impl Fn(&str) -> bool) -> String {
        let plain = !secret(name)
            && (1..=40).contains(&name.len())
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if plain {
            return name.to_string();
        }
        let n = self.withheld.len() + 1;
        self.withheld
            .entry(name.to_string())
            .or_insert_with(|| format!("(withheld role name {n})"))
            .clone()
    }
}

/// Whether a pushed role name and its mode may be kept as they were typed (Fantom's own modes,
/// held by a relay slot): the name reads as a role name and the mode is one this agent knows.
pub fn keepable_mode(name: &str, mode: &str, key: Option<&Secret>) -> bool {
    let known: Vec<&Secret> = key.into_iter().collect();
    let secret = |v: &str| secret::holds_key(v, &known);
    let mut labels = RoleLabels::default();
    labels.of(name, &secret) == name && !secret(mode) && Policy::parse_mode(mode).is_ok()
}

fn merge_model(next: &mut CloudSettings, role: Role, entry: Option<&AllowedModel>) -> Outcome {
    let Some(model) = entry else {
        next.allowed_models.remove(&role);
        return Outcome::Removed;
    };
    match validate_model(role, model) {
        Ok(()) => {
            next.allowed_models.insert(role, model.clone());
            Outcome::Applied
        }
        Err(reason) => {
            // Fail closed: a route the operator meant to change is not kept as it was.
            next.allowed_models.remove(&role);
            Outcome::Refused { reason }
        }
    }
}

fn validate_model(role: Role, m: &AllowedModel) -> Result<(), String> {
    if m.model.trim().is_empty() {
        return Err("model is empty".into());
    }
    if !role.is_embedding() {
        return Ok(());
    }
    if m.provider.as_deref().is_none_or(|p| p.trim().is_empty()) {
        return Err(format!(
            "{role} needs an upstream provider pin: two upstreams of one model can return different vectors"
        ));
    }
    match m.dims {
        Some(d) if (1..=MAX_DIMS).contains(&d) => Ok(()),
        Some(_) => Err(format!("dims is outside 1..={MAX_DIMS}")),
        None => Err(format!(
            "{role} needs dims: the vector table's width is part of the route"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(json: &str) -> OpenRouterPush {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn the_first_push_needs_a_key_and_later_ones_merge() {
        let mut held = CloudSettings::default();
        let no_key = push(r#"{"modeByRole":{"reranker":"local"}}"#);
        assert_eq!(
            merge(&mut held, false, &no_key),
            Err(PushRefused::FirstPushWithoutKey)
        );
        assert_eq!(held, CloudSettings::default(), "refused whole: modes too");

        let first = push(
            r#"{"apiKey":"sk-or-1","allowedModels":{
                "code-embedding":{"model":"qwen/qwen3-embedding-4b","provider":"deepinfra/bf16","dims":2560},
                "reranker":{"model":"qwen/qwen3-reranker-8b"}},
              "modeByRole":{"code-embedding":"aggregate","reranker":"backup"}}"#,
        );
        let report = merge(&mut held, false, &first).unwrap();
        assert!(report.key_included);
        assert_eq!(held.allowed_models.len(), 2);
        assert_eq!(held.policy(Role::Reranker), Policy::Backup);

        // No key, one mode: everything else is kept.
        let second = push(r#"{"modeByRole":{"reranker":"local-only"}}"#);
        let report = merge(&mut held, true, &second).unwrap();
        assert!(!report.key_included);
        assert_eq!(held.policy(Role::Reranker), Policy::Local);
        assert_eq!(held.policy(Role::CodeEmbedding), Policy::Aggregate);
        assert_eq!(held.allowed_models.len(), 2);
        assert_eq!(held.policy(Role::RlmSandbox), Policy::Local, "default");
    }

    #[test]
    fn embedding_roles_without_pin_or_dims_fail_closed() {
        let mut held = CloudSettings::default();
        let good = push(
            r#"{"apiKey":"k","allowedModels":{"embedding":{"model":"m","provider":"Nebius","dims":4096}}}"#,
        );
        merge(&mut held, false, &good).unwrap();
        let unpinned = push(
            r#"{"allowedModels":{"embedding":{"model":"m2","dims":4096},
            "code-embedding":{"model":"m","provider":"Nebius"},
            "code-assistant":{"model":"poolside/laguna-s-2.1"},
            "embeddings":{"model":"x"}},"modeByRole":{"rlm":"local-only","reranker":"sometimes"}}"#,
        );
        let report = merge(&mut held, true, &unpinned).unwrap();
        let outcome = |role: &str| report.roles[role].model.clone().unwrap();
        assert!(
            matches!(outcome("embedding"), Outcome::Refused { reason } if reason.contains("pin"))
        );
        assert!(
            matches!(outcome("code-embedding"), Outcome::Refused { reason } if reason.contains("dims"))
        );
        assert_eq!(outcome("code-assistant"), Outcome::Applied);
        assert!(
            matches!(outcome("embeddings"), Outcome::Ignored { reason } if reason.contains("not a role"))
        );
        assert!(matches!(
            report.roles["rlm"].mode,
            Some(Outcome::Ignored { .. })
        ));
        assert!(matches!(
            report.roles["reranker"].mode,
            Some(Outcome::Refused { .. })
        ));
        assert!(
            !held.allowed_models.contains_key(&Role::Embedding),
            "fail closed"
        );
        assert!(held.allowed_models.contains_key(&Role::CodeAssistant));

        let remove = push(r#"{"allowedModels":{"code-assistant":null}}"#);
        let report = merge(&mut held, true, &remove).unwrap();
        assert_eq!(report.roles["code-assistant"].model, Some(Outcome::Removed));
        assert!(held.allowed_models.is_empty());
    }

    #[test]
    fn a_key_in_any_field_is_refused_and_never_echoed() {
        const KEY: &str = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789ab";
        let mut held = CloudSettings::default();
        let fields = [
            format!(r#"{{"apiKey":"k","allowedModels":{{"reranker":{{"model":"{KEY}"}}}}}}"#),
            format!(
                r#"{{"apiKey":"k","allowedModels":{{"embedding":{{"model":"m","provider":"{KEY}","dims":8}}}}}}"#
            ),
            format!(
                r#"{{"apiKey":"k","allowedModels":{{"embedding":{{"model":"m","provider":"p","quantization":"{KEY}","dims":8}}}}}}"#
            ),
            format!(
                r#"{{"apiKey":"k","allowedModels":{{"reranker":{{"model":"m","note":"{KEY}"}}}}}}"#
            ),
            format!(r#"{{"apiKey":"k","modeByRole":{{"reranker":"{KEY}"}}}}"#),
            format!(r#"{{"apiKey":"k","modeByRole":{{"{KEY}":"local"}}}}"#),
            format!(r#"{{"apiKey":"k","allowedModels":{{"{KEY}":{{"model":"m"}}}}}}"#),
            format!(r#"{{"apiKey":"k","domain":"{KEY}"}}"#),
            // The push's own key, typed into a field too; a key inside another value.
            r#"{"apiKey":"my-own-short-key","modeByRole":{"reranker":"my-own-short-key"}}"#
                .to_string(),
            format!(
                r#"{{"apiKey":"k","allowedModels":{{"reranker":{{"model":"openai/{KEY}"}}}}}}"#
            ),
            format!(r#"{{"apiKey":"k","domain":"OPENROUTER_API_KEY={KEY}"}}"#),
        ];
        for json in &fields {
            let p = push(json);
            let shown = match merge(&mut held, false, &p) {
                Ok(report) => serde_json::to_string(&report.roles).unwrap(),
                Err(refused) => refused.to_string(),
            };
            assert!(
                !shown.contains(KEY) && !shown.contains("my-own-short-key"),
                "{shown}"
            );
            assert!(
                shown.contains("looks like an API key") || shown.contains("withheld"),
                "{shown}"
            );
            let kept = serde_json::to_string(&held).unwrap();
            assert!(
                !kept.contains(KEY) && !kept.contains("my-own-short-key"),
                "{kept}"
            );
        }
        let unknown = merge(
            &mut held,
            false,
            &push(r#"{"apiKey":"k","modeByRole":{"reranker":"sometimes"}}"#),
        )
        .unwrap();
        let shown = serde_json::to_string(&unknown.roles).unwrap();
        assert!(
            !shown.contains("sometimes"),
            "an unknown mode is not echoed either: {shown}"
        );
        assert!(keepable_mode("rlm", "local-only", None));
        assert!(!keepable_mode("rlm", KEY, None) && !keepable_mode(KEY, "local-only", None));
    }

    #[test]
    fn the_whole_config_is_what_the_merge_kept_and_replaces_what_was_held() {
        const KEY: &str = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789ab";
        let mut held = CloudSettings::default();
        let first = push(
            r#"{"apiKey":"k","allowedModels":{
                "embedding":{"model":"m","provider":"p","dims":8},
                "reranker":{"model":"r"}},
              "modeByRole":{"embedding":"cloud","reranker":"local-only"},"domain":"code"}"#,
        );
        merge(&mut held, false, &first).unwrap();
        // A key typed into a note is refused; what leaves is only what was kept.
        let bad = push(&format!(
            r#"{{"allowedModels":{{"reranker":{{"model":"r2","note":"{KEY}"}}}},"modeByRole":{{"code-assistant":"{KEY}"}}}}"#
        ));
        merge(&mut held, true, &bad).unwrap();
        let whole = held.whole_push(None);
        let text = serde_json::to_string(&whole).unwrap();
        assert!(!text.contains(KEY), "{text}");
        assert!(
            !text.contains("r2"),
            "the refused route is not sent: {text}"
        );
        // An agent that held other routes holds exactly these afterwards.
        let (replaced, report) = replace_holding(None, &whole).unwrap();
        assert_eq!(replaced, held);
        assert!(!report.key_included);
        let (nothing, _) =
            replace_holding(None, &CloudSettings::default().whole_push(None)).unwrap();
        assert_eq!(nothing, CloudSettings::default());
    }

    #[test]
    fn defaults_apply_only_when_asked_and_never_over_a_choice() {
        let mut held = CloudSettings::default();
        merge(&mut held, false, &push(r#"{"apiKey":"k"}"#)).unwrap();
        assert!(
            held.allowed_models.is_empty(),
            "nothing bills a model nobody chose"
        );
        let report = merge(
            &mut held,
            true,
            &push(r#"{"useDefaults":true,"allowedModels":{"code-assistant":{"model":"mine"}}}"#),
        )
        .unwrap();
        assert_eq!(held.allowed_models[&Role::CodeAssistant].model, "mine");
        assert_eq!(
            held.allowed_models[&Role::Reranker].provider.as_deref(),
            Some("Fireworks")
        );
        assert_eq!(
            held.allowed_models[&Role::RlmSandbox].model,
            "deepseek/deepseek-v4-flash"
        );
        assert_eq!(
            held.policy(Role::RlmSandbox),
            Policy::Local,
            "the RLM stays local"
        );
        assert!(!held.allowed_models.contains_key(&Role::Embedding));
        assert_eq!(report.roles["reranker"].model, Some(Outcome::Applied));
    }

    #[test]
    fn the_push_type_never_prints_its_key() {
        let p = push(r#"{"apiKey":"sk-or-v1-secret-value","domain":"code"}"#);
        assert!(!format!("{p:?}").contains("secret-value"));
    }
}
