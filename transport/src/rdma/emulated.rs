//! An emulated RDMA fabric, for hosts without RDMA devices (this one, CI): the same engine, rings,
//! records, credits and per-connection I/O thread as over verbs, with the NIC replaced by a
//! `memcpy` from the sender's staging region into the receiver's ring followed by a receive
//! completion on the receiver's thread and a send completion on the sender's, in posting order,
//! as a reliable connection delivers them. What it cannot show: the verbs calls themselves,
//! rdma_cm, memory registration and real completion timing.

use super::engine::{Engine, EngineConfig, Fabric};
use super::verbs::Region;
use super::{RdmaConfig, RdmaConnection, Shared};
use crate::TransportError;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

/// What an emulated connection's I/O thread receives.
enum Event {
    /// A receive completion with this immediate.
    Recv(u32),
    /// A send completion.
    SendDone,
    /// The peer's side went away (its process, in a real fabric).
    PeerGone,
    /// This side was shut: stop.
    Stop,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A hub of emulated RDMA endpoints by address (like [`crate::MemNetwork`] for the in-memory
/// transport). Bind endpoints with [`super::RdmaTransport::emulated`].
#[derive(Clone, Default)]
pub struct EmulatedFabric {
    inner: Arc<Mutex<Hub>>,
}

#[derive(Default)]
struct Hub {
    listeners: HashMap<SocketAddr, Listener>,
    next_port: u16,
}

struct Listener {
    sink: tokio::sync::mpsc::Sender<Arc<RdmaConnection>>,
    config: RdmaConfig,
}

impl std::fmt::Debug for EmulatedFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedFabric").field("endpoints", &lock(&self.inner).listeners.len()).finish()
    }
}

impl EmulatedFabric {
    /// An empty fabric.
    pub fn new() -> EmulatedFabric {
        EmulatedFabric::default()
    }

    /// Register an endpoint; port 0 picks a free one.
    pub(crate) fn register(
        &self,
        addr: SocketAddr,
        config: &RdmaConfig,
        sink: tokio::sync::mpsc::Sender<Arc<RdmaConnection>>,
    ) -> Result<SocketAddr, TransportError> {
        let mut hub = lock(&self.inner);
        let mut addr = addr;
        if addr.port() == 0 {
            let free = (0..=u16::MAX).find_map(|_| {
                hub.next_port = hub.next_port.wrapping_add(1).max(20_000);
                let candidate = SocketAddr::new(addr.ip(), hub.next_port);
                (!hub.listeners.contains_key(&candidate)).then_some(candidate)
            });
            addr = free.ok_or(TransportError::Bind { addr, reason: "no free port left on this fabric".into() })?;
        } else if hub.listeners.contains_key(&addr) {
            return Err(TransportError::Bind { addr, reason: "address already in use on this fabric".into() });
        }
        hub.listeners.insert(addr, Listener { sink, config: config.clone() });
        Ok(addr)
    }

    pub(crate) fn unregister(&self, addr: SocketAddr) {
        lock(&self.inner).listeners.remove(&addr);
    }

    /// Connect `from` (with `config`) to the endpoint at `to`: both sides' rings, engines and
    /// threads; the accepting side goes to `to`'s accept queue.
    pub(crate) fn connect(
        &self,
        from: SocketAddr,
        to: SocketAddr,
        config: &RdmaConfig,
    ) -> Result<Arc<RdmaConnection>, TransportError> {
        let (sink, server_config) = {
            let hub = lock(&self.inner);
            let l = hub.listeners.get(&to).ok_or(TransportError::Unreachable { peer: to })?;
            (l.sink.clone(), l.config.clone())
        };
        let err = |reason: String| TransportError::Connect { peer: to, reason };
        let a_ring = Arc::new(Region::new(config.ring_bytes).map_err(err)?);
        let b_ring = Arc::new(Region::new(server_config.ring_bytes).map_err(err)?);
        let (a_events, a_rx) = std_mpsc::channel();
        let (b_events, b_rx) = std_mpsc::channel();
        let a =
            side(true, config, a_ring.clone(), b_ring.clone(), a_events.clone(), b_events.clone(), to).map_err(err)?;
        let b = side(false, &server_config, b_ring, a_ring, b_events, a_events, from).map_err(err)?;
        spawn(a.clone(), a_rx).map_err(err)?;
        spawn(b.clone(), b_rx).map_err(err)?;
        let client = RdmaConnection::new(a);
        let server = RdmaConnection::new(b);
        sink.try_send(server).map_err(|_| err("the peer is not accepting (closed or backlog full)".into()))?;
        Ok(client)
    }
}

fn side(
    initiator: bool,
    config: &RdmaConfig,
    own_ring: Arc<Region>,
    peer_ring: Arc<Region>,
    own: std_mpsc::Sender<Event>,
    peer: std_mpsc::Sender<Event>,
    peer_addr: SocketAddr,
) -> Result<Arc<Shared>, String> {
    let staging = Arc::new(Region::new(peer_ring.len())?);
    let fabric = EmuFabric { staging: staging.clone(), peer_ring: peer_ring.clone(), own, peer };
    let cfg = EngineConfig {
        max_payload: EngineConfig::clamp_payload(config.max_write_bytes, peer_ring.len()),
        stream_window: config.stream_window_bytes,
        send_queue_depth: config.send_queue_depth,
    };
    Ok(Arc::new(Shared::new(Engine::new(initiator, cfg, Box::new(fabric), staging, own_ring), peer_addr)))
}

fn spawn(shared: Arc<Shared>, events: std_mpsc::Receiver<Event>) -> Result<(), String> {
    std::thread::Builder::new()
        .name("kvfleet-rdma-emu".into())
        .spawn(move || {
            for ev in events {
                let mut engine = lock(&shared.engine);
                match ev {
                    Event::Recv(imm) => engine.on_imm(imm),
                    Event::SendDone => engine.on_send_done(),
                    Event::PeerGone => engine.shut("connection lost: the peer disconnected".into()),
                    Event::Stop => {}
                }
                if engine.is_closed() {
                    break;
                }
            }
        })
        .map(|_| ())
        .map_err(|e| format!("spawning the emulated connection thread: {e}"))
}

/// The emulated NIC of one side.
struct EmuFabric {
    staging: Arc<Region>,
    peer_ring: Arc<Region>,
    own: std_mpsc::Sender<Event>,
    peer: std_mpsc::Sender<Event>,
}

impl Fabric for EmuFabric {
    fn write_imm(&mut self, offset: usize, len: usize, imm: u32) -> Result<(), String> {
        // SAFETY: the engine (our caller, under its lock) just wrote staging `[offset, +len)` and
        // rewrites it only after the peer credits it back; the peer reads its ring range only
        // after the `Recv` sent below, and nobody else writes it (we are its only writer, and
        // only under our engine's lock).
        unsafe { self.staging.copy_to(&self.peer_ring, offset, len) };
        self.peer.send(Event::Recv(imm)).map_err(|_| "the peer is gone".to_string())?;
        let _ = self.own.send(Event::SendDone);
        Ok(())
    }

    fn probe(&mut self) -> Result<(), String> {
        let _ = self.own.send(Event::SendDone);
        Ok(())
    }

    fn shutdown(&mut self) {
        let _ = self.peer.send(Event::PeerGone);
        let _ = self.own.send(Event::Stop);
    }
}
