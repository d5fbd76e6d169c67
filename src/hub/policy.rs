//! Routing policy admission: may this provider take this role's work now?
//!
//! The dispatcher asks here first; the global cloud budget and the compatibility gate are the
//! next questions for cloud and embedding providers (they hold work back, never reroute it).

use crate::protocol::Backend;
use crate::roles::Policy;

/// Whether a provider may take work, and if not, why (shown in status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Serve,
    Hold(&'static str),
}

/// Whether `policy` lets providers of `backend` serve the role at all (`backup`'s preference
/// for local providers is [`admit`]'s business, not a reason to refuse).
pub fn allows(policy: Policy, backend: Backend) -> bool {
    !matches!(
        (policy, backend),
        (Policy::Local, Backend::Cloud) | (Policy::Cloud, Backend::Local)
    )
}

/// Admission of a provider of `backend` under `policy`; `healthy_local`: a local provider that
/// is connected and not benched could take the work.
pub fn admit(policy: Policy, backend: Backend, healthy_local: bool) -> Admission {
    match (policy, backend) {
        (Policy::Local, Backend::Cloud) => Admission::Hold("policy local: no cloud"),
        (Policy::Cloud, Backend::Local) => Admission::Hold("policy cloud: no local GPUs"),
        (Policy::Backup, Backend::Cloud) if healthy_local => {
            Admission::Hold("policy backup: a healthy local provider serves")
        }
        _ => Admission::Serve,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_policy_admits_its_backends() {
        use Backend::{Cloud as C, Local as L};
        let serve = |p, b, h| admit(p, b, h) == Admission::Serve;
        assert!(serve(Policy::Local, L, true) && !serve(Policy::Local, C, false));
        assert!(serve(Policy::Cloud, C, true) && !serve(Policy::Cloud, L, true));
        assert!(serve(Policy::Aggregate, L, true) && serve(Policy::Aggregate, C, true));
        assert!(serve(Policy::Backup, L, true) && !serve(Policy::Backup, C, true));
        assert!(
            serve(Policy::Backup, C, false),
            "backup: cloud when no local is healthy"
        );
        assert!(!allows(Policy::Local, C) && !allows(Policy::Cloud, L));
        assert!(allows(Policy::Backup, C) && allows(Policy::Aggregate, L));
    }
}
