//! kvfleet-core: the pure, sans-IO heart of kvfleet.
//!
//! Nothing here reads a clock, sleeps, spawns or touches a socket: time comes in as
//! [`time::Timestamp`], randomness as a seeded [`rng::SimRng`]. The simulator (`kvfleet-sim`) and the
//! real worker/coordinator processes drive exactly this code.
//!
//! | module | what lives there |
//! |---|---|
//! | [`time`], [`ids`], [`rng`] | nanosecond time newtypes, identifiers, the seeded PRNG |
//! | [`spec`] | model and GPU specs (TOML, built-in and user files); KV bytes/token is derived |
//! | [`timing`] | the `TimingModel` trait; `analytic` roofline and `profile` table interpolation |
//! | [`kv`] | the paged KV block manager: GPU pool + CPU offload pool, per-request block tables |
//! | [`engine`] | one instance's continuous-batching engine (`step(now)`) and its intra-instance schedulers `fcfs`, `rr`, `pascal` |
//! | [`pacer`] | the token pacer (Andes): digested-token curve, QoE, SLO state |
//! | [`policy`] | instance-level policies: PASCAL Alg. 1/2 + adaptive migration, baselines |
//! | [`workload`] | arrivals (Poisson, gamma), length distributions, trace parsers |
//! | [`metrics`] | per-request records → TTFT/TTFAT/TPOT/E2E/QoE/tail-bin summaries |

#![warn(missing_docs)]

pub mod engine;
pub mod idmap;
pub mod ids;
pub mod kv;
pub mod metrics;
pub mod pacer;
pub mod policy;
pub mod request;
pub mod rng;
pub mod spec;
pub mod time;
pub mod timing;
pub mod workload;

pub use ids::{InstanceId, RequestId};
pub use request::RequestSpec;
pub use rng::SimRng;
pub use time::{Dilation, TimeSpan, Timestamp};
