//! The agents' frames as the core sees them: `hello` (a session, superseding an older one,
//! with the keyed calls it still runs), the end of a socket (what its agent may still finish
//! is waited for while it comes back: `handed_over`), `providers`, `pull`, `heartbeat` (a
//! keyed chat parked when its lease expired, and listed, is live again), `config_ack`,
//! `limits`, and the gate's probes out and their answers.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{Core, results};
use crate::hub::budget;
use crate::hub::gate::Candidate;
use crate::hub::registry::{AgentEntry, AgentTx, Outgoing, ProviderEntry};
use crate::hub::scorer_check::{PROBE_DOCUMENTS, PROBE_QUERY, ScorerCheck};
use crate::protocol::{
    self, AccountLimits, Backend, ConfigAck, ErrorCode, Heartbeat, Hello, HubFrame,
    PROTOCOL_VERSION, ProviderInfo, Welcome,
};

/// Why `hello` was refused; a `code` also closes the socket.
#[derive(Debug)]
pub struct HelloRefused {
    pub message: String,
    pub code: Option<ErrorCode>,
}

impl From<String> for HelloRefused {
    fn from(message: String) -> Self {
        Self {
            message,
            code: None,
        }
    }
}

impl From<&str> for HelloRefused {
    fn from(message: &str) -> Self {
        message.to_string().into()
    }
}
use crate::roles::Role;

impl Core {
    /// Registers an agent's session (superseding an older one of the same id) and sends
    /// `welcome` before anything else can reach the socket.
    ///
    /// One agent per id: the same `instance` (or one that does not say) supersedes its old
    /// socket; another instance is refused while the id's session is live (a frame within
    /// three heartbeats), so two hosts sharing an id never take turns requeueing each other's
    /// work. A silent old session may be superseded by anyone.
    pub fn hello(&mut self, hello: Hello, tx: AgentTx) -> Result<u64, HelloRefused> {
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(HelloRefused {
                message: format!(
                    "protocol version {} is not spoken here (this hub speaks {PROTOCOL_VERSION})",
                    hello.protocol_version
                ),
                code: Some(ErrorCode::ProtocolVersion),
            });
        }
        if hello.agent_id.trim().is_empty() {
            return Err("hello needs a non-empty agent_id".into());
        }
        if hello.agent_id.contains(['/', '|']) {
            return Err(
                "an agent_id may not contain '/' or '|' (they separate provider names)".into(),
            );
        }
        let now = Instant::now();
        if let Some(live) = self.agents.get(&hello.agent_id)
            && let (Some(theirs), Some(ours)) = (&live.instance, &hello.instance)
            && theirs != ours
            && now.duration_since(live.last_seen) < self.settings.heartbeat_interval * 3
        {
            tracing::warn!(agent = %hello.agent_id, live_host = %live.hostname, claiming_host = %hello.hostname, "refused a second live process claiming an agent id");
            return Err(HelloRefused {
                message: format!(
                    "agent id '{}' is in use by another live agent process (on host '{}'); give each host its own agent_id (--agent-id, or agent_id in the agent's config)",
                    hello.agent_id, live.hostname
                ),
                code: Some(ErrorCode::AgentIdInUse),
            });
        }
        let providers = build_providers(&hello.agent_id, hello.providers)?;
        if let Some(old) = self.agents.remove(&hello.agent_id) {
            tracing::info!(agent = %hello.agent_id, old_session = old.session, "superseding the older session of this agent");
            let _ = old
                .tx
                .send(Outgoing::Close("superseded by a newer session".into()));
            self.requeue_session_leases(&hello.agent_id, old.session);
        }
        self.gate.agent_reconnected(&hello.agent_id);
        for reported in hello
            .suspensions
            .iter()
            .take(crate::protocol::MAX_REPORTED_SUSPENSIONS)
        {
            if self.gate.honour_reported(&hello.agent_id, reported) {
                tracing::warn!(agent = %hello.agent_id, provider = %reported.provider, space = %reported.space, "an earlier leader's suspension, reported by the agent, is honoured");
            }
        }
        self.scorer_check.agent_reconnected(&hello.agent_id);
        let session = self.next_session;
        self.next_session += 1;
        let welcome = HubFrame::Welcome(Welcome {
            session,
            epoch: self.epoch,
            protocol_version: PROTOCOL_VERSION,
            heartbeat_interval_ms: self.settings.heartbeat_interval.as_millis() as u64,
            lease_ms: self
                .settings
                .timings
                .values()
                .map(|t| t.lease)
                .min()
                .unwrap_or_default()
                .as_millis() as u64,
            pings: true,
            takes_answers: true,
        });
        let _ = tx.send(Outgoing::Frame(protocol::encode(&welcome)));
        let count = self.sockets.entry(hello.agent_id.clone()).or_default();
        count.open += 1;
        count.total += 1;
        count.max_concurrent = count.max_concurrent.max(count.open);
        self.agents.insert(
            hello.agent_id.clone(),
            AgentEntry {
                session,
                hostname: hello.hostname,
                version: hello.version,
                connected_at: now,
                last_seen: now,
                instance: hello.instance,
                tx,
                providers,
                devices: hello.devices,
                last_config_ack: None,
                held: hello.config,
                config_sent: None,
                config_awaiting_ack: false,
                keeps_answers: hello.keeps_answers,
                draining: false,
            },
        );
        // Keyed chats it still runs for an earlier session: a retry waits for their answers,
        // and each cloud call counts in flight until it ends.
        let answering = hello.answering.len().min(crate::protocol::MAX_KEPT_ANSWERS);
        let calls = &hello.answering[..answering];
        let tags: Vec<_> = calls.iter().map(|c| c.tag.clone()).collect();
        let longest_call = self
            .settings
            .timings
            .values()
            .map(|t| t.call_timeout)
            .max()
            .unwrap_or_default();
        let until = now + longest_call + self.settings.heartbeat_interval;
        // A call it reported before and does not list now ended: its `kept` outcome follows
        // this hello at once.
        let unlisted_until = now + self.settings.heartbeat_interval;
        self.replies
            .running_at(&hello.agent_id, &tags, until, unlisted_until);
        self.refresh_routes();
        self.answering(&hello.agent_id, calls);
        self.sync_agent(&hello.agent_id);
        self.gate_tick(Instant::now());
        self.dispatch_all();
        Ok(session)
    }

    /// Tells each agent of the suspensions of its providers made since the last call: it
    /// reports them to the next leader in its `hello` (`gate/reported`).
    pub fn tell_suspensions(&mut self) {
        for (agent, s) in self.gate.take_suspensions() {
            if let Some(a) = self.agents.get(&agent) {
                let frame = crate::protocol::encode(&crate::protocol::HubFrame::Suspended(s));
                let _ = a.tx.send(Outgoing::Frame(frame));
            }
        }
    }

    /// Asks every connected agent's socket to close with `reason` (a hub stepping aside: the
    /// agents dial again and find the leader); each session ends as its socket does.
    pub fn close_agents(&mut self, reason: &str) {
        for agent in self.agents.values() {
            let _ = agent.tx.send(Outgoing::Close(reason.to_string()));
        }
    }

    /// A socket that said hello has ended. Only its own session is removed: a close on an
    /// old socket never tears down a newer one.
    pub fn disconnect(&mut self, agent: &str, session: u64) {
        if let Some(count) = self.sockets.get_mut(agent) {
            count.open = count.open.saturating_sub(1);
        }
        if self.agents.get(agent).is_some_and(|a| a.session == session)
            && let Some(gone) = self.agents.remove(agent)
        {
            tracing::info!(agent, session, "agent disconnected");
            self.note_vanished(gone.providers.values());
            self.gate.agent_left(agent, Instant::now());
            // What it may still finish (keyed calls it runs, their permits) is waited for
            // while it comes back and says so.
            self.agent_away(agent, Instant::now());
        }
        self.requeue_session_leases(agent, session);
        // A reference may have left: the gate's round decides the roles' spaces first.
        self.gate_tick(Instant::now());
        self.dispatch_all();
    }

    /// Providers left the fleet: work they could serve waits a grace for them to come back.
    fn note_vanished<'a>(&mut self, gone: impl Iterator<Item = &'a ProviderEntry>) {
        let now = Instant::now();
        for p in gone {
            self.vanished.insert(p.role(), now);
        }
    }

    fn requeue_session_leases(&mut self, agent: &str, session: u64) {
        let lost: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.agent == agent && l.session == session)
            .map(|(id, _)| *id)
            .collect();
        let now = Instant::now();
        for id in lost {
            if let Some(lease) = self.remove_lease(id) {
                self.counters.leases_lost += 1;
                // A keyed chat its agent finishes and hands over: waited for (holding its
                // permit), not sent again.
                let Some(lease) = self.park_lost(id, lease, now, "its agent's connection was lost")
                else {
                    continue;
                };
                self.release_permit(&lease, budget::Outcome::Other);
                let role = lease.role;
                let local = lease.reference.origin.backend == Backend::Local;
                let items = results::mark_failed_locally(lease.items, local);
                self.requeue(role, items, true, "the agent disconnected");
            }
        }
    }

    /// The entry of a live session (a frame from it: it was seen now).
    fn session_agent(&mut self, agent: &str, session: u64) -> Result<&mut AgentEntry, String> {
        match self.agents.get_mut(agent) {
            Some(a) if a.session == session => {
                a.last_seen = Instant::now();
                Ok(a)
            }
            _ => Err("this session was superseded or closed".into()),
        }
    }

    pub fn set_providers(
        &mut self,
        agent: &str,
        session: u64,
        infos: Vec<ProviderInfo>,
    ) -> Result<(), String> {
        let mut next = build_providers(agent, infos)?;
        let entry = self.session_agent(agent, session)?;
        for (id, p) in next.iter_mut() {
            if let Some(old) = entry.providers.remove(id)
                && old.info == p.info
            {
                *p = old;
            }
        }
        // What is left of the old set was removed or changed. A role the agent still serves
        // (a push replaced its route) did not vanish; one it no longer serves (a drain) may
        // come back with the agent.
        let serving: Vec<Role> = next.values().map(ProviderEntry::role).collect();
        entry.draining = next.is_empty() && (entry.draining || !entry.providers.is_empty());
        let gone = std::mem::replace(&mut entry.providers, next);
        self.note_vanished(gone.values().filter(|p| !serving.contains(&p.role())));
        self.refresh_routes();
        self.gate_tick(Instant::now());
        self.dispatch_all();
        Ok(())
    }

    pub fn pull(
        &mut self,
        agent: &str,
        session: u64,
        provider: &str,
        credits: u32,
    ) -> Result<(), String> {
        let entry = self.session_agent(agent, session)?;
        let Some(p) = entry.providers.get_mut(provider) else {
            return Err(format!("pull for unknown provider '{provider}'"));
        };
        p.credits = p.credits.saturating_add(credits).min(1024);
        let role = p.role();
        self.dispatch(role);
        Ok(())
    }

    /// A heartbeat: the providers' counters, and the leases still running there, each renewed
    /// for its role's lease length (a lease of another agent or session is left alone).
    pub fn heartbeat(&mut self, agent: &str, session: u64, hb: Heartbeat) -> Result<(), String> {
        let entry = self.session_agent(agent, session)?;
        entry.devices = hb.devices;
        for stats in hb.providers {
            if let Some(p) = entry.providers.get_mut(&stats.provider) {
                p.heartbeat = Some(crate::hub::measured::provider_stats(stats));
            }
        }
        let now = Instant::now();
        let mut not_live = Vec::new();
        for id in hb.leases {
            match self.leases.get_mut(&id) {
                Some(lease) if lease.agent == agent && lease.session == session => {
                    lease.deadline = now + self.settings.timings(lease.role).lease;
                    self.counters.leases_renewed += 1;
                }
                Some(_) => {}
                None => not_live.push(id),
            }
        }
        // A keyed chat parked when its lease expired unrenewed, and still running: live again.
        for id in not_live {
            self.resume_parked(agent, session, id, now);
        }
        self.agent_holds(agent, hb.config);
        Ok(())
    }

    /// What became of a config frame; the config the agent holds since.
    pub fn config_ack(&mut self, agent: &str, session: u64, ack: ConfigAck) -> Result<(), String> {
        let held = ack.config.clone();
        let entry = self.session_agent(agent, session)?;
        entry.last_config_ack = Some(ack);
        // Answered: whatever it holds now is what it will hold (an agent of an older build
        // acks without taking the revision; its routes are stale, not on their way).
        entry.config_awaiting_ack = false;
        self.agent_holds(agent, held);
        self.refresh_routes();
        self.dispatch_all();
        Ok(())
    }

    /// An agent's answer to `discover`.
    pub fn account_limits(
        &mut self,
        agent: &str,
        session: u64,
        limits: AccountLimits,
    ) -> Result<(), String> {
        self.session_agent(agent, session)?;
        tracing::info!(agent, rpm = ?limits.rpm, funded = ?limits.funded, error = ?limits.error, "account limits discovered");
        self.budget.set_account(limits, Instant::now());
        self.dispatch_all();
        Ok(())
    }

    /// Asks one agent that holds current cloud routes and the current key for the account's
    /// limits, when due (every 10 minutes; at once after a new key).
    pub fn discover_if_due(&mut self, now: Instant) {
        let Some(agent) = self
            .agents
            .iter()
            .find(|(id, a)| {
                self.holds_current_key(id)
                    && a.providers
                        .values()
                        .any(|p| p.route.is_some() && p.stale.is_none())
            })
            .map(|(_, a)| a)
        else {
            return;
        };
        if self.budget.take_discovery_due(now) {
            agent.send(protocol::encode(&HubFrame::Discover));
        }
    }

    /// The gate's round: probes to send (new providers, retries, the sentinel), sent now; the
    /// scorer check's round first. A probe to a cloud provider goes through the shared key like
    /// any work, so it holds a budget permit while it is out; without one it waits for a later
    /// round, claiming the next permit of a full scope ([`probe_permits`](super::probe_permits)).
    pub fn gate_tick(&mut self, now: Instant) {
        self.scorer_tick(now);
        let mut freed = self.release_probe_permits(now);
        let had_claims = self.probe_permits.end_claims();
        // A fenced leader founds no space and judges no one (another hub may lead by now);
        // the verdicts it holds stand, and canaries still suspend.
        if self.fence.check(now).is_err() {
            if freed {
                self.dispatch_all();
            }
            return;
        }
        let candidates: Vec<Candidate> = self
            .agents
            .values()
            .flat_map(|a| a.providers.values())
            // A stale cloud route is probed by no gate: probe texts never reach a route the
            // hub does not hold (or a role kept local).
            .filter(|p| p.stale.is_none())
            .filter_map(|p| {
                let mut c = p.gate_candidate.clone()?;
                c.healthy = p.is_healthy(now);
                Some(c)
            })
            .collect();
        let cloud = &self.cloud;
        let requests = self.gate.tick(
            now,
            &candidates,
            |r| cloud.policy(r),
            |r| cloud.allowed_models.get(&r).and_then(|m| m.dims),
        );
        // Probes this round timed out give their permits to this round's probes first.
        freed |= self.release_probe_permits(now);
        for r in requests {
            // `agent/provider`, as the candidate was named.
            let target = r
                .provider
                .split_once('/')
                .and_then(|(agent, pid)| Some((self.agents.get(agent)?, pid)));
            let route = target.and_then(|(a, pid)| a.providers.get(pid)?.route.as_ref());
            if let Some(route) = route {
                if !self.budget.try_acquire(route, now) {
                    let hold = self.budget.check(route, now);
                    tracing::debug!(provider = %r.provider, route = %route, hold = ?hold, "gate probe waits for a budget permit");
                    if let Some(hold) = hold
                        && !self.budget.held_beyond_capacity(route, now)
                    {
                        self.probe_permits.claim(&hold, now);
                    }
                    self.gate.withdraw(&r.probe);
                    continue;
                }
                self.probe_permits.hold(&r.probe, route);
            }
            let sent = target.is_some_and(|(a, pid)| {
                a.send(protocol::encode(&HubFrame::Probe(protocol::Probe {
                    probe: r.probe.clone(),
                    provider: pid.to_string(),
                    texts: r.texts,
                    query: None,
                })))
            });
            if !sent {
                self.gate
                    .on_result(&r.probe, Err("the agent is gone".into()), now);
            }
        }
        freed |= self.release_probe_permits(now);
        if freed || had_claims {
            // Freed permits, and those kept for probes that no longer claim them, go to work.
            self.dispatch_all();
        }
    }

    /// Returns the budget permits of probes the gate no longer waits for (answered, failed,
    /// timed out, their agent gone); whether any came back (the caller offers them to work).
    fn release_probe_permits(&mut self, now: Instant) -> bool {
        let gate = &self.gate;
        let done = self.probe_permits.take_done(|probe| gate.is_pending(probe));
        let any = !done.is_empty();
        for route in done {
            // No latency sample: a probe's twelve texts (one long) are not a work frame.
            self.budget.release(&route, budget::Outcome::Other, now);
        }
        any
    }

    /// The scorer check's round: probes to local rerankers without a standing, sent now; each
    /// provider's scorer set from its standing.
    fn scorer_tick(&mut self, now: Instant) {
        let candidates: Vec<_> = self
            .agents
            .values()
            .flat_map(|a| a.providers.values())
            .filter(|p| p.info.backend == Backend::Local)
            .filter_map(|p| Some((p.reference.provider.clone(), p.claimed_scorer.clone()?)))
            .collect();
        for r in self.scorer_check.tick(now, &candidates) {
            let sent = r.provider.split_once('/').and_then(|(agent, pid)| {
                let a = self.agents.get(agent)?;
                a.send(protocol::encode(&HubFrame::Probe(protocol::Probe {
                    probe: r.probe.clone(),
                    provider: pid.to_string(),
                    texts: PROBE_DOCUMENTS.iter().map(|d| d.to_string()).collect(),
                    query: Some(PROBE_QUERY.to_string()),
                })))
                .then_some(())
            });
            if sent.is_none() {
                self.scorer_check.on_answer(
                    &r.probe,
                    &r.provider,
                    Err("the agent is gone".into()),
                    now,
                );
            }
        }
        self.sync_scorers();
    }

    /// Each local reranker's scorer, as the check has it now.
    fn sync_scorers(&mut self) {
        let check = &self.scorer_check;
        for p in self
            .agents
            .values_mut()
            .flat_map(|a| a.providers.values_mut())
        {
            if p.claimed_scorer.is_some() && p.info.backend == Backend::Local {
                p.scorer = check.scorer_of(&p.reference.provider);
            }
        }
    }

    /// An agent's answer to a `probe`.
    pub fn probe_result(
        &mut self,
        agent: &str,
        session: u64,
        result: protocol::ProbeResult,
    ) -> Result<(), String> {
        self.session_agent(agent, session)?;
        if ScorerCheck::is_probe(&result.probe) {
            let answer = match (result.scores, result.error) {
                (Some(s), None) => Ok(s),
                (_, Some(e)) => Err(e),
                (None, None) => Err("probe_result has neither scores nor error".into()),
            };
            let from = format!("{agent}/{}", result.provider);
            let now = Instant::now();
            if !self
                .scorer_check
                .on_answer(&result.probe, &from, answer, now)
            {
                return Err(format!(
                    "probe '{}' was not asked of '{}'",
                    result.probe, result.provider
                ));
            }
            self.sync_scorers();
            self.dispatch_all();
            return Ok(());
        }
        let from = format!("{agent}/{}", result.provider);
        let now = Instant::now();
        if let (Some(_), Some(error)) = (result.defect, &result.error) {
            // Output wrong in itself: a sentinel's suspends the verdict, any other probe fails
            // at once (a suspension is allowed even while fenced).
            if !self.gate.on_defect(&result.probe, &from, error, now) {
                return Err(format!(
                    "probe '{}' was not asked of '{}'",
                    result.probe, result.provider
                ));
            }
            self.gate_tick(now);
            self.dispatch_all();
            return Ok(());
        }
        let answer = match (result.vectors, result.error) {
            (Some(v), None) => Ok(v),
            (_, Some(e)) => Err(e),
            (None, None) => Err("probe_result has neither vectors nor error".into()),
        };
        // Fenced, an answer may only keep or suspend a verdict (a sentinel's); one that could
        // found a space or pass a provider counts as a probe that failed, asked again later.
        let answer = match self.fence.check(now) {
            Err(fenced) if !self.gate.only_keeps_or_suspends(&result.probe) => Err(fenced.0),
            _ => answer,
        };
        if !self.gate.on_answer(&result.probe, &from, answer, now) {
            return Err(format!(
                "probe '{}' was not asked of '{}'",
                result.probe, result.provider
            ));
        }
        // A new space or verdict: the gate's round decides the role's space now.
        self.gate_tick(Instant::now());
        self.dispatch_all();
        Ok(())
    }
}

fn build_providers(
    agent: &str,
    infos: Vec<ProviderInfo>,
) -> Result<BTreeMap<String, ProviderEntry>, String> {
    let mut out = BTreeMap::new();
    for info in infos {
        if info.id.is_empty() {
            return Err("a provider needs a non-empty id".into());
        }
        let id = info.id.clone();
        let info = crate::hub::measured::provider_info(info)?;
        if out
            .insert(id.clone(), ProviderEntry::new(agent, info))
            .is_some()
        {
            return Err(format!("provider id '{id}' appears twice"));
        }
    }
    Ok(out)
}
