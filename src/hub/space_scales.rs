//! The int8 scales of vector spaces (`crate::quantize`): one per space and output width, each
//! derived from the space's stored fingerprint by the space's [`Int8Rule`], which the leader
//! stores with the space the first time a client asks for `int8` or `uint8` (before any code
//! made with it is answered) and never changes while the space lives. So every int8 row of a
//! space is quantized identically and stays comparable for as long as the space does, and no
//! client request makes more than one state write per space, whatever widths it asks. A space
//! stored with per-width scales serves those as stored. A leader that cannot store (fenced
//! from etcd) answers 503 for a space that holds no rule yet, rather than hand out codes a
//! later leader might make differently.

use super::core::SpaceRef;
use super::state::StateError;
use super::{Hub, to_the_end};
use crate::quantize::{Int8Rule, Int8Scale};

/// Why a space's int8 scale could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The store did not take it (fenced, deposed, unwritable).
    #[error(transparent)]
    State(#[from] StateError),
    /// The space the vectors came from was retired or founded again meanwhile.
    #[error("space {0} was replaced while the request ran; send it again")]
    SpaceChanged(String),
    /// The space's fingerprint has nothing at this width (cannot happen for a width the space
    /// serves; refused rather than guessed).
    #[error("space {0} has no fingerprint at width {1} to derive an int8 scale from")]
    NoFingerprint(String, usize),
    /// The stored scale cannot quantize anything (a state edited by hand, or damaged): it is
    /// never replaced while the space lives, so the space must be founded again.
    #[error(
        "the stored int8 scale of space {0} at width {1} is not usable ({2}); retire the space \
         (POST /admin/gate/verify with retire_space) to found a new generation"
    )]
    Unusable(String, usize, f32),
    /// The space's stored rule is not one this build can derive by (a newer build stored it).
    #[error(
        "space {0} stores int8 rule version {1}, which this build does not know; run the \
         build that stored it, or retire the space (POST /admin/gate/verify with retire_space)"
    )]
    UnknownRule(String, u32),
}

/// A scale as held, refused when it cannot be used.
fn usable(scale: Int8Scale, space: &SpaceRef, width: usize) -> Result<Int8Scale, ScaleError> {
    if scale.is_valid() {
        Ok(scale)
    } else {
        Err(ScaleError::Unusable(space.id.clone(), width, scale.range))
    }
}

impl Hub {
    /// The int8 scale of `space` at output `width`: the one stored, or a new one fixed from the
    /// space's fingerprint and stored first.
    pub async fn int8_scale(
        &self,
        space: &SpaceRef,
        width: usize,
    ) -> Result<Int8Scale, ScaleError> {
        let held = self
            .core()
            .gate
            .int8_scale(&space.id, space.generation, width);
        if let Some(scale) = held {
            return usable(scale, space, width);
        }
        let hub = self.clone();
        let space = space.clone();
        to_the_end(async move { hub.fix_int8_scale(&space, width).await }).await?
    }

    /// Stores the current [`Int8Rule`] with the space (its one write for int8 scales) and
    /// derives the scale at `width` by it.
    async fn fix_int8_scale(
        &self,
        space: &SpaceRef,
        width: usize,
    ) -> Result<Int8Scale, ScaleError> {
        let _writing = self.inner.state_writes.lock().await;
        let rule = Int8Rule::CURRENT;
        let (scale, spaces) = {
            let core = self.core();
            if let Some(scale) = core.gate.int8_scale(&space.id, space.generation, width) {
                return usable(scale, space, width);
            }
            let held = core
                .gate
                .space(&space.id)
                .filter(|s| s.generation == space.generation)
                .ok_or_else(|| ScaleError::SpaceChanged(space.id.clone()))?;
            if let Some(stored) = held.int8_rule {
                // A rule is stored and derives nothing here: never replaced.
                return Err(if stored.is_known() {
                    ScaleError::NoFingerprint(space.id.clone(), width)
                } else {
                    ScaleError::UnknownRule(space.id.clone(), stored.version)
                });
            }
            let scale = rule
                .scale(&held.fingerprint, width)
                .ok_or_else(|| ScaleError::NoFingerprint(space.id.clone(), width))?;
            let mut spaces = core.gate.spaces().clone();
            if let Some(s) = spaces.get_mut(&space.id) {
                s.int8_rule = Some(rule);
            }
            (scale, spaces)
        };
        self.writable()?;
        let mut next = self.state();
        next.spaces = spaces;
        let next = self.persist(next).await?;
        *self.lock_state() = next;
        if !self
            .core()
            .gate
            .set_int8_rule(&space.id, space.generation, rule)
        {
            return Err(ScaleError::SpaceChanged(space.id.clone()));
        }
        tracing::info!(space = %space.id, width, range = scale.range, rule = rule.version, "a space's int8 rule was stored; its scales are derived from it");
        Ok(scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::gate::{self, Space, measure};
    use crate::hub::state::HubState;
    use crate::roles::Role;

    fn space(generation: u64) -> Space {
        // Unit vectors whose largest component at width 4 (renormalised) is 0.5.
        let fingerprint = vec![vec![0.5, 0.5, 0.5, 0.5, 0.0, 0.0], vec![0.0; 6]];
        Space {
            role: Role::Embedding,
            model: "m".into(),
            dims: 6,
            encoder: "gpu/embedding m@1".into(),
            cloud_reference: false,
            fingerprint,
            created_ms: generation,
            probe_set: measure::probe_set_id(),
            generation,
            int8_scales: Default::default(),
            int8_rule: None,
        }
    }

    fn hub_on(dir: &std::path::Path, state: HubState) -> Hub {
        Hub::open_for_tests_from(dir, None, false, gate::GateSettings::default(), state)
    }

    fn stored(dir: &std::path::Path) -> HubState {
        let text = std::fs::read_to_string(dir.join("hub-state.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn space_ref(s: &Space) -> SpaceRef {
        SpaceRef {
            id: s.id(),
            generation: s.generation,
            role: s.role,
            model: s.model.clone(),
            dims: s.dims,
        }
    }

    #[tokio::test]
    async fn a_rule_is_stored_once_with_the_space_and_each_width_derived_by_the_next_hub() {
        let dir = tempfile::tempdir().unwrap();
        let s = space(7);
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        // Width 4: the fingerprint cut and renormalised; largest 0.5 × 1.5.
        let scale = hub.int8_scale(&space_ref(&s), 4).await.unwrap();
        assert_eq!(scale.range, 0.75);
        // The rule was stored with the space before the scale was answered.
        let on_disk = stored(dir.path());
        assert_eq!(on_disk.spaces[&s.id()].int8_rule, Some(Int8Rule::CURRENT));
        assert!(on_disk.spaces[&s.id()].int8_scales.is_empty());
        // A hub that reads the stored state (a restart, the next leader) derives each width by
        // the stored rule, never by its own: here the stored one differs on purpose.
        let mut later = on_disk;
        let kept = Int8Rule {
            version: 1,
            margin: 1.25,
        };
        later.spaces.get_mut(&s.id()).unwrap().int8_rule = Some(kept);
        let other = tempfile::tempdir().unwrap();
        let next = hub_on(other.path(), later);
        assert_eq!(
            next.int8_scale(&space_ref(&s), 4).await.unwrap().range,
            0.625
        );
        // Another width is derived, not stored.
        let full = next.int8_scale(&space_ref(&s), 6).await.unwrap();
        assert_eq!(full.range, 0.625);
        assert_eq!(next.state_saves(), 0, "nothing was written for a width");
        // A space founded again (another generation) is not this one: its vectors are refused,
        // never quantized with the old scale.
        let mut newer = space_ref(&s);
        newer.generation = 8;
        assert!(matches!(
            next.int8_scale(&newer, 4).await,
            Err(ScaleError::SpaceChanged(_))
        ));
    }

    #[tokio::test]
    async fn a_client_asking_every_width_causes_one_state_write_per_space() {
        let dir = tempfile::tempdir().unwrap();
        let s = space(9);
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        let before = hub.state_saves();
        let mut ranges = Vec::new();
        for width in 1..=6 {
            for _ in 0..3 {
                ranges.push(hub.int8_scale(&space_ref(&s), width).await.unwrap().range);
            }
        }
        assert_eq!(
            hub.state_saves() - before,
            1,
            "one write for the space's rule"
        );
        // The same scale as the rule derives, at every width, asked again or not.
        for (i, range) in ranges.iter().enumerate() {
            let width = i / 3 + 1;
            let want = Int8Rule::CURRENT.scale(&s.fingerprint, width).unwrap();
            assert_eq!(*range, want.range, "width {width}");
        }
    }

    #[tokio::test]
    async fn scales_stored_per_width_are_served_as_stored_and_other_widths_by_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = space(4);
        let kept = Int8Scale { range: 0.3 };
        s.int8_scales.insert(4, kept);
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        assert_eq!(hub.int8_scale(&space_ref(&s), 4).await.unwrap(), kept);
        assert_eq!(hub.state_saves(), 0);
        assert_eq!(hub.int8_scale(&space_ref(&s), 6).await.unwrap().range, 0.75);
        assert_eq!(hub.state_saves(), 1);
        let on_disk = stored(dir.path());
        assert_eq!(on_disk.spaces[&s.id()].int8_scales[&4], kept);
        assert_eq!(on_disk.spaces[&s.id()].int8_rule, Some(Int8Rule::CURRENT));
    }

    #[tokio::test]
    async fn a_rule_this_build_does_not_know_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = space(6);
        s.int8_rule = Some(Int8Rule {
            version: 99,
            margin: 2.0,
        });
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        let refused = hub.int8_scale(&space_ref(&s), 6).await.unwrap_err();
        assert!(
            matches!(refused, ScaleError::UnknownRule(_, 99)),
            "{refused}"
        );
        assert_eq!(hub.state_saves(), 0);
    }

    #[tokio::test]
    async fn a_stored_scale_that_cannot_quantize_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = space(5);
        s.int8_scales.insert(6, Int8Scale { range: 0.0 });
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        let refused = hub.int8_scale(&space_ref(&s), 6).await.unwrap_err();
        assert!(
            matches!(refused, ScaleError::Unusable(_, 6, _)),
            "{refused}"
        );
        assert!(refused.to_string().contains("retire_space"), "{refused}");
    }

    #[test]
    fn a_space_stored_before_scales_existed_reads_without_them() {
        let s = space(3);
        let mut json = serde_json::to_value(&s).unwrap();
        assert!(
            json.get("int8_scales").is_none(),
            "none written while empty"
        );
        json.as_object_mut().unwrap().remove("int8_scales");
        let read: Space = serde_json::from_value(json).unwrap();
        assert!(read.int8_scales.is_empty());
    }
}
