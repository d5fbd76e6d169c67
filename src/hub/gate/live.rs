//! An embedding role's live spaces: the **current** one, which unpinned requests are served
//! in, and around a migration the **next** one an operator is rebuilding the index into and
//! the **previous** one, kept for pinned queries until the operator closes it.
//!
//! A role's current space changes only when an operator says so. Its first space is founded by
//! its reference (as the gate always did) and adopted; from then on, losing the reference
//! host, a push that changes the reference's model or a policy change makes no other space
//! current: providers of another model are judged against the current space like any provider,
//! and refused if they do not pass. To change the encoder, an operator opens a **migration**
//! ([`RoleSpaces::next`]) naming what founds the next space (a local model some agent serves,
//! or a cloud route the hub's agents build beside the role's own) and its policy; clients pin
//! requests to it ([`SpacePin`]) to re-embed their rows; a **cutover** makes it current in one
//! step, and the old space stays served for pinned requests as **previous** until it is
//! **closed**. An **abort** drops the next space.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Candidate;
use crate::config::push::{AllowedModel, MAX_DIMS};
use crate::protocol::Backend;
use crate::roles::{Policy, Role};

/// What founds a migration's next space: its reference, the encoder every row of that space
/// will come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "backend", rename_all = "snake_case", deny_unknown_fields)]
pub enum Founder {
    /// A local model an agent serves for the role: its model id as providers report it (a
    /// hub model id, or `sha256:…` of an unpinned folder), and its width when the operator
    /// names one.
    Local {
        model: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dims: Option<usize>,
    },
    /// A cloud route the agents holding the key build beside the role's own: the OpenRouter
    /// model, its pinned upstream provider and its width.
    Cloud {
        model: String,
        provider: String,
        dims: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quantization: Option<String>,
    },
}

impl Founder {
    /// Whether `c` is this founder (the next space's reference).
    pub fn founds(&self, c: &Candidate) -> bool {
        match self {
            Founder::Local { model, dims } => {
                c.backend == Backend::Local
                    && &c.model == model
                    && dims.is_none_or(|d| c.dims.is_none_or(|cd| cd == d))
            }
            Founder::Cloud {
                model,
                provider,
                dims,
                ..
            } => {
                c.backend == Backend::Cloud
                    && &c.model == model
                    && c.upstream.as_deref() == Some(provider.as_str())
                    && c.dims == Some(*dims)
            }
        }
    }

    /// The cloud route the agents must build for it.
    pub fn route(&self) -> Option<AllowedModel> {
        match self {
            Founder::Local { .. } => None,
            Founder::Cloud {
                model,
                provider,
                dims,
                quantization,
            } => Some(AllowedModel {
                model: model.clone(),
                provider: Some(provider.clone()),
                dims: Some(*dims),
                quantization: quantization.clone(),
                note: Some("the next space of a migration".into()),
            }),
        }
    }

    pub fn model(&self) -> &str {
        match self {
            Founder::Local { model, .. } | Founder::Cloud { model, .. } => model,
        }
    }

    pub fn dims(&self) -> Option<usize> {
        match self {
            Founder::Local { dims, .. } => *dims,
            Founder::Cloud { dims, .. } => Some(*dims),
        }
    }

    /// The next space's id, where it is known before the founder answers (a width named).
    pub fn space_id(&self, role: Role) -> Option<String> {
        self.dims().map(|d| super::space_id(role, self.model(), d))
    }

    /// Refused before anything is stored: empty names, a width no table has, a value shaped
    /// like a key (never echoed).
    fn check(&self) -> Result<(), MigrationRefused> {
        let fields: Vec<(&str, &str)> = match self {
            Founder::Local { model, .. } => vec![("model", model)],
            Founder::Cloud {
                model,
                provider,
                quantization,
                ..
            } => {
                let mut f = vec![("model", model.as_str()), ("provider", provider.as_str())];
                if let Some(q) = quantization {
                    f.push(("quantization", q));
                }
                f
            }
        };
        for (name, value) in fields {
            if crate::secret::looks_like_key(value) {
                return Err(MigrationRefused::Invalid(format!(
                    "founder.{name} looks like an API key (the value was not kept); name a model"
                )));
            }
            if value.trim().is_empty() || value.len() > 256 || value.chars().any(char::is_control) {
                return Err(MigrationRefused::Invalid(format!(
                    "founder.{name} must be 1 to 256 printable characters"
                )));
            }
        }
        if let Some(d) = self.dims()
            && !(1..=MAX_DIMS).contains(&d)
        {
            return Err(MigrationRefused::Invalid(format!(
                "founder.dims must be between 1 and {MAX_DIMS}"
            )));
        }
        Ok(())
    }
}

/// An open migration: the next space and what founds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Migration {
    pub founder: Founder,
    /// Who may serve requests pinned to the next space (the role's policy after the cutover).
    pub policy: Policy,
    pub opened_ms: u64,
    /// The next space's id, once its founder is connected (its fingerprint may still be on
    /// its way: founded when the gate stores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space: Option<String>,
}

/// The space a cutover replaced, served to pinned requests until the operator closes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Previous {
    pub space: String,
    /// The role's policy before the cutover: who may serve requests pinned to it.
    pub policy: Policy,
    /// The role's cloud route before the cutover, when its policy let the cloud serve: the
    /// agents keep building it while the space is served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<AllowedModel>,
    pub since_ms: u64,
}

/// An embedding role's live spaces (persisted with the state).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoleSpaces {
    /// The space unpinned requests are served in: changed only by a cutover.
    pub current: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<Migration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<Previous>,
}

impl RoleSpaces {
    pub fn new(current: String) -> Self {
        Self {
            current,
            next: None,
            previous: None,
        }
    }

    /// Which of these spaces `id` is.
    pub fn which(&self, id: &str) -> Option<Live> {
        if self.current == id {
            Some(Live::Current)
        } else if self.next.as_ref().and_then(|m| m.space.as_deref()) == Some(id) {
            Some(Live::Next)
        } else if self.previous.as_ref().is_some_and(|p| p.space == id) {
            Some(Live::Previous)
        } else {
            None
        }
    }

    /// The ids of the spaces served now: current, next (once named), previous.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.current.as_str())
            .chain(self.next.as_ref().and_then(|m| m.space.as_deref()))
            .chain(self.previous.as_ref().map(|p| p.space.as_str()))
    }

    /// The cloud routes these spaces need beside the role's own: the next space's founder's,
    /// the previous space's.
    pub fn routes(&self) -> Vec<AllowedModel> {
        self.next
            .as_ref()
            .and_then(|m| m.founder.route())
            .into_iter()
            .chain(self.previous.as_ref().and_then(|p| p.route.clone()))
            .collect()
    }
}

/// Which of a role's live spaces one is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Live {
    Current,
    Next,
    Previous,
}

/// What a cutover did: the caller makes the role's config follow (policy, cloud route).
#[derive(Clone, Debug)]
pub struct CutOver {
    pub from: String,
    pub to: String,
    /// The migration's policy: the role's from now on.
    pub policy: Policy,
    /// The founder's cloud route: the role's from now on (a local founder keeps the role's).
    pub route: Option<AllowedModel>,
}

/// Why a migration step was refused (each says what would let it apply).
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum MigrationRefused {
    #[error("role '{0}' is not an embedding role: only embedding roles have vector spaces")]
    NotEmbedding(Role),
    #[error(
        "role '{0}' has no vector space yet: its first one is founded by its reference; a \
         migration starts from a current space"
    )]
    NoCurrent(Role),
    #[error(
        "role '{role}' already has a migration open (to {next}): cut over to it or abort it \
         first"
    )]
    AlreadyOpen { role: Role, next: String },
    #[error(
        "role '{role}' still serves its previous space {previous} to pinned requests: close it \
         first (POST /admin/migrations/{role}/close)"
    )]
    PreviousOpen { role: Role, previous: String },
    #[error(
        "the founder would found {0}, the role's current space: nothing to migrate (to \
         fingerprint a space again, retire it: POST /admin/gate/verify {{\"retire_space\": …}})"
    )]
    SameAsCurrent(String),
    #[error("role '{0}' has no migration open (POST /admin/migrations opens one)")]
    NoneOpen(Role),
    #[error(
        "the next space of role '{role}' is not founded yet: its founder ({founder}) has not \
         answered the gate; cut over once it has and a provider passes"
    )]
    NotFounded { role: Role, founder: String },
    #[error(
        "no connected provider passes the next space {next} of role '{role}' yet: cut over \
         when one does (the verdicts are in /admin/status under gate)"
    )]
    NothingPasses { role: Role, next: String },
    #[error("role '{0}' has no previous space to close")]
    NoPrevious(Role),
    #[error("{0}")]
    Invalid(String),
}

impl MigrationRefused {
    /// A stable code for clients and events.
    pub fn code(&self) -> &'static str {
        match self {
            MigrationRefused::NotEmbedding(_) => "not_embedding",
            MigrationRefused::NoCurrent(_) => "no_current_space",
            MigrationRefused::AlreadyOpen { .. } => "migration_open",
            MigrationRefused::PreviousOpen { .. } => "previous_open",
            MigrationRefused::SameAsCurrent(_) => "same_as_current",
            MigrationRefused::NoneOpen(_) => "no_migration",
            MigrationRefused::NotFounded { .. } => "next_not_founded",
            MigrationRefused::NothingPasses { .. } => "nothing_passes",
            MigrationRefused::NoPrevious(_) => "no_previous",
            MigrationRefused::Invalid(_) => "invalid",
        }
    }
}

/// A request pinned to a space: `<id>` or `<id>@<generation>` (`X-Fantom-Space`, or the
/// `space` field of an OpenAI or Cohere body).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpacePin {
    pub id: String,
    pub generation: Option<u64>,
}

/// The longest space id a pin may name.
const MAX_PIN_LEN: usize = 512;

impl SpacePin {
    /// Reads a pin; the error never echoes what was sent.
    pub fn parse(raw: &str) -> Result<Self, &'static str> {
        let raw = raw.trim();
        if raw.is_empty() || raw.len() > MAX_PIN_LEN {
            return Err("a space pin is a space id (1 to 512 characters), optionally @generation");
        }
        if raw.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err("a space pin holds no spaces or control characters");
        }
        // `role:model:dims`, the model itself may hold `:` (`sha256:…`) but never `@`.
        let (id, generation) = match raw.rsplit_once('@') {
            Some((id, g)) => {
                let g = g
                    .parse::<u64>()
                    .ok()
                    .filter(|g| *g > 0)
                    .ok_or("a space pin's generation (after @) is a positive whole number")?;
                (id, Some(g))
            }
            None => (raw, None),
        };
        let well_formed = id
            .rsplit_once(':')
            .is_some_and(|(head, dims)| dims.parse::<usize>().is_ok() && head.contains(':'));
        if !well_formed {
            return Err("a space pin names a space id: role:model:dims (as a vector's space.id)");
        }
        Ok(Self {
            id: id.to_string(),
            generation,
        })
    }
}

/// The width a space id ends with.
pub fn id_dims(id: &str) -> Option<usize> {
    id.rsplit_once(':')?.1.parse().ok()
}

/// An operator's step of a migration.
#[derive(Clone, Debug)]
pub enum Step {
    /// Open a migration to the space `founder` founds, served under `policy`.
    Open { founder: Founder, policy: Policy },
    /// Make the next space current (the old one becomes previous).
    Cutover,
    /// Stop serving the previous space.
    Close,
    /// Drop the next space (it stays stored, unserved).
    Abort,
}

/// The role as it stands when a step applies (the hub's part of it).
#[derive(Clone, Debug)]
pub struct RoleNow {
    /// Connected providers that pass the next space.
    pub passing_next: usize,
    /// The role's policy and cloud route: the previous space keeps them after a cutover.
    pub policy: Policy,
    pub route: Option<AllowedModel>,
}

/// What a step did.
#[derive(Clone, Debug)]
pub struct Applied {
    /// For status and the console.
    pub event: String,
    /// A cutover's outcome (the caller makes the role's config follow).
    pub cut: Option<CutOver>,
}

/// Applies `step` to `role`'s live spaces in `all`; nothing changes when it is refused.
/// `founded`: whether a space's fingerprint is stored.
pub(super) fn apply(
    all: &mut BTreeMap<Role, RoleSpaces>,
    founded: &dyn Fn(&str) -> bool,
    role: Role,
    step: &Step,
    now: &RoleNow,
    now_ms: u64,
) -> Result<Applied, MigrationRefused> {
    if !role.is_embedding() {
        return Err(MigrationRefused::NotEmbedding(role));
    }
    let done = |event: String| Applied { event, cut: None };
    match step {
        Step::Open { founder, policy } => {
            let what = describe(founder);
            open(all.get_mut(&role), role, founder.clone(), *policy, now_ms)?;
            Ok(done(format!(
                "opened: the next space is founded by {what}, served under policy {policy}"
            )))
        }
        Step::Cutover => {
            let l = all.get_mut(&role).ok_or(MigrationRefused::NoneOpen(role))?;
            let m = l.next.as_ref().ok_or(MigrationRefused::NoneOpen(role))?;
            let Some(next) = m.space.clone().filter(|s| founded(s)) else {
                return Err(MigrationRefused::NotFounded {
                    role,
                    founder: describe(&m.founder),
                });
            };
            if now.passing_next == 0 {
                return Err(MigrationRefused::NothingPasses { role, next });
            }
            let m = l.next.take().ok_or(MigrationRefused::NoneOpen(role))?;
            let from = std::mem::replace(&mut l.current, next.clone());
            l.previous = Some(Previous {
                space: from.clone(),
                policy: now.policy,
                route: now.route.clone().filter(|_| now.policy != Policy::Local),
                since_ms: now_ms,
            });
            Ok(Applied {
                event: format!(
                    "cut over: {next} is current; {from} is previous (served to pinned requests until closed)"
                ),
                cut: Some(CutOver {
                    from,
                    to: next,
                    policy: m.policy,
                    route: m.founder.route(),
                }),
            })
        }
        Step::Close => {
            let p = all
                .get_mut(&role)
                .and_then(|l| l.previous.take())
                .ok_or(MigrationRefused::NoPrevious(role))?;
            Ok(done(format!("closed: {} is no longer served", p.space)))
        }
        Step::Abort => {
            let m = all
                .get_mut(&role)
                .and_then(|l| l.next.take())
                .ok_or(MigrationRefused::NoneOpen(role))?;
            Ok(done(format!(
                "aborted: the next space ({}) is no longer served",
                m.space.clone().unwrap_or_else(|| describe(&m.founder))
            )))
        }
    }
}

/// Opens a migration on `live` (checked, nothing changed when refused).
fn open(
    live: Option<&mut RoleSpaces>,
    role: Role,
    founder: Founder,
    policy: Policy,
    now_ms: u64,
) -> Result<(), MigrationRefused> {
    founder.check()?;
    let live = live.ok_or(MigrationRefused::NoCurrent(role))?;
    if let Some(m) = &live.next {
        return Err(MigrationRefused::AlreadyOpen {
            role,
            next: m.space.clone().unwrap_or_else(|| describe(&m.founder)),
        });
    }
    if let Some(p) = &live.previous {
        return Err(MigrationRefused::PreviousOpen {
            role,
            previous: p.space.clone(),
        });
    }
    let space = founder.space_id(role);
    if space.as_deref() == Some(live.current.as_str()) {
        return Err(MigrationRefused::SameAsCurrent(live.current.clone()));
    }
    live.next = Some(Migration {
        founder,
        policy,
        opened_ms: now_ms,
        space,
    });
    Ok(())
}

/// What a founder is, for messages (never a key: checked when opened).
pub fn describe(f: &Founder) -> String {
    match f {
        Founder::Local { model, dims } => match dims {
            Some(d) => format!("local {model} at {d} dims"),
            None => format!("local {model}"),
        },
        Founder::Cloud {
            model,
            provider,
            dims,
            ..
        } => format!("cloud {model} via {provider} at {dims} dims"),
    }
}

impl super::Gate {
    /// Each embedding role's live spaces (persisted with the state).
    pub fn live(&self) -> &BTreeMap<Role, RoleSpaces> {
        &self.live
    }

    /// Restores the live spaces a store loaded.
    pub fn restore_live(&mut self, live: BTreeMap<Role, RoleSpaces>) {
        self.live = live;
    }

    /// Which of `role`'s live spaces `space` is.
    pub fn which(&self, role: Role, space: &str) -> Option<Live> {
        self.live.get(&role)?.which(space)
    }

    /// Who may serve requests bound to `space`: a migration's policy for its next space, the
    /// old policy for the previous one; `None` for the current space (the role's policy).
    pub fn space_policy(&self, role: Role, space: &str) -> Option<Policy> {
        let l = self.live.get(&role)?;
        match l.which(space)? {
            Live::Current => None,
            Live::Next => l.next.as_ref().map(|m| m.policy),
            Live::Previous => l.previous.as_ref().map(|p| p.policy),
        }
    }

    /// What `step` would make of the live spaces (checked; nothing changes here): the hub
    /// persists the result, then applies the same step with [`Gate::migrated`].
    pub fn migrate(
        &self,
        role: Role,
        step: &Step,
        now: &RoleNow,
    ) -> Result<(BTreeMap<Role, RoleSpaces>, Applied), MigrationRefused> {
        let mut live = self.live.clone();
        let founded = |id: &str| self.spaces.contains_key(id);
        let applied = apply(&mut live, &founded, role, step, now, crate::hub::now_ms())?;
        Ok((live, applied))
    }

    /// Applies `step` (persisted already) to the live spaces, with its event.
    pub fn migrated(
        &mut self,
        role: Role,
        step: &Step,
        now: &RoleNow,
    ) -> Result<Applied, MigrationRefused> {
        let spaces = &self.spaces;
        let founded = |id: &str| spaces.contains_key(id);
        let applied = apply(
            &mut self.live,
            &founded,
            role,
            step,
            now,
            crate::hub::now_ms(),
        )?;
        tracing::info!(role = %role, event = %applied.event, "migration");
        self.events.push(
            crate::hub::events::EventKind::Migration,
            role.to_string(),
            applied.event.clone(),
        );
        Ok(applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_is_an_id_and_maybe_a_generation_and_nothing_else() {
        let p = SpacePin::parse("embedding:sha256:0123:384@1700000000000").unwrap();
        assert_eq!(p.id, "embedding:sha256:0123:384");
        assert_eq!(p.generation, Some(1_700_000_000_000));
        let p = SpacePin::parse(" embedding:qwen/qwen3-embedding-4b:2560 ").unwrap();
        assert_eq!(p.generation, None);
        for bad in [
            "",
            "embedding",
            "embedding:m",
            "embedding:m:wide",
            "embedding:m:3@",
            "embedding:m:3@0",
            "embedding:m:3@-1",
            "embedding:m:3@x",
            "embedding:m 1:3",
            "embedding:m\u{7}:3",
        ] {
            assert!(SpacePin::parse(bad).is_err(), "{bad:?}");
        }
        assert!(SpacePin::parse(&format!("embedding:{}:3", "m".repeat(600))).is_err());
        let why = SpacePin::parse("sk-or-v1-abcdef@x").unwrap_err();
        assert!(!why.contains("sk-or"), "never echoed: {why}");
    }

    fn step_tests_now() -> RoleNow {
        RoleNow {
            passing_next: 0,
            policy: Policy::Local,
            route: None,
        }
    }

    #[test]
    fn a_founder_is_checked_before_anything_is_stored() {
        let cloud = |model: &str, provider: &str, dims| Founder::Cloud {
            model: model.into(),
            provider: provider.into(),
            dims,
            quantization: None,
        };
        assert!(
            cloud("qwen/qwen3-embedding-8b", "nebius", 4096)
                .check()
                .is_ok()
        );
        assert!(cloud("", "nebius", 4096).check().is_err());
        assert!(cloud("m", "nebius", 0).check().is_err());
        assert!(cloud("m", "nebius", MAX_DIMS + 1).check().is_err());
        let key = cloud("sk-or-v1-0123456789abcdef0123456789abcdef", "x", 8)
            .check()
            .unwrap_err()
            .to_string();
        assert!(!key.contains("0123456789abcdef"), "{key}");
        let mut live = RoleSpaces::new("embedding:m:3".into());
        let same = Founder::Local {
            model: "m".into(),
            dims: Some(3),
        };
        assert_eq!(
            open(Some(&mut live), Role::Embedding, same, Policy::Local, 1),
            Err(MigrationRefused::SameAsCurrent("embedding:m:3".into()))
        );
        assert!(live.next.is_none(), "nothing changed");
        assert_eq!(
            open(None, Role::Embedding, cloud("m", "p", 3), Policy::Cloud, 1),
            Err(MigrationRefused::NoCurrent(Role::Embedding))
        );
        let mut all = BTreeMap::from([(Role::Reranker, live.clone())]);
        let step = Step::Open {
            founder: cloud("m", "p", 3),
            policy: Policy::Cloud,
        };
        assert!(matches!(
            apply(
                &mut all,
                &|_| true,
                Role::Reranker,
                &step,
                &step_tests_now(),
                1
            ),
            Err(MigrationRefused::NotEmbedding(Role::Reranker))
        ));
    }
}

#[cfg(test)]
mod step_tests {
    use super::*;

    fn all() -> BTreeMap<Role, RoleSpaces> {
        BTreeMap::from([(Role::Embedding, RoleSpaces::new("embedding:m:3".into()))])
    }

    fn next() -> Step {
        Step::Open {
            founder: Founder::Cloud {
                model: "n".into(),
                provider: "p".into(),
                dims: 4,
                quantization: None,
            },
            policy: Policy::Cloud,
        }
    }

    fn passing(passing_next: usize) -> RoleNow {
        RoleNow {
            passing_next,
            policy: Policy::Local,
            route: None,
        }
    }

    #[test]
    fn open_cutover_close_and_each_refused_where_it_cannot_apply() {
        let e = Role::Embedding;
        let mut live = all();
        let founded = |id: &str| id == "embedding:n:4" || id == "embedding:m:3";
        assert_eq!(
            apply(&mut live, &founded, e, &Step::Cutover, &passing(1), 1).unwrap_err(),
            MigrationRefused::NoneOpen(e)
        );
        assert_eq!(
            apply(&mut live, &founded, e, &Step::Close, &passing(0), 1).unwrap_err(),
            MigrationRefused::NoPrevious(e)
        );
        apply(&mut live, &founded, e, &next(), &passing(0), 1).unwrap();
        let l = &live[&e];
        assert_eq!(
            l.next.as_ref().unwrap().space.as_deref(),
            Some("embedding:n:4")
        );
        assert_eq!(l.routes().len(), 1, "its cloud route is built");
        assert!(matches!(
            apply(&mut live, &founded, e, &next(), &passing(0), 1),
            Err(MigrationRefused::AlreadyOpen { .. })
        ));
        assert!(matches!(
            apply(&mut live, &|_| false, e, &Step::Cutover, &passing(1), 1),
            Err(MigrationRefused::NotFounded { .. })
        ));
        assert!(matches!(
            apply(&mut live, &founded, e, &Step::Cutover, &passing(0), 1),
            Err(MigrationRefused::NothingPasses { .. })
        ));
        let before = live.clone();
        let done = apply(&mut live, &founded, e, &Step::Cutover, &passing(2), 5).unwrap();
        let cut = done.cut.unwrap();
        assert_eq!(
            (cut.from.as_str(), cut.to.as_str()),
            ("embedding:m:3", "embedding:n:4")
        );
        assert_eq!(cut.policy, Policy::Cloud);
        assert!(cut.route.is_some());
        let l = &live[&e];
        assert_eq!(l.current, "embedding:n:4");
        assert_eq!(l.which("embedding:m:3"), Some(Live::Previous));
        assert!(l.next.is_none());
        assert_ne!(before, live);
        // A new migration waits for the previous space's close.
        assert!(matches!(
            apply(&mut live, &founded, e, &next(), &passing(0), 1),
            Err(MigrationRefused::PreviousOpen { .. })
        ));
        apply(&mut live, &founded, e, &Step::Close, &passing(0), 1).unwrap();
        assert_eq!(live[&e].ids().collect::<Vec<_>>(), ["embedding:n:4"]);
        // Abort drops next and its route.
        let mut live = all();
        apply(&mut live, &founded, e, &next(), &passing(0), 1).unwrap();
        apply(&mut live, &founded, e, &Step::Abort, &passing(0), 1).unwrap();
        assert_eq!(live, all());
        assert_eq!(
            apply(&mut live, &founded, e, &Step::Abort, &passing(0), 1).unwrap_err(),
            MigrationRefused::NoneOpen(e)
        );
    }
}
