//! The hub's series on `/metrics`: read from the core, the budget, the gate and the projects at
//! scrape time (one short hold of the core's lock) and encoded by the client library
//! ([`crate::metrics`]). Which names exist is the contract the dashboard and the alert rules in
//! `monitoring/` are checked against; `docs/operations.md` lists them.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use super::Hub;
use crate::metrics::histogram::Histogram;
use crate::metrics::{Families, Labels, label};
use crate::roles::Role;

impl Hub {
    /// Writes the hub's families (all but the HTTP routes' latencies, which the HTTP layer owns).
    pub fn encode_metrics(&self, f: &mut Families) -> fmt::Result {
        let mut core = self.core();
        let now = Instant::now();
        core.budget.tick(now);
        let budget = core.budget.view(now);
        let c = &core.counters;
        let per_role = |m: &BTreeMap<Role, u64>| -> Vec<(Labels, f64)> {
            Role::ALL
                .iter()
                .map(|r| (label("role", r), m.get(r).copied().unwrap_or(0) as f64))
                .collect()
        };
        let one = |v: f64| [(Labels::new(), v)];
        let by_key = |m: &BTreeMap<&'static str, u64>, name: &'static str| -> Vec<(Labels, f64)> {
            m.iter().map(|(k, v)| (label(name, k), *v as f64)).collect()
        };
        let per_provider = |m: &BTreeMap<String, u64>| -> Vec<(Labels, f64)> {
            m.iter()
                .map(|(p, n)| (label("provider", p), *n as f64))
                .collect()
        };

        f.counter(
            "fantom_hub_requests_total",
            "Client requests accepted.",
            per_role(&c.requests),
        )?;
        f.counter(
            "fantom_hub_items_accepted_total",
            "Items (texts, documents) accepted into a role queue.",
            per_role(&c.items_accepted),
        )?;
        f.counter(
            "fantom_hub_items_served_total",
            "Items a provider returned a result for.",
            per_role(&c.items_served),
        )?;
        f.counter(
            "fantom_hub_rejected_queue_full_total",
            "Requests answered 429 because the role queue was full.",
            per_role(&c.rejected_full),
        )?;
        f.gauge(
            "fantom_hub_queue_depth",
            "Items waiting in a role queue.",
            Role::ALL
                .iter()
                .map(|r| (label("role", r), core.queue_depth(*r) as f64)),
        )?;
        f.gauge(
            "fantom_hub_held_bytes",
            "Input bytes held by accepted requests (queued, leased or partly served).",
            one(core.held_bytes() as f64),
        )?;
        let leases = core.leases_by_role();
        f.gauge(
            "fantom_hub_leases_in_flight",
            "Leases out to providers.",
            Role::ALL.iter().map(|r| {
                let n = leases.get(r).map_or(0, |l| l.0);
                (label("role", r), n as f64)
            }),
        )?;
        f.counter(
            "fantom_hub_leases_total",
            "Leases by outcome other than done.",
            [
                ("granted", c.leases_granted),
                ("expired", c.leases_expired),
                ("lost", c.leases_lost),
                ("cancelled", c.leases_cancelled),
            ]
            .map(|(outcome, n)| (label("outcome", outcome), n as f64)),
        )?;
        f.counter(
            "fantom_hub_lease_renewals_total",
            "Leases renewed by a heartbeat (work still running on a live agent).",
            one(c.leases_renewed as f64),
        )?;
        f.counter(
            "fantom_hub_rejected_unservable_total",
            "Requests refused at admission because nothing could serve them, by reason.",
            by_key(&c.rejected_unservable, "reason"),
        )?;
        f.counter(
            "fantom_hub_requests_failed_total",
            "Accepted requests that failed (fatal input, attempts, nothing left to serve them).",
            one(c.requests_failed as f64),
        )?;
        f.counter(
            "fantom_hub_rescored_total",
            "Rerank requests scored again whole because every provider of their scorer left.",
            one(c.rescored as f64),
        )?;
        f.counter(
            "fantom_hub_failures_total",
            "Failed leases by class.",
            by_key(&c.failures, "class"),
        )?;
        f.counter(
            "fantom_hub_chat_replays_total",
            "Keyed chats answered again from the answer a request with the same Idempotency-Key got.",
            one(core.replies.replayed as f64),
        )?;
        f.counter(
            "fantom_hub_chat_answers_handed_over_total",
            "Keyed chats' answers agents handed over that this hub did not hold (their cost counted here).",
            one(core.replies.handed_over as f64),
        )?;
        f.gauge(
            "fantom_hub_chat_answers_held_bytes",
            "Bytes of memory keyed chats' answers held for retries take.",
            one(core.replies.held().1 as f64),
        )?;
        f.counter(
            "fantom_hub_late_results_total",
            "Results dropped because the item already had one or its lease was gone.",
            one(c.late_results as f64),
        )?;
        f.gauge(
            "fantom_hub_agents_connected",
            "Agents with an open session.",
            one(core.agents().len() as f64),
        )?;
        let mut latency = Vec::new();
        let mut served = Vec::new();
        for a in core.agents().values() {
            for p in a.providers.values() {
                let labels = vec![
                    ("provider", p.reference.provider.clone()),
                    ("role", p.role().to_string()),
                ];
                if let Some(ms) = p.latency_ewma_ms {
                    latency.push((labels.clone(), ms / 1000.0));
                }
                served.push((labels, p.served_items as f64));
            }
        }
        f.gauge(
            "fantom_hub_provider_latency_ewma_seconds",
            "Work-frame latency measured by the agent around the model call (EWMA).",
            latency,
        )?;
        f.gauge(
            "fantom_hub_provider_items_served",
            "Items a connected provider served in its current session.",
            served,
        )?;
        f.gauge(
            "fantom_hub_budget_ceiling",
            "Cloud budget ceiling (permits).",
            one(f64::from(budget.ceiling)),
        )?;
        f.gauge(
            "fantom_hub_budget_limit",
            "Cloud budget effective limit now (permits).",
            one(f64::from(budget.limit)),
        )?;
        f.gauge(
            "fantom_hub_budget_in_flight",
            "Cloud leases and gate probes holding a permit.",
            one(f64::from(budget.in_flight)),
        )?;
        f.counter(
            "fantom_hub_budget_granted_total",
            "Cloud permits granted.",
            one(budget.granted as f64),
        )?;
        f.counter(
            "fantom_hub_budget_throttles_total",
            "Global throttle signals (platform 429, in-flight 402).",
            one(budget.throttles as f64),
        )?;
        f.gauge(
            "fantom_hub_budget_cooldown_remaining_seconds",
            "Global cooldown left.",
            one(budget.cooldown_remaining_ms as f64 / 1000.0),
        )?;
        f.gauge(
            "fantom_hub_budget_latency_ewma_seconds",
            "Upstream latency EWMA of successful cloud calls.",
            one(budget.latency_ewma_ms / 1000.0),
        )?;
        f.gauge(
            "fantom_hub_budget_stopped",
            "1 when a hard 402 stopped cloud work.",
            one(if budget.stopped.is_some() { 1.0 } else { 0.0 }),
        )?;
        let route_rows = |value: &dyn Fn(&super::budget::RouteView) -> f64| -> Vec<(Labels, f64)> {
            budget
                .routes
                .iter()
                .map(|r| (label("route", &r.route), value(r)))
                .collect()
        };
        f.gauge(
            "fantom_hub_budget_route_limit",
            "Cloud route sub-limit (permits).",
            route_rows(&|r| f64::from(r.limit)),
        )?;
        f.gauge(
            "fantom_hub_budget_route_in_flight",
            "Cloud route leases holding a permit.",
            route_rows(&|r| f64::from(r.in_flight)),
        )?;
        f.counter(
            "fantom_hub_budget_route_throttles_total",
            "Upstream 429s per route.",
            route_rows(&|r| r.throttles as f64),
        )?;

        let gate = core.gate.view(&super::status::serving_by_role(&core));
        f.gauge(
            "fantom_hub_gate_verdict",
            "Gate verdicts by provider, space and state (1 per verdict).",
            gate.verdicts.iter().map(|v| {
                let state = serde_json::to_value(&v.verdict)
                    .ok()
                    .and_then(|j| j.get("state").and_then(|s| s.as_str().map(str::to_string)))
                    .unwrap_or_default();
                let labels = vec![
                    ("provider", v.provider.clone()),
                    ("space", v.space.clone()),
                    ("state", state),
                ];
                (labels, 1.0)
            }),
        )?;
        f.gauge(
            "fantom_hub_gate_min_cosine",
            "Minimum probe cosine of the last check against the space's fingerprint.",
            gate.verdicts.iter().filter_map(|v| {
                let e = v.evidence.as_ref()?;
                let labels = vec![("provider", v.provider.clone()), ("space", v.space.clone())];
                Some((labels, e.min_cosine))
            }),
        )?;
        f.counter(
            "fantom_hub_space_rows_total",
            "Vectors returned per space and provider.",
            gate.spaces.iter().flat_map(|s| {
                s.rows.iter().map(move |(p, n)| {
                    let labels = vec![("space", s.id.clone()), ("provider", p.clone())];
                    (labels, *n as f64)
                })
            }),
        )?;
        // One series per space and project, of what `value` reads.
        let per_project = |value: fn(&super::gate::ProjectRows) -> u64| {
            gate.spaces.iter().flat_map(move |s| {
                s.projects.iter().map(move |(p, n)| {
                    let labels = vec![("space", s.id.clone()), ("project", p.clone())];
                    (labels, value(n) as f64)
                })
            })
        };
        f.counter(
            "fantom_hub_space_project_rows_total",
            "Vectors returned per space and project.",
            per_project(|n| n.rows),
        )?;
        f.counter(
            "fantom_hub_space_project_tokens_total",
            "Tokens embedded per space and project.",
            per_project(|n| n.tokens),
        )?;
        f.gauge(
            "fantom_hub_space_live",
            "Each embedding role's live spaces (1 each): current, next (a migration's), previous.",
            gate.spaces.iter().filter_map(|s| {
                let live = match s.live? {
                    super::gate::Live::Current => "current",
                    super::gate::Live::Next => "next",
                    super::gate::Live::Previous => "previous",
                };
                let labels = vec![
                    ("role", s.role.to_string()),
                    ("space", s.id.clone()),
                    ("live", live.to_string()),
                ];
                Some((labels, 1.0))
            }),
        )?;
        f.gauge(
            "fantom_hub_space_passing_providers",
            "Providers whose gate verdict for a space passes.",
            gate.spaces
                .iter()
                .map(|s| (vec![("space", s.id.clone())], s.passing.len() as f64)),
        )?;
        f.gauge(
            "fantom_hub_scorer_check",
            "Local rerankers by the scorer check's state (1 each): the scorer they claim and the one they serve as.",
            core.scorer_check.view().into_iter().map(|v| {
                let labels = vec![
                    ("provider", v.provider),
                    ("claimed", v.claimed),
                    ("scorer", v.scorer.unwrap_or_default()),
                    ("state", v.state.to_string()),
                ];
                (labels, 1.0)
            }),
        )?;
        let c = &core.counters;
        f.counter(
            "fantom_hub_canary_texts_total",
            "Canaries (probe texts) sent in embedding work frames, per provider.",
            per_provider(&c.canary_texts),
        )?;
        f.counter(
            "fantom_hub_canary_tokens_total",
            "Tokens of the canaries (the hub's share of each frame's count; never in a client's usage).",
            per_provider(&c.canary_tokens),
        )?;
        f.counter(
            "fantom_hub_canary_failures_total",
            "Canaries that came back drifted (the provider was suspended at once).",
            per_provider(&c.canary_failures),
        )?;
        fn by_role(m: &BTreeMap<Role, Histogram>) -> Vec<(Labels, &Histogram)> {
            m.iter().map(|(r, h)| (label("role", r), h)).collect()
        }
        f.histogram(
            "fantom_hub_queue_seconds",
            "Seconds from a request's acceptance to its first lease.",
            by_role(&c.queue_seconds),
        )?;
        f.histogram(
            "fantom_hub_batch_items",
            "Items per work frame granted to a provider.",
            by_role(&c.batch_items),
        )?;
        f.histogram(
            "fantom_hub_request_tokens",
            "Tokens per completed request.",
            by_role(&c.request_tokens),
        )?;
        encode_projects(&core, f)?;
        drop(core);
        f.counter(
            "fantom_hub_state_saves_total",
            "Writes of the hub's state that the store took (a state file, or etcd).",
            one(self.state_saves() as f64),
        )?;
        encode_ha(f, &self.store().ha_view())
    }
}

/// The HA series every hub exports (a standby too, with its own view: `http::standby`):
/// whether this hub is the one that serves (1 on a leader and on a single hub), the epoch it
/// leads under or sees, whether it is fenced, and the lease renewals etcd answered.
pub fn encode_ha(f: &mut Families, ha: &super::store::HaView) -> fmt::Result {
    let one = |v: f64| [(Labels::new(), v)];
    let serving = matches!(ha.role, "leader" | "single");
    f.gauge(
        "fantom_hub_ha_leader",
        "1 on the hub that serves (an etcd leader or a single hub on a state file), 0 on a standby.",
        [(label("role", ha.role), if serving { 1.0 } else { 0.0 })],
    )?;
    f.gauge(
        "fantom_hub_ha_epoch",
        "The epoch (the leader key's creation revision) this hub leads under, or a standby sees (0: a single hub, or no leader seen yet).",
        one(ha.epoch.unwrap_or(0) as f64),
    )?;
    f.gauge(
        "fantom_hub_ha_fenced",
        "1 while this leader cannot renew its lead in etcd (no grants, passes or writes).",
        one(if ha.fenced.is_some() { 1.0 } else { 0.0 }),
    )?;
    f.counter(
        "fantom_hub_ha_lease_renewals_total",
        "Renewals of the leader's etcd lease that etcd answered (0 off etcd and on a standby).",
        one(ha.lease_renewals.unwrap_or(0) as f64),
    )
}

/// The per-project series: a `project` label on each, for the configured projects and
/// `default` only (so the label's values are bounded by the operator).
fn encode_projects(core: &super::core::Core, f: &mut Families) -> fmt::Result {
    use super::projects::ProjectUsage;
    let rows: Vec<(Labels, &ProjectUsage)> = core
        .projects
        .records()
        .filter_map(|(name, _)| Some((label("project", name), core.projects.usage.get(name)?)))
        .collect();
    let each = |value: &dyn Fn(&ProjectUsage) -> f64| -> Vec<(Labels, f64)> {
        rows.iter().map(|(l, u)| (l.clone(), value(u))).collect()
    };
    f.counter(
        "fantom_hub_project_requests_total",
        "Client requests accepted, per project.",
        each(&|u| u.requests as f64),
    )?;
    f.counter(
        "fantom_hub_project_texts_total",
        "Texts and documents accepted, per project.",
        each(&|u| u.texts as f64),
    )?;
    f.counter(
        "fantom_hub_project_tokens_total",
        "Tokens read for a project's items, by backend (canaries and gate probes are not a project's).",
        rows.iter().flat_map(|(l, u)| {
            [("local", u.local_tokens), ("cloud", u.cloud_tokens)].map(|(backend, n)| {
                let mut labels = l.clone();
                labels.push(("backend", backend.to_string()));
                (labels, n as f64)
            })
        }),
    )?;
    f.counter(
        "fantom_hub_project_cloud_calls_total",
        "Cloud calls made for a project.",
        each(&|u| u.cloud_calls as f64),
    )?;
    f.counter(
        "fantom_hub_project_cloud_cost_usd_total",
        "Cost the upstream reported for a project's cloud calls (US dollars).",
        each(&|u| u.cloud_usd),
    )?;
    f.counter(
        "fantom_hub_project_cloud_calls_without_cost_total",
        "A project's cloud calls whose answer reported no cost (tokens counted).",
        each(&|u| u.calls_without_cost as f64),
    )?;
    f.gauge(
        "fantom_hub_project_items_queued",
        "Items a project has accepted and not yet answered.",
        each(&|u| u.held_items as f64),
    )?;
    f.gauge(
        "fantom_hub_project_cloud_in_flight",
        "Cloud calls a project holds now.",
        each(&|u| f64::from(u.cloud_in_flight)),
    )?;
    f.counter(
        "fantom_hub_project_refused_total",
        "Requests refused by a project rule, by code.",
        rows.iter().flat_map(|(l, u)| {
            ["project_limit", "project_share", "project_quota"].map(|code| {
                let mut labels = l.clone();
                labels.push(("code", code.to_string()));
                (labels, u.refused.get(code).copied().unwrap_or(0) as f64)
            })
        }),
    )?;
    f.histogram(
        "fantom_hub_project_queue_seconds",
        "Seconds from a request's acceptance to its first lease, per project.",
        rows.iter().map(|(l, u)| (l.clone(), &u.queue_seconds)),
    )
}
