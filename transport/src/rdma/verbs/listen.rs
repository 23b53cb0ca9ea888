//! The listener: a bound, listening rdma_cm id and its thread, which accepts connect requests
//! (see the parent module's rules).

use super::conn::{check_peer_ring, conn_param, run_connection, Conn};
use super::*;
use crate::rdma::wire::Hello;
use crate::rdma::{RdmaConfig, RdmaConnection, Shared};
use tracing::{debug, warn};

/// A bound, listening rdma_cm id and its thread (stopped on drop).
pub(crate) struct Listener {
    wake: Arc<OwnedFd>,
    local: SocketAddr,
    device: Option<String>,
}

/// The listening id and its channel (the thread's), destroyed on drop.
struct ListenId {
    channel: *mut rdma_event_channel,
    id: *mut rdma_cm_id,
}

// SAFETY: owned and used by one thread at a time (the binding one, then the listener thread).
unsafe impl Send for ListenId {}

impl Drop for ListenId {
    fn drop(&mut self) {
        // SAFETY: created in `Listener::bind`, destroyed once, id before its channel.
        unsafe {
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
            rdma_destroy_event_channel(self.channel);
        }
    }
}

/// Where accepted connections go.
pub(crate) type AcceptSink = tokio::sync::mpsc::Sender<Arc<RdmaConnection>>;

impl Listener {
    pub(crate) fn bind(listen: SocketAddr, cfg: &RdmaConfig, sink: AcceptSink) -> Result<Listener, String> {
        // SAFETY: plain constructor; null on failure.
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(errno("rdma_create_event_channel (opening /dev/infiniband/rdma_cm)"));
        }
        let mut l = ListenId { channel, id: ptr::null_mut() };
        // SAFETY: a live channel.
        set_nonblocking(unsafe { (*channel).fd })?;
        // SAFETY: a live channel; the id is destroyed by ListenId.
        if unsafe { rdma_create_id(channel, &mut l.id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) } != 0 {
            l.id = ptr::null_mut();
            return Err(errno("rdma_create_id"));
        }
        set_tos(l.id, cfg.tos)?;
        let mut addr = sockaddr_of(listen);
        // SAFETY: a live id; the address is valid for the call.
        if unsafe { rdma_bind_addr(l.id, ptr::from_mut(&mut addr).cast()) } != 0 {
            return Err(errno("rdma_bind_addr (is the address on an RDMA interface, IPoIB or RoCE?)"));
        }
        let device = id_device_name(l.id);
        if let (Some(want), Some(got)) = (&cfg.device, &device) {
            if want != got {
                return Err(format!("{listen} belongs to RDMA device {got}, not the configured {want}"));
            }
        }
        // SAFETY: a live, bound id.
        if unsafe { rdma_listen(l.id, 64) } != 0 {
            return Err(errno("rdma_listen"));
        }
        // SAFETY: a live, bound id.
        let port = u16::from_be(unsafe { rdma_get_src_port(l.id) });
        let local = SocketAddr::new(listen.ip(), port);
        let wake = eventfd()?;
        let thread_wake = wake.clone();
        let cfg = cfg.clone();
        std::thread::Builder::new()
            .name("kvfleet-rdma-listen".into())
            .spawn(move || run_listener(l, thread_wake, cfg, sink))
            .map_err(|e| format!("spawning the listener thread: {e}"))?;
        debug!(%local, device = device.as_deref().unwrap_or("any"), "RDMA transport listening");
        Ok(Listener { wake, local, device })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The device the listen address is on (`None` for a wildcard address).
    pub(crate) fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        wake(&self.wake);
    }
}

fn run_listener(l: ListenId, wake_fd: Arc<OwnedFd>, cfg: RdmaConfig, sink: AcceptSink) {
    // SAFETY: a live channel owned by `l`.
    let cm_fd = unsafe { (*l.channel).fd };
    loop {
        let ready = match poll_readable(&[cm_fd, wake_fd.as_raw_fd()], Some(Duration::from_secs(1))) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "RDMA listener stopped");
                break;
            }
        };
        if ready[1] || sink.is_closed() {
            break;
        }
        loop {
            match next_event(l.channel, Some(Duration::ZERO)) {
                Ok(Some(ev)) if ev.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    if let Err(e) = accept_one(ev.id, &ev.private, &cfg, &sink) {
                        warn!(error = %e, "refused an RDMA connection");
                    }
                }
                Ok(Some(ev)) => debug!(event = %event_name(ev.kind), "rdma_cm listener event ignored"),
                Ok(None) => break,
                Err(e) => {
                    warn!(error = %e, "RDMA listener event");
                    break;
                }
            }
        }
    }
    debug!("RDMA listener stopped");
}

fn reject(id: *mut rdma_cm_id) {
    // SAFETY: a live id of a connect request whose event was acknowledged; destroyed once.
    unsafe {
        rdma_reject(id, ptr::null(), 0);
        rdma_destroy_id(id);
    }
}

/// Accept one connect request: own channel, QP and rings, then accept; a thread waits for
/// ESTABLISHED (so a slow client holds up nobody), hands the connection over, and runs it.
fn accept_one(id: *mut rdma_cm_id, private: &[u8], cfg: &RdmaConfig, sink: &AcceptSink) -> Result<(), String> {
    let peer_hello = match Hello::decode(private).map_err(|e| e.to_string()).and_then(|h| {
        check_peer_ring(&h, cfg)?;
        Ok(h)
    }) {
        Ok(h) => h,
        Err(e) => {
            reject(id);
            return Err(format!("bad handshake: {e}"));
        }
    };
    let mut conn = match Conn::new(id) {
        Ok(c) => c,
        Err(e) => {
            reject(id);
            return Err(e);
        }
    };
    let prepared = conn.setup(cfg).and_then(|()| conn.register_tx(peer_hello.ring_bytes as usize));
    if let Err(e) = prepared {
        // SAFETY: a live id (destroyed by `conn`'s Drop).
        unsafe { rdma_reject(conn.id, ptr::null(), 0) };
        return Err(e);
    }
    let hello = conn.hello().encode();
    let mut param = conn_param(&hello);
    // SAFETY: a live id with a QP; `param` and the private data live for the call.
    if unsafe { rdma_accept(conn.id, &mut param) } != 0 {
        return Err(errno("rdma_accept"));
    }
    conn.connected = true;
    let cfg = cfg.clone();
    let sink = sink.clone();
    std::thread::Builder::new()
        .name("kvfleet-rdma-conn".into())
        .spawn(move || {
            let deadline = Instant::now() + cfg.connect_timeout;
            if let Err(e) =
                expect_event(conn.channel, rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, deadline, "accepting")
            {
                warn!(error = %e, "an RDMA connection did not complete");
                return;
            }
            let peer = conn.peer_addr().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
            let shared = Arc::new(Shared::new(conn.engine(false, &cfg, peer_hello), peer));
            debug!(%peer, "RDMA connection accepted");
            // Nobody accepting any more: the connection is dropped, which closes it.
            let _ = sink.blocking_send(RdmaConnection::new(shared.clone()));
            run_connection(conn, shared, cfg.keepalive_interval);
        })
        .map(|_| ())
        .map_err(|e| format!("spawning the connection thread: {e}"))
}
