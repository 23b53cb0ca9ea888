//! Test driver for both machines: a model source KV whose bytes are a deterministic function of
//! (request, token), a model target arena, and a network of FIFO queues (one control stream per
//! direction, several data streams source → target) whose heads are delivered in any order.

use super::wire::Frame;
use super::*;
use std::collections::{BTreeMap, VecDeque};

/// The request being migrated.
pub(super) const REQUEST: u64 = 7;

/// KV bytes of `token` of `request`: a pure function, so the target's copy can be checked.
pub(super) fn token_bytes(request: u64, token: u32, bytes_per_token: usize) -> Vec<u8> {
    let mut key = [0u8; 12];
    key[..8].copy_from_slice(&request.to_le_bytes());
    key[8..].copy_from_slice(&token.to_le_bytes());
    let seed = checksum(&key);
    (0..bytes_per_token).map(|j| (seed.rotate_left(j as u32 % 64) as u8) ^ (j as u8)).collect()
}

/// A `BlockData` frame as a receiver that keeps payloads apart may see it: for odd `pick`, the
/// data taken out and cut in two at a `pick`-chosen point; otherwise the frame as it is.
fn split_block(mut f: Frame, pick: usize) -> (Frame, Option<crate::Payload>) {
    use super::wire::frame::Body;
    match &mut f.body {
        Some(Body::BlockData(b)) if pick % 2 == 1 => {
            let data = std::mem::take(&mut b.data);
            let cut = (pick / 2) % (data.len() + 1);
            (f, Some([data.slice(..cut), data.slice(cut..)].into_iter().collect()))
        }
        _ => (f, None),
    }
}

/// Serialized request state at a given KV length (what `on_paused` hands over).
pub(super) fn request_state(kv_tokens: u32) -> Bytes {
    Bytes::from(format!("state of request {REQUEST} at {kv_tokens} tokens"))
}

#[derive(Clone, Debug)]
pub(super) struct Config {
    pub params: MigrationParams,
    pub bytes_per_token: usize,
    pub streams: usize,
    pub initial_kv: u32,
    /// Tokens the request decodes while each live stage is copied (deterministic schedules).
    pub decode_per_copy: u32,
    /// The target leaves checksums to its writer ([`TargetMachine::verify_on_write`]), which
    /// this world's writer checks as a worker's does.
    pub verify_on_write: bool,
}

impl Config {
    /// 4 tokens per block, 64 bytes per token (256-byte blocks), 10 s deadline.
    pub fn small(initial_kv: u32, streams: usize) -> Config {
        let mut params = MigrationParams::new(4, 4 * 64);
        params.stop_copy_blocks = 4;
        Config {
            params,
            bytes_per_token: 64,
            streams: streams.max(1),
            initial_kv,
            decode_per_copy: 0,
            verify_on_write: false,
        }
    }
}

/// One thing that can happen next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ev {
    /// Deliver the head of the source → target control stream.
    ToTarget,
    /// Deliver the head of the target → source control stream.
    ToSource,
    /// Deliver the head of data stream k.
    Data(usize),
    /// The request decodes one more token (only while not frozen).
    Decode,
    /// The source driver finishes writing the pending `CopyBlocks`.
    BlocksSent,
    /// The source driver freezes the request after `Pause`.
    Freeze,
    /// The target driver answers `Reserve`.
    ReserveDone,
    /// The target driver finishes one pending write (which one: chosen separately).
    WriteDone,
    /// The target driver answers `Attach`.
    AttachDone,
    /// A prefill followed in layer groups ([`World::layers`]) goes one layer group further: an
    /// iteration starts (its first group computed), or computes its next group, or ends.
    Layer,
}

/// The target arena for one migration: logical index → (valid tokens, data).
pub(super) type Blocks = BTreeMap<u32, (u32, Bytes)>;

/// The whole system under test.
pub(super) struct World {
    pub now: Timestamp,
    pub cfg: Config,
    pub src: SourceMachine,
    pub tgt: Option<TargetMachine>,
    /// The source's KV length (the request decodes until frozen).
    pub kv_tokens: u32,
    pub pause_asked: bool,
    pub frozen: bool,
    pub connected: bool,
    pub to_target: VecDeque<Frame>,
    pub to_source: VecDeque<Frame>,
    pub data: Vec<VecDeque<Frame>>,
    next_stream: usize,
    pub blocks_sent_pending: Option<u32>,
    pub reserve_pending: bool,
    pub writes_pending: Vec<(u32, u32, u64, crate::Payload, Option<u64>)>,
    pub attach_pending: Option<(Bytes, u32, u32)>,
    /// The target's arena for this migration: index → (valid tokens, data).
    pub target_blocks: Blocks,
    /// What `Attach` attached: (state, kv tokens, blocks).
    pub attached: Option<(Bytes, u32, Blocks)>,
    pub reserves: u32,
    pub releases: u32,
    /// A reservation succeeded and was not released.
    pub holding_reservation: bool,
    pub src_done: Vec<Outcome>,
    pub tgt_done: Vec<Outcome>,
    /// Every control frame each side sent, in order.
    pub src_sent: Vec<Frame>,
    pub tgt_sent: Vec<Frame>,
    /// Answers the model drivers give next.
    pub reserve_result: Result<(), AbortReason>,
    pub attach_result: Result<(), AbortReason>,
    pub fail_next_write: Option<AbortReason>,
    /// Tokens decoded after `Pause` was asked and before the freeze (the iteration in flight).
    pub decode_while_pausing: u32,
    /// A prefill followed in layer groups: (tokens each iteration computes, layer groups). The
    /// request's KV then grows only by whole iterations ([`Ev::Layer`]), never by [`Ev::Decode`],
    /// and it freezes only between iterations.
    pub layers: Option<(u32, u32)>,
    /// The iteration in flight: the KV it ends with, and the layer groups it has computed.
    pub in_flight: Option<(u32, u32)>,
}

impl World {
    pub fn new(cfg: Config) -> World {
        let src =
            SourceMachine::new(MigrationId(1), RequestId(REQUEST), cfg.params.clone(), Timestamp(0), cfg.initial_kv)
                .expect("valid params")
                .with_model("test-model")
                .with_source_instance(3);
        World {
            now: Timestamp(0),
            src,
            tgt: None,
            kv_tokens: cfg.initial_kv,
            pause_asked: false,
            frozen: false,
            connected: true,
            to_target: VecDeque::new(),
            to_source: VecDeque::new(),
            data: vec![VecDeque::new(); cfg.streams],
            next_stream: 0,
            blocks_sent_pending: None,
            reserve_pending: false,
            writes_pending: Vec::new(),
            attach_pending: None,
            target_blocks: BTreeMap::new(),
            attached: None,
            reserves: 0,
            releases: 0,
            holding_reservation: false,
            src_done: Vec::new(),
            tgt_done: Vec::new(),
            src_sent: Vec::new(),
            tgt_sent: Vec::new(),
            reserve_result: Ok(()),
            attach_result: Ok(()),
            fail_next_write: None,
            decode_while_pausing: 0,
            layers: None,
            in_flight: None,
            cfg,
        }
    }

    /// `start` the source and process what follows.
    pub fn start(&mut self) {
        self.src.start(self.now);
        self.pump();
    }

    fn block_size(&self) -> u32 {
        self.cfg.params.block_size
    }

    /// Logical block `index` as the source holds it now: valid tokens, then 0xEE padding.
    fn read_block(&self, index: u32, tokens: u32) -> Bytes {
        let mut data = Vec::with_capacity(self.cfg.params.block_bytes as usize);
        let first = index * self.block_size();
        for t in first..first + tokens {
            data.extend(token_bytes(REQUEST, t, self.cfg.bytes_per_token));
        }
        data.resize(self.cfg.params.block_bytes as usize, 0xEE);
        Bytes::from(data)
    }

    /// Executes every queued action of both machines.
    pub fn pump(&mut self) {
        loop {
            if let Some(a) = self.src.poll_action() {
                assert!(self.src_done.is_empty(), "source action {a:?} after Done");
                self.source_action(a);
                continue;
            }
            if let Some(a) = self.tgt.as_mut().and_then(|t| t.poll_action()) {
                assert!(self.tgt_done.is_empty(), "target action {a:?} after Done");
                self.target_action(a);
                continue;
            }
            break;
        }
    }

    fn source_action(&mut self, a: SourceAction) {
        match a {
            SourceAction::Send(f) => {
                self.src_sent.push(f.clone());
                if self.connected {
                    self.to_target.push_back(f);
                }
            }
            SourceAction::CopyBlocks { stage, blocks, slices, kv_tokens, final_stage } => {
                assert!(!blocks.is_empty() || slices.is_some(), "empty CopyBlocks");
                assert!(self.blocks_sent_pending.is_none(), "CopyBlocks while another is pending");
                assert_eq!(final_stage, self.frozen, "final stage iff frozen");
                let bs = self.block_size();
                for index in slices.iter().flat_map(|s| s.blocks.clone()) {
                    let groups = slices.as_ref().expect("iterated").groups.clone();
                    let (_, g) = self.layers.expect("slices only for a prefill followed in layer groups");
                    assert!(groups.start < groups.end && groups.end <= g, "layer groups {groups:?} of {g}");
                    // Only what is computed: a full block, or groups the iteration in flight did.
                    let computed = match self.in_flight {
                        _ if (index + 1) * bs <= self.kv_tokens => true,
                        Some((tokens, done)) => (index + 1) * bs <= tokens && groups.end <= done,
                        None => false,
                    };
                    assert!(computed, "block {index} groups {groups:?} sent before they were computed");
                    let bytes = slice_bytes(self.cfg.params.block_bytes, g, groups.clone());
                    let data = self.read_block(index, bs).slice(bytes.start as usize..bytes.end as usize);
                    let head = slice_frame_head(self.src.id(), stage, index, bs, groups, &data);
                    let f = Frame { body: Some(wire::frame::Body::BlockData(wire::BlockData { data, ..head })) };
                    if self.connected {
                        let k = self.next_stream % self.data.len();
                        self.next_stream += 1;
                        self.data[k].push_back(f);
                    }
                }
                for index in blocks {
                    // What the driver really holds now: a live stage must only ask for full blocks.
                    let tokens = block_tokens(index, self.kv_tokens, self.block_size());
                    assert_eq!(tokens, block_tokens(index, kv_tokens, self.block_size()), "block {index}");
                    if !final_stage {
                        assert_eq!(tokens, self.block_size(), "live stage sent partial block {index}");
                    }
                    let f = block_frame(self.src.id(), stage, index, tokens, self.read_block(index, tokens));
                    if self.connected {
                        let k = self.next_stream % self.data.len();
                        self.next_stream += 1;
                        self.data[k].push_back(f);
                    }
                }
                self.blocks_sent_pending = Some(stage);
                if !final_stage && self.cfg.decode_per_copy > 0 {
                    self.kv_tokens += self.cfg.decode_per_copy;
                    self.src.on_kv_progress(self.now, self.kv_tokens);
                }
            }
            SourceAction::Pause => {
                assert!(!self.pause_asked, "Pause twice");
                self.pause_asked = true;
                if self.decode_while_pausing > 0 {
                    self.kv_tokens += self.decode_while_pausing;
                    self.src.on_kv_progress(self.now, self.kv_tokens);
                }
            }
            SourceAction::Done(o) => self.src_done.push(o),
        }
    }

    fn target_action(&mut self, a: TargetAction) {
        match a {
            TargetAction::Send(f) => {
                self.tgt_sent.push(f.clone());
                if self.connected {
                    self.to_source.push_back(f);
                }
            }
            TargetAction::Reserve { request, blocks, kv_tokens, model, .. } => {
                assert_eq!(request, RequestId(REQUEST));
                assert_eq!(model, "test-model");
                assert_eq!(blocks, blocks_for_tokens(kv_tokens, self.block_size()));
                self.reserves += 1;
                self.reserve_pending = true;
            }
            TargetAction::WriteBlock { index, tokens, offset, data, checksum } => {
                assert_eq!(checksum.is_some(), self.cfg.verify_on_write, "who verifies");
                self.writes_pending.push((index, tokens, offset, data, checksum))
            }
            TargetAction::Attach { state, kv_tokens, blocks } => {
                // The machine attaches only once every block 0..blocks is written, and no more.
                assert!(self.writes_pending.is_empty(), "Attach with writes pending");
                let have: Vec<u32> = self.target_blocks.keys().copied().collect();
                assert_eq!(have, (0..blocks).collect::<Vec<_>>(), "Attach without exactly blocks 0..{blocks}");
                self.attach_pending = Some((state, kv_tokens, blocks));
            }
            TargetAction::Release => {
                self.releases += 1;
                assert_eq!(self.releases, 1, "Release twice");
                self.reserve_pending = false;
                self.holding_reservation = false;
                self.writes_pending.clear();
                self.target_blocks.clear();
            }
            TargetAction::Done(o) => self.tgt_done.push(o),
        }
    }

    fn deliver_to_target(&mut self, f: Frame) {
        match self.tgt.as_mut() {
            Some(t) => t.on_frame(self.now, f),
            None => match TargetMachine::accept(self.now, &self.cfg.params, f) {
                Ok(t) if self.cfg.verify_on_write => self.tgt = Some(t.verify_on_write()),
                Ok(t) => self.tgt = Some(t),
                Err(reply) => self.to_source.push_back(*reply),
            },
        }
    }

    /// Events that can happen now.
    pub fn enabled(&self) -> Vec<Ev> {
        let mut evs = Vec::new();
        if !self.to_target.is_empty() {
            evs.push(Ev::ToTarget);
        }
        if !self.to_source.is_empty() {
            evs.push(Ev::ToSource);
        }
        for (k, q) in self.data.iter().enumerate() {
            if !q.is_empty() {
                evs.push(Ev::Data(k));
            }
        }
        if self.blocks_sent_pending.is_some() {
            evs.push(Ev::BlocksSent);
        }
        if self.pause_asked && !self.frozen && !self.src.is_done() {
            evs.push(Ev::Freeze);
        }
        if self.reserve_pending {
            evs.push(Ev::ReserveDone);
        }
        if !self.writes_pending.is_empty() {
            evs.push(Ev::WriteDone);
        }
        if self.attach_pending.is_some() {
            evs.push(Ev::AttachDone);
        }
        if !self.frozen && !self.src.is_done() {
            evs.push(if self.layers.is_some() { Ev::Layer } else { Ev::Decode });
        }
        if self.in_flight.is_some() {
            // The pause waits for the iteration's end.
            evs.retain(|e| *e != Ev::Freeze);
        }
        evs
    }

    /// Applies `ev`; `pick` chooses which pending write completes for [`Ev::WriteDone`], and
    /// whether (and where) a data frame's block arrives apart from it in two buffers.
    pub fn apply(&mut self, ev: Ev, pick: usize) {
        self.now += TimeSpan::from_nanos(1_000);
        let now = self.now;
        match ev {
            Ev::ToTarget => {
                if let Some(f) = self.to_target.pop_front() {
                    self.deliver_to_target(f);
                }
            }
            Ev::ToSource => {
                if let Some(f) = self.to_source.pop_front() {
                    self.src.on_frame(now, f);
                }
            }
            Ev::Data(k) => {
                if let Some(f) = self.data.get_mut(k).and_then(|q| q.pop_front()) {
                    match (split_block(f, pick), self.tgt.as_mut()) {
                        ((f, payload @ Some(_)), Some(t)) => t.on_frame_with_payload(now, f, payload),
                        ((f, None), _) => self.deliver_to_target(f),
                        ((_, Some(_)), None) => unreachable!("data frames follow the target's acceptance"),
                    }
                }
            }
            Ev::Decode => {
                self.kv_tokens += 1;
                self.src.on_kv_progress(self.now, self.kv_tokens);
            }
            Ev::Layer => {
                let (chunk, g) = self.layers.expect("enabled only with layers");
                match self.in_flight {
                    Some((tokens, done)) if done >= g => {
                        self.in_flight = None;
                        self.kv_tokens = tokens;
                        self.src.on_kv_progress(now, tokens);
                    }
                    Some((tokens, done)) => self.in_flight = Some((tokens, done + 1)),
                    None => self.in_flight = Some((self.kv_tokens + chunk, 1)),
                }
                if let Some((tokens, done)) = self.in_flight {
                    self.src.on_layer_progress(now, tokens, done);
                }
            }
            Ev::BlocksSent => {
                if let Some(stage) = self.blocks_sent_pending.take() {
                    self.src.on_blocks_sent(now, stage);
                }
            }
            Ev::Freeze => {
                self.frozen = true;
                self.src.on_paused(now, self.kv_tokens, request_state(self.kv_tokens));
            }
            Ev::ReserveDone => {
                self.reserve_pending = false;
                let result = self.reserve_result.clone();
                self.holding_reservation = result.is_ok();
                if let Some(t) = self.tgt.as_mut() {
                    t.on_reserved(now, result);
                }
            }
            Ev::WriteDone => {
                if self.writes_pending.is_empty() {
                    return;
                }
                let (index, tokens, offset, data, checksum) =
                    self.writes_pending.remove(pick % self.writes_pending.len());
                let Some(t) = self.tgt.as_mut() else { return };
                let mut landed = vec![0u8; data.len()];
                let sum = data.copy_checksummed(&mut landed);
                match self.fail_next_write.take() {
                    Some(reason) => t.on_write_failed(now, reason),
                    None if checksum.is_some_and(|c| c != sum) => {
                        t.on_write_failed(now, AbortReason::ChecksumMismatch { block: index })
                    }
                    None => {
                        let size = self.cfg.params.block_bytes as usize;
                        let entry = self.target_blocks.entry(index).or_insert((tokens, vec![0u8; size].into()));
                        let mut whole = entry.1.to_vec();
                        whole[offset as usize..offset as usize + landed.len()].copy_from_slice(&landed);
                        *entry = (tokens, whole.into());
                        t.on_written(now, index);
                    }
                }
            }
            Ev::AttachDone => {
                if let Some((state, kv, blocks)) = self.attach_pending.take() {
                    let result = self.attach_result.clone();
                    if result.is_ok() {
                        let snapshot = self.target_blocks.range(..blocks).map(|(&i, b)| (i, b.clone())).collect();
                        self.attached = Some((state, kv, snapshot));
                    }
                    if let Some(t) = self.tgt.as_mut() {
                        t.on_attached(now, result);
                    }
                }
            }
        }
        self.pump();
    }

    /// Breaks the connection: queued frames are lost, both machines hear of it.
    pub fn disconnect(&mut self) {
        self.connected = false;
        self.to_target.clear();
        self.to_source.clear();
        self.data.iter_mut().for_each(VecDeque::clear);
        self.now += TimeSpan::from_nanos(1_000);
        self.src.on_disconnect(self.now);
        if let Some(t) = self.tgt.as_mut() {
            t.on_disconnect(self.now);
        }
        self.pump();
    }

    /// Jumps to the earliest deadline of either machine and fires it; false if none is armed.
    pub fn fire_next_timeout(&mut self) -> bool {
        let deadline =
            [self.src.poll_timeout(), self.tgt.as_ref().and_then(|t| t.poll_timeout())].into_iter().flatten().min();
        let Some(deadline) = deadline else { return false };
        self.now = self.now.max(deadline);
        self.src.on_timeout(self.now);
        if let Some(t) = self.tgt.as_mut() {
            t.on_timeout(self.now);
        }
        self.pump();
        true
    }

    /// Runs in-order (the first enabled event, never decoding nor starting a prefill iteration)
    /// until `stop` holds or nothing is left; deadlines fire only when the system is otherwise
    /// stuck.
    pub fn run_until(&mut self, mut stop: impl FnMut(&World) -> bool) {
        for _ in 0..1_000_000 {
            if stop(self) {
                return;
            }
            // A prefill followed layer by layer only finishes the iteration in flight: it may
            // never be paused (a lost frame), and its deadline must then end it.
            let enabled = self.enabled();
            let layer = (self.in_flight.is_some() && enabled.contains(&Ev::Layer)).then_some(Ev::Layer);
            let ev = enabled.into_iter().find(|e| !matches!(e, Ev::Decode | Ev::Layer)).or(layer);
            match ev {
                Some(ev) => self.apply(ev, 0),
                None => {
                    if self.finished() || !self.fire_next_timeout() {
                        return;
                    }
                }
            }
        }
        panic!("run_until: no progress after 1e6 events");
    }

    /// Runs to the end (see [`World::run_until`]).
    pub fn drain(&mut self) {
        self.run_until(|_| false);
    }

    /// Both sides (the target only if it exists) have emitted `Done`.
    pub fn finished(&self) -> bool {
        !self.src_done.is_empty() && (self.tgt.is_none() || !self.tgt_done.is_empty())
    }

    pub fn src_outcome(&self) -> Option<&Outcome> {
        self.src_done.first()
    }
    pub fn tgt_outcome(&self) -> Option<&Outcome> {
        self.tgt_done.first()
    }

    /// The target's attached KV equals the source's, byte for byte, for every token, and the
    /// request state came along.
    pub fn check_target_kv_equals_source(&self) {
        let (state, kv, blocks) = self.attached.as_ref().expect("target attached the request");
        assert_eq!(*kv, self.kv_tokens, "target KV length");
        assert_eq!(*state, request_state(self.kv_tokens), "request state");
        let bs = self.block_size();
        let bpt = self.cfg.bytes_per_token;
        assert_eq!(blocks.len() as u32, blocks_for_tokens(*kv, bs));
        for (&index, (tokens, data)) in blocks {
            assert_eq!(*tokens, block_tokens(index, *kv, bs), "tokens of block {index}");
            assert_eq!(data.len() as u64, self.cfg.params.block_bytes);
        }
        for t in 0..*kv {
            let (_, data) = &blocks[&(t / bs)];
            let off = (t % bs) as usize * bpt;
            assert_eq!(&data[off..off + bpt], &token_bytes(REQUEST, t, bpt)[..], "token {t}");
        }
    }

    /// The invariants every run must satisfy once finished: one `Done` each, and the request in
    /// exactly one place (or, for `Unknown`, held paused on the source for the coordinator).
    pub fn check_safety(&self) {
        assert_eq!(self.src_done.len(), 1, "source Done count: {:?}", self.src_done);
        if self.tgt.is_some() {
            assert_eq!(self.tgt_done.len(), 1, "target Done count: {:?}", self.tgt_done);
        }
        assert!(self.src.poll_timeout().is_none());
        let src = self.src_outcome().cloned();
        let tgt = self.tgt_outcome().cloned();
        match &src {
            Some(Outcome::Committed) => {
                assert_eq!(tgt, Some(Outcome::Committed), "source freed its copy but the target has none");
                self.check_target_kv_equals_source();
            }
            Some(Outcome::Aborted(_)) => {
                assert_ne!(tgt, Some(Outcome::Committed), "request duplicated: target committed, source resumed");
            }
            Some(Outcome::Unknown(_)) => {
                assert!(self.src.report().commit_sent_at.is_some(), "Unknown before Commit was sent");
            }
            None => unreachable!(),
        }
        match &tgt {
            Some(Outcome::Committed) => {
                assert!(matches!(src, Some(Outcome::Committed | Outcome::Unknown(_))));
                self.check_target_kv_equals_source();
            }
            Some(Outcome::Aborted(_)) => {
                assert!(!self.holding_reservation, "reservation leaked");
                assert!(self.target_blocks.is_empty() && self.attached.is_none());
            }
            Some(Outcome::Unknown(_)) => panic!("the target is never in doubt"),
            None => {}
        }
    }
}
