//! The gate's verdict machine, driven tick by tick with chosen vectors.

mod basics {
    use super::super::*;

    pub fn cand(provider: &str, backend: Backend, model: &str) -> Candidate {
        Candidate {
            provider: provider.into(),
            role: Role::Embedding,
            backend,
            model: model.into(),
            revision: None,
            upstream: (backend == Backend::Cloud).then(|| "deepinfra/bf16".to_string()),
            regime: "f32/cpu".into(),
            dims: Some(3),
            fronted: false,
            healthy: true,
        }
    }

    /// Unit vectors, one per probe text, all `c` away from the first axis.
    pub fn vectors(c: f32) -> Vec<Vec<f32>> {
        vec![vec![c, (1.0 - c * c).sqrt(), 0.0]; probe_texts().len()]
    }

    fn gate() -> Gate {
        Gate::new(GateSettings::default(), BTreeMap::new())
    }

    fn tick(g: &mut Gate, now: Instant, cands: &[Candidate], policy: Policy) -> Vec<ProbeRequest> {
        g.tick(now, cands, |_| policy, |_| Some(3))
    }

    #[test]
    fn the_reference_fingerprints_the_space_and_a_peer_is_judged_against_it() {
        let (mut g, t) = (gate(), Instant::now());
        let cands = [
            cand("a/embedding", Backend::Local, "m"),
            cand("b/cloud:embedding:1", Backend::Cloud, "cloud-m"),
        ];
        let first = tick(&mut g, t, &cands, Policy::Aggregate);
        assert_eq!(first.len(), 1, "only the reference, until the space exists");
        assert_eq!(first[0].provider, "a/embedding");
        assert!(
            g.serving_space(&cands[0]).is_none(),
            "never verified: refused"
        );
        g.on_result(&first[0].probe, Ok(vectors(1.0)), t);
        assert_eq!(g.serving_space(&cands[0]), Some("embedding:m:3"));
        let second = tick(&mut g, t, &cands, Policy::Aggregate);
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].provider, "b/cloud:embedding:1");
        // A second tick while the probe is out shares it.
        assert!(tick(&mut g, t, &cands, Policy::Aggregate).is_empty());
        g.on_result(&second[0].probe, Ok(vectors(0.976)), t);
        assert!(g.serving_space(&cands[1]).is_none());
        assert!(g.take_dirty(), "the new space is persisted");
        // Refusals do not expire: no more probes.
        assert!(
            tick(
                &mut g,
                t + Duration::from_secs(3600),
                &cands[1..],
                Policy::Aggregate
            )
            .iter()
            .all(|p| p.provider != "b/cloud:embedding:1")
        );
    }

    #[test]
    fn a_fronted_server_never_founds_a_space_unless_named_the_reference() {
        let t = Instant::now();
        let mut server = cand("h/server:embedding", Backend::Local, "tei-m");
        server.fronted = true;
        let ours = cand("z/embedding", Backend::Local, "m");
        // Alone, it founds nothing (and so serves nothing).
        let mut g = gate();
        assert!(tick(&mut g, t, std::slice::from_ref(&server), Policy::Local).is_empty());
        assert!(g.serving_space(&server).is_none());
        // Beside our own model it sorts first, yet our model is the reference.
        let cands = [server.clone(), ours.clone()];
        let first = tick(&mut g, t, &cands, Policy::Local);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].provider, "z/embedding");
        g.on_result(&first[0].probe, Ok(vectors(1.0)), t);
        let second = tick(&mut g, t, &cands, Policy::Local);
        assert_eq!(second[0].provider, "h/server:embedding");
        g.on_result(&second[0].probe, Ok(vectors(0.97)), t);
        assert!(g.serving_space(&server).is_none(), "judged, and refused");
        // Named by the operator, it is the reference.
        let settings = GateSettings {
            reference: Some("h/server:embedding".into()),
            ..Default::default()
        };
        let mut g = Gate::new(settings, BTreeMap::new());
        let p = tick(&mut g, t, std::slice::from_ref(&server), Policy::Local);
        assert_eq!(p[0].provider, "h/server:embedding");
        g.on_result(&p[0].probe, Ok(vectors(1.0)), t);
        assert_eq!(g.serving_space(&server), Some("embedding:tei-m:3"));
    }

    #[test]
    fn probe_failures_back_off_and_a_reconnect_clears_them() {
        let (mut g, t) = (gate(), Instant::now());
        let cands = [cand("a/embedding", Backend::Local, "m")];
        let p = tick(&mut g, t, &cands, Policy::Local);
        g.on_result(&p[0].probe, Err("engine stopped".into()), t);
        assert!(tick(&mut g, t + Duration::from_secs(29), &cands, Policy::Local).is_empty());
        let p = tick(&mut g, t + Duration::from_secs(30), &cands, Policy::Local);
        assert_eq!(p.len(), 1);
        g.on_result(
            &p[0].probe,
            Err("engine stopped".into()),
            t + Duration::from_secs(30),
        );
        assert!(
            tick(&mut g, t + Duration::from_secs(89), &cands, Policy::Local).is_empty(),
            "60 s now"
        );
        g.agent_reconnected("a");
        assert_eq!(
            tick(&mut g, t + Duration::from_secs(31), &cands, Policy::Local).len(),
            1
        );
    }

    /// A gate whose sole cloud provider founded the space at `t` (under `cloud`) and passes.
    fn sole_cloud_anchor(t: Instant) -> (Gate, [Candidate; 1]) {
        let mut g = gate();
        let cands = [cand("a/cloud:embedding:1", Backend::Cloud, "m")];
        let p = tick(&mut g, t, &cands, Policy::Cloud);
        g.on_result(&p[0].probe, Ok(vectors(1.0)), t);
        (g, cands)
    }

    #[test]
    fn the_sentinel_suspends_a_provider_that_drifted() {
        let t = Instant::now();
        let (mut g, cands) = sole_cloud_anchor(t);
        assert!(
            g.serving_space(&cands[0]).is_some(),
            "the sole anchor: dims and pin"
        );
        assert!(tick(&mut g, t + Duration::from_secs(599), &cands, Policy::Cloud).is_empty());
        let later = t + Duration::from_secs(600);
        let p = tick(&mut g, later, &cands, Policy::Cloud);
        assert_eq!(p.len(), 1, "re-probed after the period");
        g.on_result(&p[0].probe, Ok(vectors(0.97)), later);
        assert!(g.serving_space(&cands[0]).is_none(), "suspended at once");
        let v = g.view(&BTreeMap::new());
        assert!(matches!(v.verdicts[0].verdict, Verdict::Suspended { .. }));
        assert_eq!(
            v.verdicts[0].checks, 2,
            "the founding check and the re-probe"
        );
    }

    #[test]
    fn a_suspension_is_told_to_its_agent_and_a_reported_one_is_honoured_until_a_verify() {
        let t = Instant::now();
        let (mut g, cands) = sole_cloud_anchor(t);
        let later = t + Duration::from_secs(600);
        let p = tick(&mut g, later, &cands, Policy::Cloud);
        g.on_result(&p[0].probe, Ok(vectors(0.97)), later);
        let told = g.take_suspensions();
        assert!(g.take_urgent(), "a suspension is stored at once");
        assert_eq!(told.len(), 1);
        let (agent, notice) = told[0].clone();
        assert_eq!(
            (agent.as_str(), notice.provider.as_str()),
            ("a", "cloud:embedding:1")
        );
        assert!(g.take_suspensions().is_empty(), "told once");

        // The next leader restored the older pass (the suspension never reached the store).
        let stored = {
            let mut s = g.stored_verdicts();
            for v in s.values_mut() {
                v.verdict = Verdict::Pass;
                v.checked_at_ms = Some(notice.at_ms - 1);
            }
            s
        };
        let spaces = g.spaces.clone();
        let mut next = Gate::new(GateSettings::default(), spaces);
        assert_eq!(next.restore_verdicts(&stored, later), 1);
        assert!(tick(&mut next, later, &cands, Policy::Cloud).is_empty());
        assert!(next.serving_space(&cands[0]).is_some(), "the stale pass");
        // Another agent cannot report it; the provider's own can.
        assert!(!next.honour_reported("b", &notice));
        assert!(next.honour_reported("a", &notice));
        assert!(next.serving_space(&cands[0]).is_none(), "honoured");
        assert!(next.take_urgent(), "and stored");
        assert!(
            next.take_suspensions().is_empty(),
            "its agent knows already"
        );
        // Reported again at the next reconnect: nothing changes.
        assert!(!next.honour_reported("a", &notice));
        // An operator's verify judges it again; a clean probe passes, and an older report
        // no longer applies.
        next.reverify(Some("a/cloud:embedding:1"));
        // Its agent reconnects before the probe is judged: the old report does not come back.
        assert!(!next.honour_reported("a", &notice), "verified since");
        let p = tick(&mut next, later, &cands, Policy::Cloud);
        next.on_result(&p[0].probe, Ok(vectors(1.0)), later);
        assert!(next.serving_space(&cands[0]).is_some());
        assert!(
            !next.honour_reported("a", &notice),
            "judged after the suspension"
        );

        // A gate that has not judged the provider yet: its first judgement is the suspension.
        let mut fresh = Gate::new(GateSettings::default(), g.spaces.clone());
        assert!(
            !fresh.honour_reported("a", &notice),
            "kept for the first judgement"
        );
        let p = tick(&mut fresh, later, &cands, Policy::Cloud);
        assert_eq!(p.len(), 1, "{p:?}");
        fresh.on_result(&p[0].probe, Ok(vectors(1.0)), later);
        assert!(
            fresh.serving_space(&cands[0]).is_none(),
            "a clean probe does not lift it"
        );
        let v = fresh.view(&BTreeMap::new());
        assert_eq!(v.verdicts[0].caught_by, Some("agent"));
    }

    #[test]
    fn a_sentinel_probe_out_when_a_canary_suspends_still_times_out() {
        let t = Instant::now();
        let (mut g, cands) = sole_cloud_anchor(t);
        let later = t + Duration::from_secs(600);
        let sentinel = tick(&mut g, later, &cands, Policy::Cloud);
        assert_eq!(sentinel.len(), 1);
        let key = verdict_key(&cands[0], "embedding:m:3");
        assert!(g.check_canary(&key, 0, &[0.0, 0.0, 1.0], None).is_some());
        assert!(
            g.is_pending(&sentinel[0].probe),
            "out until answered or late"
        );
        // Never answered: it ends at the timeout like any probe (a cloud probe holds a budget
        // permit until it ends), and the suspension stands.
        let late = later + g.settings.probe_timeout;
        assert!(tick(&mut g, late, &cands, Policy::Cloud).is_empty());
        assert!(!g.is_pending(&sentinel[0].probe));
        assert!(g.serving_space(&cands[0]).is_none());
    }

    #[test]
    fn without_a_reference_candidates_are_judged_against_the_stored_space() {
        let (mut g, t) = (gate(), Instant::now());
        let local = cand("a/embedding", Backend::Local, "m");
        let cloud = cand("b/cloud:embedding:1", Backend::Cloud, "cloud-m");
        let p = tick(&mut g, t, std::slice::from_ref(&local), Policy::Backup);
        g.on_result(&p[0].probe, Ok(vectors(1.0)), t);
        assert!(g.take_dirty());
        let spaces = g.spaces().clone();
        // A restarted hub with the GPU down: the cloud is still checked, against the fingerprint.
        let mut g = Gate::new(GateSettings::default(), spaces);
        let p = tick(&mut g, t, std::slice::from_ref(&cloud), Policy::Backup);
        assert_eq!(p.len(), 1);
        g.on_result(&p[0].probe, Ok(vectors(0.999)), t);
        assert_eq!(g.serving_space(&cloud), Some("embedding:m:3"));
        // A wrong width is refused whatever the cosine.
        let mut narrow = cloud.clone();
        narrow.provider = "c/cloud:embedding:1".into();
        let p = tick(&mut g, t, std::slice::from_ref(&narrow), Policy::Backup);
        g.on_result(
            &p[0].probe,
            Ok(vec![vec![1.0, 0.0]; probe_texts().len()]),
            t,
        );
        assert!(g.serving_space(&narrow).is_none());
    }
}

mod answer_tests {
    use super::super::*;
    use super::basics::{cand, vectors};

    #[test]
    fn only_the_provider_asked_may_answer_and_a_second_fingerprint_is_judged() {
        let (mut g, t) = (
            Gate::new(GateSettings::default(), BTreeMap::new()),
            Instant::now(),
        );
        let a = cand("a/embedding", Backend::Local, "m");
        let p = g.tick(t, std::slice::from_ref(&a), |_| Policy::Local, |_| Some(3));
        assert!(
            p[0].probe.len() > 10,
            "a probe id is not guessable: {}",
            p[0].probe
        );
        assert!(!g.on_answer(&p[0].probe, "b/embedding", Ok(vectors(1.0)), t));
        assert!(
            g.serving_space(&a).is_none(),
            "a stranger's answer is ignored"
        );
        // All-zero vectors cannot found a space.
        assert!(g.on_answer(
            &p[0].probe,
            "a/embedding",
            Ok(vec![vec![0.0; 3]; probe_texts().len()]),
            t
        ));
        assert!(g.serving_space(&a).is_none());
        // Two references asked for one space: the second answer is judged, not stored.
        let b = cand("b/embedding", Backend::Local, "m");
        let mut g = Gate::new(GateSettings::default(), BTreeMap::new());
        let pa = g.tick(t, std::slice::from_ref(&a), |_| Policy::Local, |_| Some(3));
        let pb = g.tick(t, std::slice::from_ref(&b), |_| Policy::Local, |_| Some(3));
        assert!(pb.is_empty(), "no second fingerprint while one is out");
        g.on_answer(&pa[0].probe, "a/embedding", Ok(vectors(1.0)), t);
        let pb = g.tick(t, &[a.clone(), b.clone()], |_| Policy::Local, |_| Some(3));
        assert_eq!(pb.len(), 1);
        g.on_answer(&pb[0].probe, "b/embedding", Ok(vectors(0.9)), t);
        assert!(
            g.serving_space(&b).is_none(),
            "judged against a's fingerprint"
        );
        assert_eq!(g.space("embedding:m:3").unwrap().fingerprint, vectors(1.0));
    }
}

mod space_tests {
    use super::super::*;
    use super::basics::{cand, vectors};

    #[test]
    fn a_retired_space_is_fingerprinted_again_and_old_probe_sets_are_dropped() {
        let (mut g, t) = (
            Gate::new(GateSettings::default(), BTreeMap::new()),
            Instant::now(),
        );
        let a = cand("a/embedding", Backend::Local, "m");
        let p = g.tick(t, std::slice::from_ref(&a), |_| Policy::Local, |_| Some(3));
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(0.8)), t);
        assert!(g.retire("embedding:m:3"));
        assert!(!g.retire("embedding:m:3"), "already gone");
        assert!(g.serving_space(&a).is_none());
        let p = g.tick(t, std::slice::from_ref(&a), |_| Policy::Local, |_| Some(3));
        assert_eq!(p.len(), 1, "the reference is asked again");
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(1.0)), t);
        assert_eq!(g.space("embedding:m:3").unwrap().fingerprint, vectors(1.0));
        // A stored fingerprint of another probe set is not used.
        assert!(g.take_dirty());
        let mut spaces = g.spaces().clone();
        spaces.get_mut("embedding:m:3").unwrap().probe_set = "an older set".into();
        let g = Gate::new(GateSettings::default(), spaces);
        assert!(g.space("embedding:m:3").is_none());
    }
}

mod policy_switch_tests {
    use super::super::*;
    use super::basics::{cand, vectors};

    #[test]
    fn the_current_space_changes_only_by_a_cutover() {
        let (mut g, t) = (
            Gate::new(GateSettings::default(), BTreeMap::new()),
            Instant::now(),
        );
        let cloud = cand("cloud-a/cloud:embedding:1", Backend::Cloud, "cloud-m");
        let gpu = cand("gpu/embedding", Backend::Local, "m");
        let cands = [cloud.clone(), gpu.clone()];
        let p = g.tick(t, &cands, |_| Policy::Local, |_| Some(3));
        assert_eq!(p.len(), 1);
        g.on_result(&p[0].probe, Ok(vectors(1.0)), t);
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:m:3"));
        // A move to `cloud`: the cloud route is judged against the role's space (and refused),
        // never made the anchor of a new one.
        let p = g.tick(t, &cands, |_| Policy::Cloud, |_| Some(3));
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].provider, cloud.provider);
        g.on_result(&p[0].probe, Ok(vectors(0.5)), t);
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:m:3"));
        assert!(g.serving_space(&cloud).is_none(), "refused");
        assert!(g.space("embedding:cloud-m:3").is_none());
        // The reference host lost: still the role's space.
        assert!(
            g.tick(
                t,
                std::slice::from_ref(&cloud),
                |_| Policy::Cloud,
                |_| Some(3)
            )
            .is_empty()
        );
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:m:3"));
        // An operator's migration to the cloud route: fingerprinted as the next space.
        let open = Step::Open {
            founder: Founder::Cloud {
                model: "cloud-m".into(),
                provider: "deepinfra/bf16".into(),
                dims: 3,
                quantization: None,
            },
            policy: Policy::Cloud,
        };
        let now = |passing_next| RoleNow {
            passing_next,
            policy: Policy::Local,
            route: None,
        };
        g.migrated(Role::Embedding, &open, &now(0)).unwrap();
        let p = g.tick(t, &cands, |_| Policy::Local, |_| Some(3));
        let fp: Vec<_> = p.iter().filter(|r| r.provider == cloud.provider).collect();
        assert_eq!(fp.len(), 1, "{p:?}");
        g.on_result(&fp[0].probe, Ok(vectors(0.5)), t);
        assert_eq!(
            g.standing(&cloud, "embedding:cloud-m:3"),
            Standing::Pass,
            "the anchor of the next space"
        );
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:m:3"));
        assert_eq!(
            g.which(Role::Embedding, "embedding:cloud-m:3"),
            Some(Live::Next)
        );
        assert_eq!(
            g.space_policy(Role::Embedding, "embedding:cloud-m:3"),
            Some(Policy::Cloud)
        );
        // Cutover: one step.
        g.migrated(Role::Embedding, &Step::Cutover, &now(1))
            .unwrap();
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:cloud-m:3"));
        assert_eq!(
            g.which(Role::Embedding, "embedding:m:3"),
            Some(Live::Previous)
        );
        assert!(g.take_dirty(), "persisted with the spaces");
        // A restarted gate keeps it.
        let (spaces, live) = (g.spaces().clone(), g.live().clone());
        let mut g = Gate::new(GateSettings::default(), spaces);
        g.restore_live(live);
        let _ = g.tick(t, &cands, |_| Policy::Local, |_| Some(3));
        assert_eq!(g.current_id(Role::Embedding), Some("embedding:cloud-m:3"));
    }
}

mod unpinned_tests {
    use super::super::*;
    use super::basics::{cand, vectors};

    fn local(g: &mut Gate, t: Instant, c: &Candidate) -> Vec<ProbeRequest> {
        g.tick(t, std::slice::from_ref(c), |_| Policy::Local, |_| Some(3))
    }

    #[test]
    fn new_bytes_in_an_unpinned_reference_are_judged_against_its_space_never_a_new_one() {
        let (mut g, t) = (
            Gate::new(GateSettings::default(), BTreeMap::new()),
            Instant::now(),
        );
        // An unpinned folder is named by its digest: the space it founds carries no path.
        let first = cand(
            "a/embedding",
            Backend::Local,
            "sha256:0123456789abcdef01234567",
        );
        let p = local(&mut g, t, &first);
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(1.0)), t);
        let space = "embedding:sha256:0123456789abcdef01234567:3";
        assert_eq!(g.current_id(Role::Embedding), Some(space));
        // New bytes in the same folder: a new provider identity, probed against that space.
        let changed = cand(
            "a/embedding",
            Backend::Local,
            "sha256:fedcba9876543210fedcba98",
        );
        let p = local(&mut g, t, &changed);
        assert_eq!(p.len(), 1);
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(0.9)), t);
        assert_eq!(
            g.current_id(Role::Embedding),
            Some(space),
            "no silently new space"
        );
        assert!(g.serving_space(&changed).is_none(), "refused at 0.9");
        assert!(
            g.space("embedding:sha256:fedcba9876543210fedcba98:3")
                .is_none()
        );
    }

    #[test]
    fn a_space_stored_under_a_folder_path_keeps_serving_after_the_upgrade() {
        let (mut g, t) = (
            Gate::new(GateSettings::default(), BTreeMap::new()),
            Instant::now(),
        );
        let old = cand("a/embedding", Backend::Local, "folder:/srv/models/minilm");
        let p = local(&mut g, t, &old);
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(1.0)), t);
        assert!(g.take_dirty());
        let stored = g.spaces().clone();
        // The upgraded agent sends the same bytes by their digest.
        let mut g = Gate::new(GateSettings::default(), stored);
        let now = cand(
            "a/embedding",
            Backend::Local,
            "sha256:0123456789abcdef01234567",
        );
        let p = local(&mut g, t, &now);
        g.on_answer(&p[0].probe, "a/embedding", Ok(vectors(1.0)), t);
        assert_eq!(
            g.serving_space(&now),
            Some("embedding:folder:/srv/models/minilm:3"),
            "judged against the stored space and serving it"
        );
    }
}
