//! kvfleet-control: the cluster control layer, written once and driven by both backends.
//!
//! A cluster decision (where a request runs, whether it moves at `</think>`, where it starts over
//! when its instance dies) is made here and nowhere else. The deterministic simulator
//! (`kvfleet-sim`) and the coordinator's leader (`kvfleet-coordinator`) feed the same
//! [`Controller`] the same [`Event`]s and execute the [`Action`]s it returns: the simulator
//! against in-process engines in virtual time, the leader over etcd and gRPC in real time.
//!
//! Sans-IO like the rest of the core: no clock, no sockets, no tasks; time and randomness come
//! in as parameters, so a seed gives the same decisions in both backends.
//!
//! | module | what lives there |
//! |---|---|
//! | [`arrow`] | Arrow's prefill/decode decisions: TTFT prediction, SLO-aware placement, role flips |
//! | [`controller`] | [`Controller`], its [`Event`]s and [`Action`]s, charge-on-place, fallback |
//! | [`ownership`] | who owns a request in which phase (persisted by the coordinator) |
//! | [`roles`] | instance roles for prefill/decode disaggregation |
//! | [`prefix`] | where prompts' prefixes are predicted cached (for prefix-aware policies) |

#![warn(missing_docs)]

pub mod arrow;
pub mod controller;
pub mod ownership;
pub mod prefix;
pub mod roles;

pub use controller::{
    Action, ArrowProfile, ControlError, Controller, Event, MoveOutcome, RejectReason, Silence, MAX_CORRUPT_HANDOFFS,
    MAX_RETARGETS,
};
pub use ownership::{OwnedPhase, Ownership};
pub use roles::Role;
