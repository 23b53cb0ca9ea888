//! The coordinator's scheduling state, sans-IO: which workers exist and how loaded they are, which
//! request is owned by which instance in which phase, and the instance-level policy from
//! `kvfleet-core` that decides placement and phase-boundary migration. The async driver
//! (`leader.rs`) feeds it worker events and executes its decisions.

use kvfleet_core::policy::{InstancePolicy, LoadReport, PhaseChange, PhaseDecision};
use kvfleet_core::{InstanceId, RequestId, RequestSpec, SimRng};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use kvfleet_meta::layout::ClusterModel;

/// A request's phase as the coordinator tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnedPhase {
    Reasoning,
    Answering,
    /// Being moved between instances.
    Migrating,
    Finished,
}

/// Who owns a request: persisted in the metadata store before the client is acknowledged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ownership {
    pub spec: RequestSpec,
    pub instance: InstanceId,
    pub phase: OwnedPhase,
    /// Times the request was re-placed because its worker died.
    pub replaced: u32,
    pub migrations: u32,
    /// While `phase` is `Migrating`: where to. Persisted before the move starts, so a leader that
    /// takes over knows to settle a move its predecessor left undecided (see
    /// `Leader::settle_inherited_moves`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrating_to: Option<InstanceId>,
}

#[derive(Clone, Debug)]
pub struct Member {
    pub address: String,
    pub load: LoadReport,
    pub alive: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("worker {instance} serves model `{got}` ({got_bytes} KV bytes/token) but the cluster runs `{want}` ({want_bytes})")]
    ModelMismatch { instance: u32, got: String, got_bytes: u64, want: String, want_bytes: u64 },
    #[error("no live worker to place request {0} on")]
    NoWorkers(RequestId),
    #[error("request {0} is already known")]
    Duplicate(RequestId),
    #[error("request {0} is unknown")]
    Unknown(RequestId),
}

/// Registry + ownership + policy.
#[derive(Debug)]
pub struct ClusterState {
    model: ClusterModel,
    policy: Box<dyn InstancePolicy>,
    rng: SimRng,
    members: BTreeMap<InstanceId, Member>,
    requests: BTreeMap<RequestId, Ownership>,
}

impl ClusterState {
    pub fn new(model: ClusterModel, policy: Box<dyn InstancePolicy>, seed: u64) -> Self {
        ClusterState {
            model,
            policy,
            rng: SimRng::seed_from_u64(seed),
            members: BTreeMap::new(),
            requests: BTreeMap::new(),
        }
    }

    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }
    pub fn model(&self) -> &ClusterModel {
        &self.model
    }
    pub fn members(&self) -> &BTreeMap<InstanceId, Member> {
        &self.members
    }
    pub fn requests(&self) -> &BTreeMap<RequestId, Ownership> {
        &self.requests
    }
    pub fn ownership(&self, id: RequestId) -> Option<&Ownership> {
        self.requests.get(&id)
    }

    /// A worker (re)joins. Refused when it serves another model.
    pub fn join(
        &mut self,
        instance: InstanceId,
        address: String,
        model: &str,
        kv_bytes_per_token: u64,
    ) -> Result<(), StateError> {
        if model != self.model.model || kv_bytes_per_token != self.model.kv_bytes_per_token {
            return Err(StateError::ModelMismatch {
                instance: instance.0,
                got: model.into(),
                got_bytes: kv_bytes_per_token,
                want: self.model.model.clone(),
                want_bytes: self.model.kv_bytes_per_token,
            });
        }
        let m = self.members.entry(instance).or_insert_with(|| Member {
            address: address.clone(),
            load: LoadReport { instance, answering_slo_ok: true, ..LoadReport::default() },
            alive: true,
        });
        m.address = address;
        m.alive = true;
        Ok(())
    }

    pub fn on_load(&mut self, load: LoadReport) {
        if let Some(m) = self.members.get_mut(&load.instance) {
            m.load = load;
        }
    }

    /// A worker is gone: returns its unfinished requests, now to be re-placed.
    pub fn leave(&mut self, instance: InstanceId) -> Vec<RequestId> {
        if let Some(m) = self.members.get_mut(&instance) {
            m.alive = false;
        }
        self.requests
            .iter()
            .filter(|(_, o)| o.instance == instance && o.phase != OwnedPhase::Finished)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Loads of live workers, in instance order (what policies see).
    pub fn loads(&self) -> Vec<LoadReport> {
        self.members.values().filter(|m| m.alive).map(|m| m.load.clone()).collect()
    }

    /// Alg. 1 (or the configured policy) for a new request; records the ownership.
    pub fn place(&mut self, spec: &RequestSpec) -> Result<InstanceId, StateError> {
        if self.requests.contains_key(&spec.id) {
            return Err(StateError::Duplicate(spec.id));
        }
        let to = self.choose(spec)?;
        let phase = if spec.reasoning_tokens > 0 { OwnedPhase::Reasoning } else { OwnedPhase::Answering };
        self.requests.insert(
            spec.id,
            Ownership { spec: spec.clone(), instance: to, phase, replaced: 0, migrations: 0, migrating_to: None },
        );
        self.charge(to, spec);
        Ok(to)
    }

    /// Count a placement in the instance's published load right away: reports arrive every few
    /// tens of milliseconds, and without this a burst of arrivals would all see the same "least
    /// loaded" instance (the simulator sees every change at once). The next report replaces it.
    fn charge(&mut self, to: InstanceId, spec: &RequestSpec) {
        let kv_bytes = self.model.kv_bytes_per_token;
        if let Some(m) = self.members.get_mut(&to) {
            let l = &mut m.load;
            let block_tokens = if kv_bytes > 0 { (l.block_bytes / kv_bytes).max(1) } else { 16 };
            l.gpu_used_blocks += (spec.prompt_tokens as u64 + 1).div_ceil(block_tokens) as u32;
            l.waiting_requests += 1;
            if spec.reasoning_tokens > 0 {
                l.reasoning_requests += 1;
            } else {
                l.answering_requests += 1;
                l.fresh_answering_requests += 1;
            }
        }
    }

    /// Count a decided migration in both instances' published loads right away (as [`Self::charge`]
    /// does for placements): the target reserves the request's blocks at PREPARE, so a burst of
    /// `</think>` boundaries must not all pick the same target's last free blocks.
    fn charge_move(&mut self, from: InstanceId, to: InstanceId, kv_blocks: u32) {
        if let Some(m) = self.members.get_mut(&to) {
            m.load.gpu_used_blocks += kv_blocks;
            m.load.answering_requests += 1;
            m.load.fresh_answering_requests += 1;
        }
        if let Some(m) = self.members.get_mut(&from) {
            m.load.gpu_used_blocks = m.load.gpu_used_blocks.saturating_sub(kv_blocks);
            m.load.answering_requests = m.load.answering_requests.saturating_sub(1);
        }
    }

    /// Place a request again (its worker died): a fresh start on another live worker.
    pub fn replace(&mut self, id: RequestId) -> Result<InstanceId, StateError> {
        let spec = self.requests.get(&id).ok_or(StateError::Unknown(id))?.spec.clone();
        let to = self.choose(&spec)?;
        let o = self.requests.get_mut(&id).expect("checked above");
        o.instance = to;
        o.replaced += 1;
        o.phase = if spec.reasoning_tokens > 0 { OwnedPhase::Reasoning } else { OwnedPhase::Answering };
        o.migrating_to = None;
        Ok(to)
    }

    fn choose(&mut self, spec: &RequestSpec) -> Result<InstanceId, StateError> {
        let loads = self.loads();
        if loads.is_empty() {
            return Err(StateError::NoWorkers(spec.id));
        }
        let to = self.policy.place(spec, &loads, &mut self.rng);
        // A policy must pick a live instance; fall back to the least loaded if it did not.
        if loads.iter().any(|l| l.instance == to) {
            Ok(to)
        } else {
            Ok(loads.iter().min_by_key(|l| (l.kv_footprint_bytes(), l.instance)).expect("non-empty").instance)
        }
    }

    /// `</think>` on `instance`: Alg. 2 + adaptive migration. Marks the request answering, or
    /// migrating when the decision is to move it.
    pub fn on_boundary(&mut self, id: RequestId, instance: InstanceId, kv_blocks: u32) -> PhaseDecision {
        let Some(o) = self.requests.get_mut(&id) else { return PhaseDecision::Stay };
        o.phase = OwnedPhase::Answering;
        if !self.policy.migrates_at_phase_boundary() {
            return PhaseDecision::Stay;
        }
        let loads = self.loads();
        let change = PhaseChange { request: id, current: instance, kv_blocks };
        match self.policy.on_phase_change(&change, &loads, &mut self.rng) {
            PhaseDecision::Migrate { to } if to != instance && loads.iter().any(|l| l.instance == to) => {
                let o = self.requests.get_mut(&id).expect("present");
                o.phase = OwnedPhase::Migrating;
                o.migrating_to = Some(to);
                self.charge_move(instance, to, kv_blocks);
                PhaseDecision::Migrate { to }
            }
            _ => PhaseDecision::Stay,
        }
    }

    /// The target declined a move of `id` (no room): ask the policy again with the instances in
    /// `declined` left out. `Some(to)`: try `to` (charged as on the first decision); `None`: it
    /// stays where it is.
    pub fn retarget(
        &mut self,
        id: RequestId,
        instance: InstanceId,
        kv_blocks: u32,
        declined: &[InstanceId],
    ) -> Option<InstanceId> {
        if !self.requests.contains_key(&id) {
            return None;
        }
        let loads: Vec<LoadReport> = self.loads().into_iter().filter(|l| !declined.contains(&l.instance)).collect();
        let change = PhaseChange { request: id, current: instance, kv_blocks };
        match self.policy.on_phase_change(&change, &loads, &mut self.rng) {
            PhaseDecision::Migrate { to } if to != instance && loads.iter().any(|l| l.instance == to) => {
                let o = self.requests.get_mut(&id).expect("present");
                o.phase = OwnedPhase::Migrating;
                o.migrating_to = Some(to);
                self.charge_move(instance, to, kv_blocks);
                Some(to)
            }
            _ => None,
        }
    }

    /// The move finished (`to = Some`) or was abandoned (`None`: it stays on its source).
    pub fn migration_done(&mut self, id: RequestId, to: Option<InstanceId>) {
        // A request can finish on its source while its move is still being settled: it stays
        // finished (else it would count as in flight forever and be re-placed if its worker died).
        if let Some(o) = self.requests.get_mut(&id).filter(|o| o.phase != OwnedPhase::Finished) {
            o.phase = OwnedPhase::Answering;
            o.migrating_to = None;
            if let Some(to) = to {
                o.instance = to;
                o.migrations += 1;
            }
        }
    }

    /// Returns false if the request was unknown or already finished (a duplicate report).
    pub fn on_finished(&mut self, id: RequestId) -> bool {
        match self.requests.get_mut(&id) {
            Some(o) if o.phase != OwnedPhase::Finished => {
                o.phase = OwnedPhase::Finished;
                true
            }
            _ => false,
        }
    }

    /// Restore ownership records read from the store (a new leader resuming).
    pub fn restore(&mut self, records: impl IntoIterator<Item = Ownership>) {
        for o in records {
            self.requests.insert(o.spec.id, o);
        }
    }

    pub fn in_flight(&self) -> usize {
        self.requests.values().filter(|o| o.phase != OwnedPhase::Finished).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::policy::registry::{build_policy, PolicyParams};
    use kvfleet_core::SimTime;

    fn state(policy: &str) -> ClusterState {
        let model = ClusterModel { model: "r1-distill-qwen-32b".into(), kv_bytes_per_token: 262_144 };
        ClusterState::new(model, build_policy(policy, &PolicyParams::default()).unwrap(), 1)
    }

    fn spec(id: u64) -> RequestSpec {
        RequestSpec { id: RequestId(id), arrival: SimTime(0), prompt_tokens: 10, reasoning_tokens: 5, answer_tokens: 5 }
    }

    fn load(i: u32, used: u32, reasoning: u32) -> LoadReport {
        LoadReport {
            instance: InstanceId(i),
            gpu_used_blocks: used,
            gpu_total_blocks: 100,
            block_bytes: 1,
            reasoning_requests: reasoning,
            answering_slo_ok: true,
            ..LoadReport::default()
        }
    }

    #[test]
    fn ownership_records_of_earlier_versions_still_load() {
        // Written before `migrating_to` existed.
        let old = r#"{"spec":{"id":3,"arrival":0,"prompt_tokens":1,"reasoning_tokens":1,"answer_tokens":1},
                     "instance":2,"phase":"Migrating","replaced":0,"migrations":1}"#;
        let o: Ownership = serde_json::from_str(old).unwrap();
        assert_eq!((o.instance, o.phase, o.migrating_to), (InstanceId(2), OwnedPhase::Migrating, None));
        let moving = Ownership { migrating_to: Some(InstanceId(5)), ..o };
        let back: Ownership = serde_json::from_slice(&serde_json::to_vec(&moving).unwrap()).unwrap();
        assert_eq!(back, moving);
    }

    #[test]
    fn model_mismatch_is_refused_with_both_names() {
        let mut s = state("pascal");
        let e = s.join(InstanceId(0), "a".into(), "llama-3-8b", 131_072).unwrap_err().to_string();
        assert!(e.contains("llama-3-8b") && e.contains("r1-distill-qwen-32b"), "{e}");
        assert!(s.loads().is_empty());
    }

    #[test]
    fn placement_follows_the_policy_and_skips_dead_workers() {
        let mut s = state("pascal");
        for i in 0..3 {
            s.join(InstanceId(i), format!("w{i}"), "r1-distill-qwen-32b", 262_144).unwrap();
        }
        s.on_load(load(0, 50, 3));
        s.on_load(load(1, 10, 1));
        s.on_load(load(2, 5, 0));
        assert_eq!(s.place(&spec(1)).unwrap(), InstanceId(2), "Alg. 1: least KV footprint");
        let charged = &s.members()[&InstanceId(2)].load;
        assert_eq!(
            (charged.gpu_used_blocks, charged.waiting_requests, charged.reasoning_requests),
            (16, 1, 1),
            "placement is charged at once"
        );
        assert_eq!(s.place(&spec(1)), Err(StateError::Duplicate(RequestId(1))));
        let orphans = s.leave(InstanceId(2));
        assert_eq!(orphans, vec![RequestId(1)]);
        assert_eq!(s.replace(RequestId(1)).unwrap(), InstanceId(1), "re-placed on a live worker");
        assert_eq!(s.ownership(RequestId(1)).unwrap().replaced, 1);
    }

    #[test]
    fn boundary_migrates_to_fewest_reasoning_and_finish_is_once() {
        let mut s = state("pascal");
        for i in 0..2 {
            s.join(InstanceId(i), format!("w{i}"), "r1-distill-qwen-32b", 262_144).unwrap();
        }
        s.on_load(load(0, 10, 4));
        s.on_load(load(1, 10, 0));
        let at = s.place(&spec(7)).unwrap();
        assert_eq!(at, InstanceId(0), "equal footprints: lowest id");
        assert_eq!(s.on_boundary(RequestId(7), at, 1), PhaseDecision::Migrate { to: InstanceId(1) });
        assert_eq!(s.ownership(RequestId(7)).unwrap().phase, OwnedPhase::Migrating);
        assert_eq!(s.ownership(RequestId(7)).unwrap().migrating_to, Some(InstanceId(1)), "where to, for a successor");
        let (src, dst) = (&s.members()[&InstanceId(0)].load, &s.members()[&InstanceId(1)].load);
        assert_eq!((src.gpu_used_blocks, dst.gpu_used_blocks), (10 + 11 - 1, 10 + 1), "the move is charged at once");
        s.migration_done(RequestId(7), Some(InstanceId(1)));
        assert_eq!(s.ownership(RequestId(7)).unwrap().instance, InstanceId(1));
        assert!(s.on_finished(RequestId(7)));
        assert!(!s.on_finished(RequestId(7)), "a duplicate finish report is ignored");
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_request_that_finishes_during_its_move_stays_finished() {
        let mut s = state("pascal");
        for i in 0..2 {
            s.join(InstanceId(i), format!("w{i}"), "r1-distill-qwen-32b", 262_144).unwrap();
        }
        s.on_load(load(0, 10, 4));
        s.on_load(load(1, 10, 0));
        let at = s.place(&spec(8)).unwrap();
        assert_eq!(s.on_boundary(RequestId(8), at, 1), PhaseDecision::Migrate { to: InstanceId(1) });
        // The answer ends on the source before the move is settled (then aborted or refused).
        assert!(s.on_finished(RequestId(8)));
        s.migration_done(RequestId(8), None);
        assert_eq!(s.ownership(RequestId(8)).unwrap().phase, OwnedPhase::Finished);
        assert_eq!(s.in_flight(), 0);
        assert!(s.leave(at).is_empty(), "a finished request is not re-placed when its worker dies");
    }

    #[test]
    fn a_declined_move_goes_to_the_next_choice_then_stays() {
        let mut s = state("pascal");
        for i in 0..3 {
            s.join(InstanceId(i), format!("w{i}"), "r1-distill-qwen-32b", 262_144).unwrap();
        }
        s.on_load(load(0, 10, 4));
        s.on_load(load(1, 10, 0));
        s.on_load(load(2, 10, 1));
        let at = s.place(&spec(7)).unwrap();
        assert_eq!(at, InstanceId(0));
        assert_eq!(s.on_boundary(RequestId(7), at, 1), PhaseDecision::Migrate { to: InstanceId(1) });
        s.migration_done(RequestId(7), None);
        // Instance 1 had no room after all: the next fewest-reasoning instance, charged at once.
        let before = s.members()[&InstanceId(2)].load.gpu_used_blocks;
        assert_eq!(s.retarget(RequestId(7), at, 1, &[InstanceId(1)]), Some(InstanceId(2)));
        assert_eq!(s.ownership(RequestId(7)).unwrap().phase, OwnedPhase::Migrating);
        assert_eq!(s.ownership(RequestId(7)).unwrap().migrating_to, Some(InstanceId(2)));
        s.migration_done(RequestId(7), Some(InstanceId(2)));
        assert_eq!(s.ownership(RequestId(7)).unwrap().migrating_to, None, "settled");
        assert_eq!(s.members()[&InstanceId(2)].load.gpu_used_blocks, before + 1);
        s.migration_done(RequestId(7), None);
        // Both declined: only its own instance is left, so it stays.
        assert_eq!(s.retarget(RequestId(7), at, 1, &[InstanceId(1), InstanceId(2)]), None);
        assert_eq!(s.retarget(RequestId(99), at, 1, &[]), None, "unknown request");
    }

    #[test]
    fn no_workers_is_an_error_not_a_panic() {
        let mut s = state("least-kv");
        assert_eq!(s.place(&spec(1)), Err(StateError::NoWorkers(RequestId(1))));
    }
}
