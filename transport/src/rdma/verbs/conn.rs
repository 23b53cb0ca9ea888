//! One connection's verbs objects ([`Conn`]), the fabric that posts the engine's work requests
//! ([`VerbsFabric`]), the connection's I/O thread, and connecting (see the parent module's rules).

use super::*;
use crate::rdma::engine::{Engine, EngineConfig, Fabric};
use crate::rdma::wire::{Hello, HELLO_BYTES};
use crate::rdma::{RdmaConfig, Shared};
use std::os::raw::c_void;
use tracing::debug;

/// One connection's rdma_cm id and verbs objects, destroyed in reverse order on drop.
pub(super) struct Conn {
    pub(super) channel: *mut rdma_event_channel,
    pub(super) id: *mut rdma_cm_id,
    pub(super) pd: *mut ibv_pd,
    pub(super) comp: *mut ibv_comp_channel,
    pub(super) cq: *mut ibv_cq,
    pub(super) qp: *mut ibv_qp,
    pub(super) rx_mr: *mut ibv_mr,
    pub(super) tx_mr: *mut ibv_mr,
    pub(super) rx: Option<Arc<Region>>,
    pub(super) tx: Option<Arc<Region>>,
    pub(super) connected: bool,
    pub(super) wake: Arc<OwnedFd>,
}

// SAFETY: the verbs objects are used by one thread at a time: the creating thread, then the
// connection's I/O thread it moves to (the queue pair also by the engine's fabric, under the
// rules in the module docs).
unsafe impl Send for Conn {}

impl Conn {
    /// A fresh channel and either a fresh active id on it (`id` null) or the accepted `id`
    /// moved onto it. On failure an accepted `id` is left to the caller (to reject).
    pub(super) fn new(id: *mut rdma_cm_id) -> Result<Conn, String> {
        let wake = eventfd()?;
        // SAFETY: plain constructor; null on failure.
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(errno("rdma_create_event_channel (opening /dev/infiniband/rdma_cm)"));
        }
        let mut conn = Conn {
            channel,
            id: ptr::null_mut(),
            pd: ptr::null_mut(),
            comp: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            rx_mr: ptr::null_mut(),
            tx_mr: ptr::null_mut(),
            rx: None,
            tx: None,
            connected: false,
            wake,
        };
        // SAFETY: a live channel.
        set_nonblocking(unsafe { (*channel).fd })?;
        if id.is_null() {
            // SAFETY: a live channel; the id is destroyed in Drop.
            if unsafe { rdma_create_id(channel, &mut conn.id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) } != 0 {
                conn.id = ptr::null_mut();
                return Err(errno("rdma_create_id"));
            }
        } else {
            // Events of an accepted id go to its own channel from now on (it was acknowledged).
            // SAFETY: a live id whose events were all acknowledged; a live channel.
            if unsafe { rdma_migrate_id(id, channel) } != 0 {
                return Err(errno("rdma_migrate_id"));
            }
            conn.id = id;
        }
        Ok(conn)
    }

    /// Protection domain, completion channel and queue, the RC queue pair, the receive ring
    /// (REMOTE_WRITE) and its posted receives.
    pub(super) fn setup(&mut self, cfg: &RdmaConfig) -> Result<(), String> {
        let sq = cfg.send_queue_depth;
        let rq = 2 * sq;
        // SAFETY: a live id, resolved or accepted, so `verbs` is its device context. Each object is
        // checked for null and owned by `self` (destroyed in Drop).
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() {
                return Err("the address did not resolve to an RDMA device".into());
            }
            self.pd = ibv_alloc_pd(verbs);
            if self.pd.is_null() {
                return Err(errno("ibv_alloc_pd"));
            }
            self.comp = ibv_create_comp_channel(verbs);
            if self.comp.is_null() {
                return Err(errno("ibv_create_comp_channel"));
            }
            set_nonblocking((*self.comp).fd)?;
            self.cq = ibv_create_cq(verbs, (sq + rq) as c_int, ptr::null_mut(), self.comp, 0);
            if self.cq.is_null() {
                return Err(errno(&format!("ibv_create_cq with {} entries", sq + rq)));
            }
            if ibv_req_notify_cq(self.cq, 0) != 0 {
                return Err(errno("ibv_req_notify_cq"));
            }
            let mut attr: ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = self.cq;
            attr.recv_cq = self.cq;
            attr.cap =
                ibv_qp_cap { max_send_wr: sq, max_recv_wr: rq, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.sq_sig_all = 1;
            if rdma_create_qp(self.id, self.pd, &mut attr) != 0 {
                return Err(errno(&format!("rdma_create_qp (RC, {sq} send / {rq} receive work requests)")));
            }
            self.qp = (*self.id).qp;
            let rx = Arc::new(Region::new(cfg.ring_bytes)?);
            let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE).0;
            self.rx_mr = ibv_reg_mr(self.pd, rx.addr() as *mut c_void, rx.len(), access as c_int);
            self.rx = Some(rx);
            if self.rx_mr.is_null() {
                return Err(errno(&format!(
                    "registering the {}-byte receive ring (ibv_reg_mr; check `ulimit -l`)",
                    cfg.ring_bytes
                )));
            }
            for _ in 0..rq {
                post_recv(self.qp)?;
            }
        }
        Ok(())
    }

    /// The staging region that mirrors the peer's ring (local access only).
    pub(super) fn register_tx(&mut self, bytes: usize) -> Result<(), String> {
        let tx = Arc::new(Region::new(bytes)?);
        // SAFETY: a live PD; the region outlives the MR (held by `self` until after dereg).
        self.tx_mr = unsafe {
            ibv_reg_mr(self.pd, tx.addr() as *mut c_void, tx.len(), ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as c_int)
        };
        self.tx = Some(tx);
        if self.tx_mr.is_null() {
            return Err(errno(&format!("registering the {bytes}-byte send staging region (ibv_reg_mr)")));
        }
        Ok(())
    }

    pub(super) fn hello(&self) -> Hello {
        let rx = self.rx.as_ref().expect("setup registered the ring");
        // SAFETY: a live MR.
        let rkey = unsafe { (*self.rx_mr).rkey };
        Hello { ring_addr: rx.addr(), ring_rkey: rkey, ring_bytes: rx.len() as u32 }
    }

    /// The engine over this connection, its fabric posting to `peer`'s ring.
    pub(super) fn engine(&self, initiator: bool, cfg: &RdmaConfig, peer: Hello) -> Engine {
        let tx = self.tx.clone().expect("register_tx ran");
        let fabric = VerbsFabric {
            qp: self.qp,
            tx_addr: tx.addr(),
            // SAFETY: a live MR.
            tx_lkey: unsafe { (*self.tx_mr).lkey },
            remote_addr: peer.ring_addr,
            remote_rkey: peer.ring_rkey,
            wake: self.wake.clone(),
        };
        let ecfg = EngineConfig {
            max_payload: EngineConfig::clamp_payload(cfg.max_write_bytes, peer.ring_bytes as usize),
            stream_window: cfg.stream_window_bytes,
            send_queue_depth: cfg.send_queue_depth,
        };
        Engine::new(initiator, ecfg, Box::new(fabric), tx, self.rx.clone().expect("setup ran"))
    }

    pub(super) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: a live, connected id.
        socket_addr_from(unsafe { rdma_get_peer_addr(&*self.id) })
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: reverse creation order; each object is live (non-null) and destroyed once; the
        // engine no longer posts (see the module docs); no completion events are unacknowledged
        // (each is acknowledged as it is taken).
        unsafe {
            if self.connected {
                rdma_disconnect(self.id);
            }
            if !self.qp.is_null() {
                rdma_destroy_qp(self.id);
            }
            if !self.cq.is_null() {
                ibv_destroy_cq(self.cq);
            }
            if !self.comp.is_null() {
                ibv_destroy_comp_channel(self.comp);
            }
            if !self.tx_mr.is_null() {
                ibv_dereg_mr(self.tx_mr);
            }
            if !self.rx_mr.is_null() {
                ibv_dereg_mr(self.rx_mr);
            }
            if !self.pd.is_null() {
                ibv_dealloc_pd(self.pd);
            }
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
            rdma_destroy_event_channel(self.channel);
        }
    }
}

/// Post one receive without buffers: RDMA WRITE WITH IMMEDIATE consumes a receive but places its
/// data by address, so the receive only carries the immediate.
///
/// # Safety
/// `qp` is a live queue pair.
unsafe fn post_recv(qp: *mut ibv_qp) -> Result<(), String> {
    let mut wr = ibv_recv_wr { wr_id: WR_RECV, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 };
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: a live QP (the caller's contract); the work request is copied by the provider.
    let rc = unsafe { ibv_post_recv(qp, &mut wr, &mut bad) };
    if rc != 0 {
        return Err(format!("ibv_post_recv: {}", io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

/// Posts the engine's work requests on the queue pair.
struct VerbsFabric {
    qp: *mut ibv_qp,
    tx_addr: u64,
    tx_lkey: u32,
    remote_addr: u64,
    remote_rkey: u32,
    wake: Arc<OwnedFd>,
}

// SAFETY: libibverbs allows posting from any thread; the queue pair outlives the fabric (module
// docs: the I/O thread destroys it only after the engine dropped the fabric).
unsafe impl Send for VerbsFabric {}

impl VerbsFabric {
    fn post(&mut self, opcode: ibv_wr_opcode::Type, offset: usize, len: usize, imm: Option<u32>) -> Result<(), String> {
        let mut sge = ibv_sge { addr: self.tx_addr + offset as u64, length: len as u32, lkey: self.tx_lkey };
        // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero fields); the fields used
        // are set below; the provider copies the request before ibv_post_send returns. The QP is
        // live (see the Send impl).
        unsafe {
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.wr_id = WR_SEND;
            wr.opcode = opcode;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            if len > 0 {
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
            }
            if let Some(imm) = imm {
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            wr.wr.rdma = rdma_t { remote_addr: self.remote_addr + offset as u64, rkey: self.remote_rkey };
            let mut bad: *mut ibv_send_wr = ptr::null_mut();
            let rc = ibv_post_send(self.qp, &mut wr, &mut bad);
            if rc != 0 {
                return Err(format!("ibv_post_send: {}", io::Error::from_raw_os_error(rc)));
            }
        }
        Ok(())
    }
}

impl Fabric for VerbsFabric {
    fn write_imm(&mut self, offset: usize, len: usize, imm: u32) -> Result<(), String> {
        self.post(ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, offset, len, Some(imm))
    }

    fn probe(&mut self) -> Result<(), String> {
        self.post(ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0, 0, None)
    }

    fn shutdown(&mut self) {
        wake(&self.wake);
    }
}

// ---- The connection's I/O thread --------------------------------------------------------------

/// Take completions until the queue is empty, feeding them to the engine.
fn drain_cq(conn: &Conn, shared: &Shared, wcs: &mut [ibv_wc]) {
    loop {
        // SAFETY: a live CQ; `wcs` has room for `len` completions.
        let n = unsafe { ibv_poll_cq(conn.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            lock(&shared.engine).shut("connection lost: polling the completion queue failed".into());
            return;
        }
        if n == 0 {
            return;
        }
        let mut engine = lock(&shared.engine);
        for wc in &wcs[..n as usize] {
            if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                if wc.wr_id == WR_SEND {
                    engine.on_send_done();
                }
                // SAFETY: ibv_wc_status_str returns a static string for any value.
                let text = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }.to_string_lossy();
                engine.shut(format!(
                    "connection lost: work request failed: {text} (status {}, vendor error {:#x})",
                    wc.status, wc.vendor_err
                ));
                continue;
            }
            match wc.opcode {
                ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => {
                    // SAFETY: the completion of a receive with immediate carries `imm_data`.
                    let imm = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
                    if !engine.is_closed() {
                        // SAFETY: a live QP (destroyed only by this thread, later).
                        if let Err(e) = unsafe { post_recv(conn.qp) } {
                            engine.shut(format!("connection lost: re-posting a receive failed: {e}"));
                            continue;
                        }
                    }
                    engine.on_imm(imm);
                }
                ibv_wc_opcode::IBV_WC_RDMA_WRITE => engine.on_send_done(),
                _ => {}
            }
        }
    }
}

/// The connection's thread: completions, rdma_cm events and keep-alive probes until the engine is
/// shut, then a short drain of the last writes, then the teardown (`Conn`'s Drop).
pub(super) fn run_connection(conn: Conn, shared: Arc<Shared>, keepalive: Duration) {
    // SAFETY: live objects owned by `conn` for this whole function.
    let (comp_fd, cm_fd) = unsafe { ((*conn.comp).fd, (*conn.channel).fd) };
    let wake_fd = conn.wake.as_raw_fd();
    // SAFETY: all-zero is a valid ibv_wc (plain integers).
    let mut wcs: Vec<ibv_wc> = (0..32).map(|_| unsafe { std::mem::zeroed() }).collect();
    drain_cq(&conn, &shared, &mut wcs);
    loop {
        if lock(&shared.engine).is_closed() {
            break;
        }
        let ready = match poll_readable(&[comp_fd, cm_fd, wake_fd], Some(keepalive)) {
            Ok(r) => r,
            Err(e) => {
                lock(&shared.engine).shut(format!("connection lost: {e}"));
                break;
            }
        };
        if ready.iter().all(|r| !r) {
            lock(&shared.engine).probe();
            continue;
        }
        if ready[2] {
            drain_eventfd(&conn.wake);
        }
        if ready[1] {
            while let Ok(Some(ev)) = next_event(conn.channel, Some(Duration::ZERO)) {
                let reason = match ev.kind {
                    rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => "the peer disconnected",
                    rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => "the RDMA device was removed",
                    rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE => "the RDMA interface's address changed",
                    other => {
                        debug!(event = %event_name(other), "rdma_cm event ignored");
                        continue;
                    }
                };
                lock(&shared.engine).shut(format!("connection lost: {reason}"));
            }
        }
        if ready[0] {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut ctx: *mut c_void = ptr::null_mut();
            // SAFETY: a live, non-blocking completion channel; each event taken is acknowledged
            // at once, and notification is re-armed before the queue is drained (no lost wake-up).
            unsafe {
                if ibv_get_cq_event(conn.comp, &mut cq, &mut ctx) == 0 {
                    ibv_ack_cq_events(cq, 1);
                }
                ibv_req_notify_cq(conn.cq, 0);
            }
        }
        drain_cq(&conn, &shared, &mut wcs);
    }
    // The engine is shut: give its last writes (a `Close` record) a moment to leave.
    let deadline = Instant::now() + CLOSE_DRAIN;
    while lock(&shared.engine).sends_in_flight() > 0 && Instant::now() < deadline {
        drain_cq(&conn, &shared, &mut wcs);
        std::thread::sleep(Duration::from_millis(1));
    }
    debug!(peer = %shared.peer, "RDMA connection torn down");
    drop(conn);
}

fn spawn_connection(conn: Conn, shared: Arc<Shared>, keepalive: Duration) -> Result<(), String> {
    std::thread::Builder::new()
        .name("kvfleet-rdma-conn".into())
        .spawn(move || run_connection(conn, shared, keepalive))
        .map(|_| ())
        .map_err(|e| format!("spawning the connection thread: {e}"))
}

/// Refuse a peer ring far larger than ours: the listener is unauthenticated, and the staging
/// region mirroring the peer's ring is allocated and pinned here.
pub(super) fn check_peer_ring(peer: &Hello, cfg: &RdmaConfig) -> Result<(), String> {
    let limit = cfg.ring_bytes.saturating_mul(4);
    if peer.ring_bytes as usize > limit {
        return Err(format!(
            "the peer's ring of {} bytes exceeds 4 × this side's ring_bytes ({}): configure both sides alike",
            peer.ring_bytes, cfg.ring_bytes
        ));
    }
    Ok(())
}

pub(super) fn conn_param(hello: &[u8; HELLO_BYTES]) -> rdma_conn_param {
    rdma_conn_param {
        private_data: hello.as_ptr().cast(),
        private_data_len: HELLO_BYTES as u8,
        // No RDMA READ or atomics: no responder resources needed.
        responder_resources: 0,
        initiator_depth: 0,
        flow_control: 1,
        retry_count: RETRY_COUNT,
        rnr_retry_count: RNR_RETRY_INFINITE,
        srq: 0,
        qp_num: 0,
    }
}

// ---- Connecting -------------------------------------------------------------------------------

/// Connect to `peer` (blocking: run it on `spawn_blocking`), from `local_ip` when given so the
/// connection leaves through the listener's NIC.
pub(crate) fn connect(peer: SocketAddr, local_ip: Option<IpAddr>, cfg: &RdmaConfig) -> Result<Arc<Shared>, String> {
    let deadline = Instant::now() + cfg.connect_timeout;
    let timeout_ms = c_int::try_from(cfg.connect_timeout.as_millis()).unwrap_or(c_int::MAX);
    let mut conn = Conn::new(ptr::null_mut())?;
    set_tos(conn.id, cfg.tos)?;
    let mut dst = sockaddr_of(peer);
    let mut src = local_ip.filter(|ip| !ip.is_unspecified()).map(|ip| sockaddr_of(SocketAddr::new(ip, 0)));
    let src_ptr = src.as_mut().map_or(ptr::null_mut(), |s| ptr::from_mut(s).cast::<libc::sockaddr>());
    // SAFETY: a live id; the addresses are valid for the call.
    if unsafe { rdma_resolve_addr(conn.id, src_ptr, ptr::from_mut(&mut dst).cast(), timeout_ms) } != 0 {
        return Err(errno("rdma_resolve_addr"));
    }
    expect_event(conn.channel, rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "resolving the address")?;
    // SAFETY: a live id with a resolved address.
    if unsafe { rdma_resolve_route(conn.id, timeout_ms) } != 0 {
        return Err(errno("rdma_resolve_route"));
    }
    expect_event(conn.channel, rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "resolving the route")?;
    conn.setup(cfg)?;
    let hello = conn.hello().encode();
    let mut param = conn_param(&hello);
    // SAFETY: a live id with a route and a QP; `param` and the private data live for the call.
    if unsafe { rdma_connect(conn.id, &mut param) } != 0 {
        return Err(errno("rdma_connect"));
    }
    let ev = expect_event(conn.channel, rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, deadline, "connecting")?;
    conn.connected = true;
    let peer_hello = Hello::decode(&ev.private).map_err(|e| format!("the peer's handshake: {e}"))?;
    check_peer_ring(&peer_hello, cfg)?;
    conn.register_tx(peer_hello.ring_bytes as usize)?;
    let engine = conn.engine(true, cfg, peer_hello);
    let device = id_device_name(conn.id).unwrap_or_default();
    debug!(%peer, %device, ?peer_hello, "RDMA connection established");
    let shared = Arc::new(Shared::new(engine, peer));
    spawn_connection(conn, shared.clone(), cfg.keepalive_interval)?;
    Ok(shared)
}
