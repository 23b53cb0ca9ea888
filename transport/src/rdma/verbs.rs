//! All of the RDMA transport's unsafe code: libibverbs and librdmacm through `rdma-sys`, and the
//! raw memory regions the NIC reads and writes.
//!
//! | file | what |
//! |---|---|
//! | this one | registered memory ([`Region`]), devices and addresses, descriptors, rdma_cm events |
//! | `verbs/conn.rs` | one connection's verbs objects, the posting fabric, its I/O thread, connecting |
//! | `verbs/listen.rs` | the listener and accepting |
//!
//! Nothing here blocks an async runtime: connection setup ([`connect`]) runs on
//! `spawn_blocking`; the listener and every connection have a dedicated thread that waits in
//! `poll(2)` on the rdma_cm event channel, the completion channel and an eventfd used to wake it.
//!
//! Resource order, the rule that keeps this sound: a connection's verbs objects (`conn::Conn`) are
//! created by one thread and destroyed by the connection's I/O thread in reverse order (its
//! `Drop`), and only after the engine is shut (under its lock), which drops the engine's
//! `VerbsFabric`, the only other user of the queue pair. Memory regions are [`Region`]s held by
//! `Arc` in both the engine and the connection, so the memory outlives its registration.

mod conn;
mod listen;

pub(crate) use conn::connect;
pub(crate) use listen::Listener;

use rdma_sys::*;
use std::alloc::Layout;
use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `RDMA_OPTION_ID` / `RDMA_OPTION_ID_TOS` from `<rdma/rdma_cma.h>` (anonymous enums that the
/// bindings leave out).
const RDMA_OPTION_ID: c_int = 0;
const RDMA_OPTION_ID_TOS: c_int = 0;
/// Work request ids: what a completion belongs to.
const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;
/// "Retry forever" for receiver-not-ready NAKs (the receiver re-posts receives as it goes).
const RNR_RETRY_INFINITE: u8 = 7;
/// Transport retries before a work request fails (the NIC's maximum).
const RETRY_COUNT: u8 = 7;
/// How long a closing connection waits for its last writes (the `Close` record) to complete.
const CLOSE_DRAIN: Duration = Duration::from_millis(100);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn errno(what: &str) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

// ---- Memory ---------------------------------------------------------------------------------

/// A page-aligned, zeroed heap buffer that never moves: the memory behind a registered MR.
pub(crate) struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

const REGION_ALIGN: usize = 4096;

// SAFETY: a plain heap buffer; every access goes through `read`/`write`, whose contracts rule out
// data races.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn new(len: usize) -> Result<Region, String> {
        let layout =
            Layout::from_size_align(len.max(1), REGION_ALIGN).map_err(|e| format!("a {len}-byte region: {e}"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| Region { ptr, len }).ok_or_else(|| format!("allocating {len} bytes failed"))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Copy `dst.len()` bytes at `offset` out. Panics when out of bounds.
    ///
    /// # Safety
    /// Nobody (no thread, no NIC) writes that range during the call.
    pub(crate) unsafe fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset.checked_add(dst.len()).is_some_and(|end| end <= self.len), "region read out of bounds");
        // SAFETY: in bounds (checked); no concurrent writer (the caller's contract).
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// Copy `src` in at `offset`. Panics when out of bounds.
    ///
    /// # Safety
    /// Nobody reads or writes that range during the call.
    pub(crate) unsafe fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset.checked_add(src.len()).is_some_and(|end| end <= self.len), "region write out of bounds");
        // SAFETY: in bounds (checked); exclusive access to the range (the caller's contract).
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) }
    }

    /// Copy `len` bytes at `offset` of `self` to the same offset of `dst` (the emulated RDMA WRITE).
    ///
    /// # Safety
    /// Nobody writes the source range, and nobody reads or writes the destination range, during the call.
    pub(crate) unsafe fn copy_to(&self, dst: &Region, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len && end <= dst.len),
            "region copy out of bounds"
        );
        // SAFETY: in bounds of both (checked); distinct allocations; the caller's contract.
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), REGION_ALIGN).expect("checked in new");
        // SAFETY: allocated in `new` with this layout; dropped once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

// ---- Devices and addresses --------------------------------------------------------------------

/// The names of the RDMA devices libibverbs sees (`mlx5_0`, `rxe0`, ...).
pub(crate) fn device_names() -> Result<Vec<String>, String> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the returned list is freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ENOSYS) {
            "ibv_get_device_list returned 0 devices: this kernel has no RDMA (uverbs) support".into()
        } else {
            format!("ibv_get_device_list failed: {e}")
        });
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: the list holds `n` valid device pointers; a device name is a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

/// The IP addresses of every network interface, by interface name (getifaddrs).
pub(crate) fn interface_addrs() -> Result<Vec<(String, IpAddr)>, String> {
    let mut head: *mut libc::ifaddrs = ptr::null_mut();
    // SAFETY: a valid out-pointer; the list is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(errno("getifaddrs"));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned; its name is NUL-terminated.
        let ifa = unsafe { &*cur };
        if let Some(addr) = socket_addr_from(ifa.ifa_addr) {
            // SAFETY: as above.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
            out.push((name, addr.ip()));
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn sockaddr_of(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write(ptr::from_mut(&mut ss).cast::<libc::sockaddr_in>(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { ptr::write(ptr::from_mut(&mut ss).cast::<libc::sockaddr_in6>(), sin6) };
        }
    }
    ss
}

fn socket_addr_from(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: a valid sockaddr; the family says which longer struct it is.
    unsafe {
        match c_int::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    u16::from_be(sin6.sin6_port),
                    u32::from_be(sin6.sin6_flowinfo),
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

// ---- File descriptors -------------------------------------------------------------------------

fn set_nonblocking(fd: c_int) -> Result<(), String> {
    // SAFETY: fcntl on a descriptor this module owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(errno("making a verbs descriptor non-blocking"));
    }
    Ok(())
}

fn eventfd() -> Result<Arc<OwnedFd>, String> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(errno("eventfd"));
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: an 8-byte write to an eventfd; failure (counter full) still leaves it readable.
    unsafe { libc::write(fd.as_raw_fd(), ptr::from_ref(&one).cast(), 8) };
}

fn drain_eventfd(fd: &OwnedFd) {
    let mut v: u64 = 0;
    // SAFETY: an 8-byte read from a non-blocking eventfd.
    unsafe { libc::read(fd.as_raw_fd(), ptr::from_mut(&mut v).cast(), 8) };
}

/// Wait until one of `fds` is readable or `timeout` passes (`None`: forever). Returns which were.
fn poll_readable(fds: &[c_int], timeout: Option<Duration>) -> Result<Vec<bool>, String> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let ms = timeout.map_or(-1, |t| c_int::try_from(t.as_millis()).unwrap_or(c_int::MAX));
    loop {
        // SAFETY: `pfds` is a valid array of `len` pollfds.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(pfds.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(format!("poll: {e}"));
        }
    }
}

// ---- rdma_cm events ---------------------------------------------------------------------------

/// An rdma_cm event, copied out and acknowledged.
struct CmEvent {
    kind: rdma_cm_event_type::Type,
    status: c_int,
    id: *mut rdma_cm_id,
    private: Vec<u8>,
}

fn event_name(kind: rdma_cm_event_type::Type) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    unsafe { CStr::from_ptr(rdma_event_str(kind)) }.to_string_lossy().into_owned()
}

fn status_text(status: c_int) -> String {
    if status < 0 {
        format!("{} ({status})", io::Error::from_raw_os_error(-status))
    } else {
        format!("status {status}")
    }
}

/// The next event of `channel` (non-blocking descriptor), waiting at most `timeout`.
fn next_event(channel: *mut rdma_event_channel, timeout: Option<Duration>) -> Result<Option<CmEvent>, String> {
    // SAFETY: a live channel owned by the caller.
    let fd = unsafe { (*channel).fd };
    if !poll_readable(&[fd], timeout)?[0] {
        return Ok(None);
    }
    let mut ev: *mut rdma_cm_event = ptr::null_mut();
    // SAFETY: a live channel; `ev` is acknowledged below.
    if unsafe { rdma_get_cm_event(channel, &mut ev) } != 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(format!("rdma_get_cm_event: {e}")) };
    }
    // SAFETY: a valid event until acknowledged; the private data (connection events only) is
    // copied out before that.
    let out = unsafe {
        let e = &*ev;
        let has_private = matches!(
            e.event,
            rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST
                | rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED
                | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED
        );
        let conn = &e.param.conn;
        let private = if has_private && !conn.private_data.is_null() {
            std::slice::from_raw_parts(conn.private_data.cast::<u8>(), usize::from(conn.private_data_len)).to_vec()
        } else {
            Vec::new()
        };
        let out = CmEvent { kind: e.event, status: e.status, id: e.id, private };
        rdma_ack_cm_event(ev);
        out
    };
    Ok(Some(out))
}

/// Wait for event `want` on `channel` until `deadline`; any other event is an error naming it.
fn expect_event(
    channel: *mut rdma_event_channel,
    want: rdma_cm_event_type::Type,
    deadline: Instant,
    what: &str,
) -> Result<CmEvent, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    let Some(ev) = next_event(channel, Some(left))? else {
        return Err(format!("{what}: no answer within the connect timeout"));
    };
    if ev.kind == want {
        return Ok(ev);
    }
    let hint = match ev.kind {
        rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
            " (nothing listens there, or it is not a kvfleet RDMA transport of this version)"
        }
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR | rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR => {
            " (is the address on an RDMA interface, IPoIB or RoCE, and routable from this one?)"
        }
        rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR => {
            " (the peer did not answer: check the fabric, the subnet manager or PFC)"
        }
        _ => "",
    };
    Err(format!("{what}: got {} with {}{hint}", event_name(ev.kind), status_text(ev.status)))
}

fn set_tos(id: *mut rdma_cm_id, tos: Option<u8>) -> Result<(), String> {
    let Some(mut tos) = tos else { return Ok(()) };
    // SAFETY: a live id; a one-byte option value, as rdma_cma.h documents for RDMA_OPTION_ID_TOS.
    let rc = unsafe { rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, ptr::from_mut(&mut tos).cast(), 1) };
    if rc != 0 {
        return Err(errno(&format!("setting the traffic class (ToS {tos})")));
    }
    Ok(())
}

fn id_device_name(id: *mut rdma_cm_id) -> Option<String> {
    // SAFETY: a live id; `verbs` is null until the id is bound to a device.
    unsafe {
        let verbs = (*id).verbs;
        if verbs.is_null() {
            return None;
        }
        Some(CStr::from_ptr(ibv_get_device_name((*verbs).device)).to_string_lossy().into_owned())
    }
}
