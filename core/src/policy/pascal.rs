//! PASCAL's instance-level scheduler (PASCAL §IV-B): Alg. 1 places new (reasoning) requests,
//! Alg. 2 picks an instance for the answering phase at `</think>`, and *adaptive migration*
//! overrides Alg. 2 when moving would trade free GPU memory for a full instance (Fig. 7).
//!
//! The §V-D ablations are modes of the same policy: [`MigrationMode::NoMigration`] pins every
//! request to its Alg. 1 instance, [`MigrationMode::NonAdaptive`] always follows Alg. 2.
//!
//! Every choice is an argmin over [`LoadReport`]s with ties broken by the lowest [`InstanceId`], so
//! the result does not depend on the order in which reports are listed. Nothing here allocates:
//! the simulator calls these once per arrival and once per phase boundary.
//!
//! Two switches, off by default (the literal reading): `demand_aware_memory` makes "sufficient GPU
//! memory" count free blocks less the reasoning demand already waiting for them
//! ([`LoadReport::reasoning_demand_blocks`]); [`TieBreak::MostFreeGpu`] (an extension, not in
//! the paper) breaks Alg. 2's ties by free GPU memory before the instance id.

use super::{InstancePolicy, LoadReport, PhaseChange, PhaseDecision};
use crate::ids::InstanceId;
use crate::request::RequestSpec;
use crate::rng::SimRng;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;

/// Default GPU headroom (blocks) an instance needs to serve an answering request: 16 blocks of 16
/// tokens = 256 tokens, about a median answer.
pub const DEFAULT_HEADROOM_BLOCKS: u32 = 16;

/// What PASCAL does at the reasoning→answering boundary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationMode {
    /// Alg. 2, overridden by adaptive migration (§IV-B, Fig. 7). The paper's PASCAL.
    #[default]
    Adaptive,
    /// Always follow Alg. 2 — PASCAL(NonAdaptive), §V-D.
    NonAdaptive,
    /// Never migrate — PASCAL(NoMigration), §V-D.
    NoMigration,
}

/// How Alg. 2 breaks a tie on r_i (or on r_i + a_i when no instance meets its SLO).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieBreak {
    /// The lowest instance id (the literal reading: the paper names no rule).
    #[default]
    LowestId,
    /// Extension, not in the paper: the most free GPU blocks (less reasoning demand when
    /// `demand_aware_memory` is on), then the lowest id.
    MostFreeGpu,
}

/// PASCAL Alg. 1 + Alg. 2 + adaptive migration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PascalPolicy {
    mode: MigrationMode,
    headroom_blocks: u32,
    demand_aware: bool,
    tie_break: TieBreak,
}

impl Default for PascalPolicy {
    fn default() -> Self {
        PascalPolicy::new(MigrationMode::Adaptive, DEFAULT_HEADROOM_BLOCKS)
    }
}

impl PascalPolicy {
    /// `headroom_blocks`: free GPU blocks an instance must keep, beyond the request's own KV, to be
    /// said to have "sufficient GPU memory" for the answering phase (adaptive migration only).
    pub fn new(mode: MigrationMode, headroom_blocks: u32) -> Self {
        PascalPolicy { mode, headroom_blocks, demand_aware: false, tie_break: TieBreak::LowestId }
    }
    /// Count an instance's free GPU blocks less its reasoning demand
    /// ([`LoadReport::gpu_free_blocks_after_demand`]) in adaptive migration's memory test (and in
    /// [`TieBreak::MostFreeGpu`]).
    pub fn with_demand_aware_memory(mut self, on: bool) -> Self {
        self.demand_aware = on;
        self
    }
    /// How Alg. 2 breaks ties.
    pub fn with_tie_break(mut self, tie_break: TieBreak) -> Self {
        self.tie_break = tie_break;
        self
    }
    /// What it does at the `</think>` boundary.
    pub fn mode(&self) -> MigrationMode {
        self.mode
    }
    /// Free GPU blocks adaptive migration asks of an instance beyond the request's KV.
    pub fn headroom_blocks(&self) -> u32 {
        self.headroom_blocks
    }

    /// The adaptive-migration override: the current instance can keep serving the request (it has
    /// `headroom_blocks` free for the answer's growth; the request's KV is already there) while the
    /// target could not take the request's KV plus the same headroom.
    /// Free GPU blocks as this policy counts them.
    fn free_blocks(&self, load: &LoadReport) -> u32 {
        if self.demand_aware {
            load.gpu_free_blocks_after_demand()
        } else {
            load.gpu_free_blocks()
        }
    }

    fn stay_for_memory(&self, change: &PhaseChange, loads: &[LoadReport], target: InstanceId) -> bool {
        let free_blocks = |id: InstanceId| loads.iter().find(|l| l.instance == id).map(|l| self.free_blocks(l));
        // A current instance that published no report (e.g. it is leaving) is not "sufficient".
        let current_ok = free_blocks(change.current).is_some_and(|free| free >= self.headroom_blocks);
        let needed_blocks = change.kv_blocks as u64 + self.headroom_blocks as u64;
        let target_ok = free_blocks(target).is_some_and(|free| free as u64 >= needed_blocks);
        current_ok && !target_ok
    }
}

/// The element of `loads` minimising `key`, ties to the lowest instance id.
fn argmin_by_key<K: Ord>(
    loads: &[LoadReport],
    keep: impl Fn(&LoadReport) -> bool,
    key: impl Fn(&LoadReport) -> K,
) -> Option<InstanceId> {
    loads.iter().filter(|l| keep(l)).min_by_key(|l| (key(l), l.instance)).map(|l| l.instance)
}

/// PASCAL Alg. 1: among instances whose answering requests all meet their SLO (t_i), the one with
/// the smallest KV footprint m_i (GPU + CPU); if none meets its SLO, the smallest m_i overall.
/// `None` only when `loads` is empty.
pub fn select_reasoning_instance(loads: &[LoadReport]) -> Option<InstanceId> {
    argmin_by_key(loads, |l| l.answering_slo_ok, LoadReport::kv_footprint_bytes)
        .or_else(|| argmin_by_key(loads, |_| true, LoadReport::kv_footprint_bytes))
}

/// PASCAL Alg. 2: among SLO-meeting instances, the fewest reasoning requests r_i; if none meets
/// its SLO, the smallest r_i + a_i (a_i = answering requests still in their first quantum) over
/// all instances. `None` only when `loads` is empty.
pub fn select_answering_instance(loads: &[LoadReport]) -> Option<InstanceId> {
    argmin_by_key(loads, |l| l.answering_slo_ok, |l| l.reasoning_requests)
        .or_else(|| argmin_by_key(loads, |_| true, |l| l.reasoning_requests as u64 + l.fresh_answering_requests as u64))
}

/// [`select_answering_instance`], ties on r_i (r_i + a_i) broken first by the most `free` blocks.
fn select_answering_instance_by_free(loads: &[LoadReport], free: impl Fn(&LoadReport) -> u32) -> Option<InstanceId> {
    argmin_by_key(loads, |l| l.answering_slo_ok, |l| (l.reasoning_requests, Reverse(free(l)))).or_else(|| {
        argmin_by_key(
            loads,
            |_| true,
            |l| (l.reasoning_requests as u64 + l.fresh_answering_requests as u64, Reverse(free(l))),
        )
    })
}

impl InstancePolicy for PascalPolicy {
    fn name(&self) -> &str {
        match self.mode {
            MigrationMode::Adaptive => "pascal",
            MigrationMode::NonAdaptive => "pascal-nonadaptive",
            MigrationMode::NoMigration => "pascal-nomigration",
        }
    }

    fn place(&mut self, _request: &RequestSpec, loads: &[LoadReport], _rng: &mut SimRng) -> InstanceId {
        debug_assert!(!loads.is_empty(), "place() needs at least one instance");
        select_reasoning_instance(loads).unwrap_or_default()
    }

    fn on_phase_change(&mut self, change: &PhaseChange, loads: &[LoadReport], _rng: &mut SimRng) -> PhaseDecision {
        if self.mode == MigrationMode::NoMigration {
            return PhaseDecision::Stay;
        }
        let target = match self.tie_break {
            TieBreak::LowestId => select_answering_instance(loads),
            TieBreak::MostFreeGpu => select_answering_instance_by_free(loads, |l| self.free_blocks(l)),
        };
        let Some(target) = target else {
            return PhaseDecision::Stay;
        };
        if target == change.current {
            return PhaseDecision::Stay;
        }
        if self.mode == MigrationMode::Adaptive && self.stay_for_memory(change, loads, target) {
            return PhaseDecision::Stay;
        }
        PhaseDecision::Migrate { to: target }
    }

    fn migrates_at_phase_boundary(&self) -> bool {
        self.mode != MigrationMode::NoMigration
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ids::RequestId;
    use crate::time::Timestamp;

    pub(crate) const BLOCK_BYTES: u64 = 16 * 1024;

    /// A report with the fields the policies read; `gpu_total` 1000 blocks unless set by `mem`.
    pub(crate) fn load(id: u32, slo_ok: bool) -> LoadReport {
        LoadReport {
            instance: InstanceId(id),
            gpu_total_blocks: 1000,
            block_bytes: BLOCK_BYTES,
            answering_slo_ok: slo_ok,
            ..LoadReport::default()
        }
    }
    pub(crate) trait With {
        fn kv(self, gpu_used: u32, cpu_used: u32) -> Self;
        fn queues(self, reasoning: u32, fresh_answering: u32) -> Self;
        fn gpu_free(self, free: u32) -> Self;
    }
    impl With for LoadReport {
        fn kv(mut self, gpu_used: u32, cpu_used: u32) -> Self {
            self.gpu_used_blocks = gpu_used;
            self.cpu_used_blocks = cpu_used;
            self
        }
        fn queues(mut self, reasoning: u32, fresh_answering: u32) -> Self {
            self.reasoning_requests = reasoning;
            self.fresh_answering_requests = fresh_answering;
            self.answering_requests = fresh_answering;
            self
        }
        fn gpu_free(mut self, free: u32) -> Self {
            self.gpu_used_blocks = self.gpu_total_blocks - free;
            self
        }
    }

    pub(crate) fn request() -> RequestSpec {
        RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(7),
            arrival: Timestamp::ZERO,
            prompt_tokens: 100,
            reasoning_tokens: 500,
            answer_tokens: 200,
        }
    }
    fn change(current: u32, kv_blocks: u32) -> PhaseChange {
        PhaseChange { request: RequestId(7), current: InstanceId(current), kv_blocks }
    }

    #[test]
    fn alg1_placement_table() {
        let cases: Vec<(&str, Vec<LoadReport>, u32)> = vec![
            (
                "SLO filter beats a smaller footprint",
                vec![load(0, true).kv(10, 0), load(1, false).kv(2, 0), load(2, true).kv(5, 0)],
                2,
            ),
            (
                "no instance meets its SLO: min footprint overall",
                vec![load(0, false).kv(10, 0), load(1, false).kv(3, 0), load(2, false).kv(7, 0)],
                1,
            ),
            ("footprint counts CPU-offloaded blocks", vec![load(0, true).kv(4, 6), load(1, true).kv(8, 0)], 1),
            (
                "tie broken by lowest id, whatever the listing order",
                vec![load(2, true).kv(5, 0), load(0, true).kv(5, 0), load(1, true).kv(9, 0)],
                0,
            ),
            (
                "a lone SLO-ok instance wins even when heaviest",
                vec![load(0, false).kv(0, 0), load(1, true).kv(900, 50)],
                1,
            ),
            ("single violating instance is still chosen", vec![load(3, false).kv(999, 999)], 3),
        ];
        for mode in [MigrationMode::Adaptive, MigrationMode::NonAdaptive, MigrationMode::NoMigration] {
            let mut policy = PascalPolicy::new(mode, DEFAULT_HEADROOM_BLOCKS);
            let mut rng = SimRng::seed_from_u64(1);
            for (name, loads, want) in &cases {
                assert_eq!(policy.place(&request(), loads, &mut rng), InstanceId(*want), "{mode:?}: {name}");
            }
        }
    }

    #[test]
    fn alg2_selection_table() {
        let cases: Vec<(&str, Vec<LoadReport>, Option<u32>)> = vec![
            (
                "min r_i among SLO-ok",
                vec![load(0, true).queues(3, 0), load(1, true).queues(1, 0), load(2, false).queues(0, 0)],
                Some(1),
            ),
            (
                "a_i ignored while some instance is SLO-ok",
                vec![load(0, true).queues(1, 9), load(1, true).queues(2, 0)],
                Some(0),
            ),
            // min r_i alone would pick 1 (r=1); r_i + a_i = 2, 6, 6 picks 0.
            (
                "fallback r_i + a_i changes the answer",
                vec![load(0, false).queues(2, 0), load(1, false).queues(1, 5), load(2, false).queues(3, 3)],
                Some(0),
            ),
            (
                "tie on r_i broken by lowest id",
                vec![load(2, true).queues(1, 0), load(1, true).queues(1, 0), load(0, true).queues(4, 0)],
                Some(1),
            ),
            (
                "tie on r_i + a_i broken by lowest id",
                vec![load(1, false).queues(1, 1), load(0, false).queues(2, 0)],
                Some(0),
            ),
            ("no instances", vec![], None),
        ];
        for (name, loads, want) in cases {
            assert_eq!(select_answering_instance(&loads), want.map(InstanceId), "{name}");
        }
    }

    #[test]
    fn phase_change_decision_table() {
        use MigrationMode::*;
        use PhaseDecision::*;
        let to = |i| Migrate { to: InstanceId(i) };
        // PASCAL Fig. 7: instance 0 (current) hosts reasoning requests and has free GPU memory,
        // instance 2 hosts the answering requests, has no reasoning request and a full GPU.
        let fig7 = vec![
            load(0, true).queues(3, 0).gpu_free(100),
            load(1, true).queues(2, 0).gpu_free(50),
            load(2, true).queues(0, 4).gpu_free(0),
        ];
        // Two instances; current 0 has `cur` free blocks, target 1 has `tgt` free; the request holds 40.
        let pair = |cur: u32, tgt: u32| {
            vec![load(0, true).queues(2, 0).gpu_free(cur), load(1, true).queues(0, 0).gpu_free(tgt)]
        };
        let cases: Vec<(&str, MigrationMode, Vec<LoadReport>, PhaseChange, PhaseDecision)> = vec![
            ("Fig. 7: current has memory, target full -> stay", Adaptive, fig7.clone(), change(0, 40), Stay),
            ("Fig. 7 NonAdaptive follows Alg. 2", NonAdaptive, fig7.clone(), change(0, 40), to(2)),
            ("Fig. 7 NoMigration pins", NoMigration, fig7.clone(), change(0, 40), Stay),
            (
                "Alg. 2 picks the current instance",
                Adaptive,
                pair(500, 500).into_iter().rev().collect(),
                change(1, 40),
                Stay,
            ),
            ("both sufficient -> migrate", Adaptive, pair(500, 500), change(0, 40), to(1)),
            ("both insufficient -> migrate (only a roomy current stays)", Adaptive, pair(15, 10), change(0, 40), to(1)),
            ("current insufficient, target sufficient -> migrate", Adaptive, pair(0, 500), change(0, 40), to(1)),
            ("target exactly kv + headroom is sufficient", Adaptive, pair(500, 56), change(0, 40), to(1)),
            ("target one block short -> stay", Adaptive, pair(500, 55), change(0, 40), Stay),
            ("current exactly at headroom is sufficient", Adaptive, pair(16, 55), change(0, 40), Stay),
            ("current below headroom -> migrate", Adaptive, pair(15, 55), change(0, 40), to(1)),
            ("current missing from loads -> migrate", Adaptive, vec![load(1, true).gpu_free(0)], change(0, 40), to(1)),
            ("NoMigration never moves, even to an empty instance", NoMigration, pair(0, 1000), change(0, 40), Stay),
            (
                "SLO-violating current: fallback over all instances",
                Adaptive,
                vec![load(0, false).queues(0, 3).gpu_free(0), load(1, false).queues(1, 0).gpu_free(500)],
                change(0, 40),
                to(1),
            ),
            ("no instances -> stay", NonAdaptive, vec![], change(0, 40), Stay),
        ];
        let mut rng = SimRng::seed_from_u64(1);
        for (name, mode, loads, change, want) in cases {
            let mut policy = PascalPolicy::new(mode, DEFAULT_HEADROOM_BLOCKS);
            assert_eq!(policy.on_phase_change(&change, &loads, &mut rng), want, "{name}");
        }
    }

    /// `demand_aware_memory`: reasoning requests waiting for an instance's free blocks (high queue
    /// first) leave less of them for the answering request, on the current instance (stay is
    /// refused) and on the target (judged insufficient). Headroom 16, the request holds 40.
    #[test]
    fn demand_aware_memory_table() {
        use PhaseDecision::*;
        let to = |i| Migrate { to: InstanceId(i) };
        // Current 0 (r = 2) and target 1 (r = 0), each as (free blocks, reasoning demand blocks).
        let pair = |cur: (u32, u32), tgt: (u32, u32)| {
            let mut c = load(0, true).queues(2, 0).gpu_free(cur.0);
            let mut t = load(1, true).queues(0, 0).gpu_free(tgt.0);
            (c.reasoning_demand_blocks, t.reasoning_demand_blocks) = (cur.1, tgt.1);
            vec![c, t]
        };
        let cases: Vec<(&str, bool, Vec<LoadReport>, PhaseDecision)> = vec![
            ("literal: 100 free suffice, full target -> stay", false, pair((100, 90), (0, 0)), Stay),
            ("demand takes 90 of 100: current short -> migrate", true, pair((100, 90), (0, 0)), to(1)),
            ("demand leaves exactly the headroom -> stay", true, pair((116, 100), (0, 0)), Stay),
            ("demand leaves one block short -> migrate", true, pair((115, 100), (0, 0)), to(1)),
            ("demand covers every free block -> migrate", true, pair((50, 80), (0, 0)), to(1)),
            ("literal: target's 500 free suffice -> migrate", false, pair((500, 0), (500, 480)), to(1)),
            ("target's demand leaves 20 < 40 + 16 -> stay", true, pair((500, 0), (500, 480)), Stay),
            ("target's demand leaves exactly 56 -> migrate", true, pair((500, 0), (500, 444)), to(1)),
        ];
        let mut rng = SimRng::seed_from_u64(1);
        for (name, aware, loads, want) in cases {
            let mut policy =
                PascalPolicy::new(MigrationMode::Adaptive, DEFAULT_HEADROOM_BLOCKS).with_demand_aware_memory(aware);
            assert_eq!(policy.on_phase_change(&change(0, 40), &loads, &mut rng), want, "{name}");
        }
    }

    /// Extension: Alg. 2 ties on r_i (r_i + a_i) go to the most free GPU blocks, then the lowest id.
    #[test]
    fn alg2_tie_break_by_free_gpu_table() {
        let cases: Vec<(&str, TieBreak, Vec<LoadReport>, u32)> = vec![
            (
                "literal: lowest id",
                TieBreak::LowestId,
                vec![load(1, true).queues(1, 0).gpu_free(10), load(2, true).queues(1, 0).gpu_free(900)],
                1,
            ),
            (
                "most free wins the tie",
                TieBreak::MostFreeGpu,
                vec![load(1, true).queues(1, 0).gpu_free(10), load(2, true).queues(1, 0).gpu_free(900)],
                2,
            ),
            (
                "r_i still decides first",
                TieBreak::MostFreeGpu,
                vec![load(1, true).queues(0, 0).gpu_free(10), load(2, true).queues(1, 0).gpu_free(900)],
                1,
            ),
            (
                "fallback r_i + a_i ties by free memory",
                TieBreak::MostFreeGpu,
                vec![load(1, false).queues(1, 1).gpu_free(10), load(2, false).queues(2, 0).gpu_free(900)],
                2,
            ),
            (
                "equal free memory: lowest id",
                TieBreak::MostFreeGpu,
                vec![load(2, true).queues(1, 0).gpu_free(50), load(1, true).queues(1, 0).gpu_free(50)],
                1,
            ),
        ];
        let mut rng = SimRng::seed_from_u64(1);
        for (name, tie, loads, want) in cases {
            let mut policy = PascalPolicy::new(MigrationMode::NonAdaptive, DEFAULT_HEADROOM_BLOCKS).with_tie_break(tie);
            let got = policy.on_phase_change(&change(0, 40), &loads, &mut rng);
            assert_eq!(got, PhaseDecision::Migrate { to: InstanceId(want) }, "{name}");
        }
    }

    #[test]
    fn names_and_migration_flags() {
        let cases = [
            (MigrationMode::Adaptive, "pascal", true),
            (MigrationMode::NonAdaptive, "pascal-nonadaptive", true),
            (MigrationMode::NoMigration, "pascal-nomigration", false),
        ];
        for (mode, name, migrates) in cases {
            let p = PascalPolicy::new(mode, 0);
            assert_eq!((p.name(), p.migrates_at_phase_boundary()), (name, migrates));
        }
        assert_eq!(PascalPolicy::default().mode(), MigrationMode::Adaptive);
        assert_eq!(PascalPolicy::default().headroom_blocks(), DEFAULT_HEADROOM_BLOCKS);
    }
}
