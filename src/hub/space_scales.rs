//! The int8 scales of vector spaces (`crate::quantize`): one per space and output width, fixed
//! by the leader the first time a client asks for `int8` or `uint8` at that width, stored with
//! the space before any code made with it is answered, and never changed while the space lives.
//! So every int8 row of a space is quantized identically and stays comparable for as long as
//! the space does. A space stored before scales existed reads without them and gets each once.
//! A leader that cannot store (fenced from etcd) answers 503 for a scale it does not hold yet,
//! rather than hand out codes a later leader would make differently.

use std::time::Instant;

use super::core::SpaceRef;
use super::state::StateError;
use super::{Hub, to_the_end};
use crate::quantize::Int8Scale;

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
    #[error("space {0} has no fingerprint at width {1} to fix an int8 scale from")]
    NoFingerprint(String, usize),
    /// The stored scale cannot quantize anything (a state edited by hand, or damaged): it is
    /// never replaced while the space lives, so the space must be founded again.
    #[error(
        "the stored int8 scale of space {0} at width {1} is not usable ({2}); retire the space \
         (POST /admin/gate/verify with retire_space) to found a new generation"
    )]
    Unusable(String, usize, f32),
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

    async fn fix_int8_scale(
        &self,
        space: &SpaceRef,
        width: usize,
    ) -> Result<Int8Scale, ScaleError> {
        let _writing = self.inner.state_writes.lock().await;
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
            let scale = Int8Scale::from_fingerprint(&held.fingerprint, width)
                .ok_or_else(|| ScaleError::NoFingerprint(space.id.clone(), width))?;
            let mut spaces = core.gate.spaces().clone();
            if let Some(s) = spaces.get_mut(&space.id) {
                s.int8_scales.insert(width, scale);
            }
            (scale, spaces)
        };
        self.inner
            .store
            .fence()
            .check(Instant::now())
            .map_err(|fenced| StateError::Fenced(fenced.0))?;
        let mut next = self.state();
        next.spaces = spaces;
        let next = self.persist(next).await?;
        *self.lock_state() = next;
        if !self
            .core()
            .gate
            .set_int8_scale(&space.id, space.generation, width, scale)
        {
            return Err(ScaleError::SpaceChanged(space.id.clone()));
        }
        tracing::info!(space = %space.id, width, range = scale.range, "an int8 scale was fixed for a space and stored");
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
    async fn a_scale_is_fixed_once_stored_with_the_space_and_read_back_by_the_next_hub() {
        let dir = tempfile::tempdir().unwrap();
        let s = space(7);
        let mut state = HubState::fresh();
        state.spaces.insert(s.id(), s.clone());
        let hub = hub_on(dir.path(), state);
        // Width 4: the fingerprint cut and renormalised; largest 0.5 × 1.5.
        let scale = hub.int8_scale(&space_ref(&s), 4).await.unwrap();
        assert_eq!(scale.range, 0.75);
        // Stored with the space before it was answered.
        let on_disk = stored(dir.path());
        assert_eq!(on_disk.spaces[&s.id()].int8_scales[&4], scale);
        // A hub that reads the stored state (a restart, the next leader) serves the stored
        // number, never one it would compute: here the stored one differs on purpose.
        let mut later = on_disk;
        let kept = crate::quantize::Int8Scale { range: 0.625 };
        later
            .spaces
            .get_mut(&s.id())
            .unwrap()
            .int8_scales
            .insert(4, kept);
        let other = tempfile::tempdir().unwrap();
        let next = hub_on(other.path(), later);
        assert_eq!(next.int8_scale(&space_ref(&s), 4).await.unwrap(), kept);
        // Another width gets its own, once.
        let full = next.int8_scale(&space_ref(&s), 6).await.unwrap();
        assert_eq!(full.range, 0.75);
        assert_eq!(stored(other.path()).spaces[&s.id()].int8_scales.len(), 2);
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
    async fn a_stored_scale_that_cannot_quantize_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = space(5);
        s.int8_scales
            .insert(6, crate::quantize::Int8Scale { range: 0.0 });
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
