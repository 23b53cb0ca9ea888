//! The RDMA transport's wire format (pure, no verbs): the records a sender writes into the peer's
//! receive ring, the 32-bit immediate values that announce them, and the handshake carried in the
//! rdma_cm private data.
//!
//! # Records
//!
//! Every record starts on a [`RECORD_ALIGN`]-byte boundary of the ring with a 16-byte header:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind ([`RecordKind`]) |
//! | 1..4 | zero |
//! | 4..8 | stream id (big-endian) |
//! | 8..12 | payload length (big-endian) |
//! | 12..16 | low 32 bits of the record's absolute ring position (a misparse check) |
//!
//! followed by the payload. One RDMA WRITE WITH IMMEDIATE carries exactly one record; its
//! immediate is [`Imm::Record`] with the ring bytes the record occupies (header, payload and
//! alignment padding), so the receiver can check that the header it parses agrees. A record that
//! would cross the end of the ring is preceded by a [`RecordKind::Pad`] record covering the rest
//! of the ring. Ring space flows back as [`Imm::Credit`] (a zero-length write with immediate).

use std::fmt;

/// Bytes of a record header.
pub(crate) const RECORD_HEADER_BYTES: usize = 16;
/// Records start at multiples of this (a cache line: the NIC's writes stay line-aligned).
pub(crate) const RECORD_ALIGN: usize = 64;
/// The largest ring the immediate can describe (credits and record sizes are 31-bit).
pub(crate) const MAX_RING_BYTES: usize = 1 << 30;
/// Bytes of a `Window` record's payload (the new limit, u64 big-endian).
pub(crate) const WINDOW_PAYLOAD_BYTES: usize = 8;
/// A close reason is cut to this many bytes on the wire.
pub(crate) const MAX_CLOSE_REASON_BYTES: usize = 256;

/// The handshake's magic and version.
const HELLO_MAGIC: [u8; 4] = *b"KVR1";
const HELLO_VERSION: u16 = 1;
/// Bytes of an encoded [`Hello`] (fits the 56 bytes rdma_cm leaves in an IB connect request).
pub(crate) const HELLO_BYTES: usize = 24;

/// What a record means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum RecordKind {
    /// The sender opened stream `stream` (no payload).
    Open = 1,
    /// Stream data.
    Data = 2,
    /// The sender finished writing the stream (or dropped its writer, which finishes it, as
    /// quinn's and the in-memory transport's do): the reader sees EOF after the data.
    Fin = 3,
    /// The sender's reader went away: the receiver's writer on that stream fails (no payload).
    Stop = 4,
    /// Flow control: the sender's reader allows stream data up to the payload's u64 offset.
    Window = 5,
    /// The sender closes the connection; the payload is the reason (UTF-8, cut).
    Close = 6,
    /// Skip to the start of the ring (the header is the only meaningful bytes).
    Pad = 7,
}

impl RecordKind {
    fn from_u8(b: u8) -> Option<RecordKind> {
        Some(match b {
            1 => RecordKind::Open,
            2 => RecordKind::Data,
            3 => RecordKind::Fin,
            4 => RecordKind::Stop,
            5 => RecordKind::Window,
            6 => RecordKind::Close,
            7 => RecordKind::Pad,
            _ => return None,
        })
    }
}

/// A record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub kind: RecordKind,
    pub stream: u32,
    pub len: u32,
    /// The low 32 bits of the record's absolute position in the ring's byte sequence.
    pub seq: u32,
}

/// A malformed record or handshake: the peer is not a kvfleet RDMA transport of this version,
/// or the two sides disagree about the ring (a bug). Either way the connection is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("record header has non-zero reserved bytes")]
    Reserved,
    #[error("record at ring position {expected:#x} carries position {got:#x} (ring out of sync)")]
    Seq { expected: u32, got: u32 },
    #[error("record of {header_bytes} ring bytes announced as {announced} bytes by its immediate")]
    SizeMismatch { header_bytes: usize, announced: usize },
    #[error("{0}")]
    Hello(String),
    /// The peer broke the stream protocol (a stream never opened, a window overrun, ...).
    #[error("{0}")]
    Protocol(String),
}

impl RecordHeader {
    pub(crate) fn encode(&self) -> [u8; RECORD_HEADER_BYTES] {
        let mut b = [0u8; RECORD_HEADER_BYTES];
        b[0] = self.kind as u8;
        b[4..8].copy_from_slice(&self.stream.to_be_bytes());
        b[8..12].copy_from_slice(&self.len.to_be_bytes());
        b[12..16].copy_from_slice(&self.seq.to_be_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; RECORD_HEADER_BYTES]) -> Result<RecordHeader, WireError> {
        let kind = RecordKind::from_u8(b[0]).ok_or(WireError::UnknownKind(b[0]))?;
        if b[1..4] != [0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let word = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(RecordHeader { kind, stream: word(4), len: word(8), seq: word(12) })
    }

    /// Ring bytes this record occupies (a `Pad` occupies the rest of the ring instead).
    pub(crate) fn ring_bytes(&self) -> usize {
        record_ring_bytes(self.len as usize)
    }
}

/// Ring bytes of a record with `payload` bytes: header plus payload, rounded up to the alignment.
pub(crate) fn record_ring_bytes(payload: usize) -> usize {
    (RECORD_HEADER_BYTES + payload).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// The 32-bit immediate of an RDMA WRITE WITH IMMEDIATE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Imm {
    /// One record was written at the receiver's next ring position; it occupies this many bytes.
    Record { ring_bytes: u32 },
    /// The receiver of the sender's records freed this many more bytes of its ring.
    Credit { bytes: u32 },
}

const CREDIT_BIT: u32 = 1 << 31;

impl Imm {
    pub(crate) fn encode(self) -> u32 {
        match self {
            Imm::Record { ring_bytes } => ring_bytes & !CREDIT_BIT,
            Imm::Credit { bytes } => CREDIT_BIT | (bytes & !CREDIT_BIT),
        }
    }

    pub(crate) fn decode(v: u32) -> Imm {
        if v & CREDIT_BIT != 0 {
            Imm::Credit { bytes: v & !CREDIT_BIT }
        } else {
            Imm::Record { ring_bytes: v }
        }
    }
}

/// What each side tells the other when connecting: where its receive ring is. Carried in the
/// rdma_cm connect request (client) and accept (server) private data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The ring's virtual address in the sender's registered memory region.
    pub ring_addr: u64,
    /// The remote key of that region (it allows REMOTE_WRITE and nothing else).
    pub ring_rkey: u32,
    /// The ring's size in bytes (a multiple of [`RECORD_ALIGN`], at most [`MAX_RING_BYTES`]).
    pub ring_bytes: u32,
}

impl fmt::Debug for Hello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hello {{ ring: {} bytes at {:#x}, rkey {:#x} }}", self.ring_bytes, self.ring_addr, self.ring_rkey)
    }
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&HELLO_VERSION.to_be_bytes());
        b[8..16].copy_from_slice(&self.ring_addr.to_be_bytes());
        b[16..20].copy_from_slice(&self.ring_rkey.to_be_bytes());
        b[20..24].copy_from_slice(&self.ring_bytes.to_be_bytes());
        b
    }

    /// Decode the private data of a connect request or accept (the fabric may pad it with zeros).
    pub(crate) fn decode(b: &[u8]) -> Result<Hello, WireError> {
        let Some(b) = b.get(..HELLO_BYTES) else {
            return Err(WireError::Hello(format!(
                "handshake of {} bytes, want {HELLO_BYTES} (the peer is not a kvfleet RDMA transport)",
                b.len()
            )));
        };
        if b[0..4] != HELLO_MAGIC {
            return Err(WireError::Hello("handshake magic differs (the peer is not a kvfleet RDMA transport)".into()));
        }
        let version = u16::from_be_bytes([b[4], b[5]]);
        if version != HELLO_VERSION {
            return Err(WireError::Hello(format!(
                "the peer speaks kvfleet RDMA version {version}, this side {HELLO_VERSION}"
            )));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&b[8..16]);
        let hello = Hello { ring_addr: u64::from_be_bytes(addr), ring_rkey: u32_at(16), ring_bytes: u32_at(20) };
        let ring = hello.ring_bytes as usize;
        if ring < 4 * record_ring_bytes(0) || ring > MAX_RING_BYTES || !ring.is_multiple_of(RECORD_ALIGN) {
            return Err(WireError::Hello(format!(
                "the peer's ring of {ring} bytes is not a multiple of {RECORD_ALIGN} between {} and {MAX_RING_BYTES}",
                4 * record_ring_bytes(0)
            )));
        }
        Ok(hello)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        for kind in [
            RecordKind::Open,
            RecordKind::Data,
            RecordKind::Fin,
            RecordKind::Stop,
            RecordKind::Window,
            RecordKind::Close,
            RecordKind::Pad,
        ] {
            let h = RecordHeader { kind, stream: 0xdead_beef, len: 1 << 20, seq: 0x1234_5678 };
            assert_eq!(RecordHeader::decode(&h.encode()), Ok(h));
        }
        let mut b = RecordHeader { kind: RecordKind::Data, stream: 1, len: 2, seq: 3 }.encode();
        b[0] = 0;
        assert_eq!(RecordHeader::decode(&b), Err(WireError::UnknownKind(0)));
        b[0] = 8;
        assert_eq!(RecordHeader::decode(&b), Err(WireError::UnknownKind(8)));
        b[0] = 2;
        b[2] = 1;
        assert_eq!(RecordHeader::decode(&b), Err(WireError::Reserved));
    }

    #[test]
    fn record_sizes_are_aligned_and_cover_the_payload() {
        assert_eq!(record_ring_bytes(0), 64);
        assert_eq!(record_ring_bytes(48), 64);
        assert_eq!(record_ring_bytes(49), 128);
        assert_eq!(record_ring_bytes(1 << 20), (1 << 20) + 64);
        for n in 0..300 {
            let r = record_ring_bytes(n);
            assert_eq!(r % RECORD_ALIGN, 0);
            assert!(r >= RECORD_HEADER_BYTES + n && r < RECORD_HEADER_BYTES + n + RECORD_ALIGN);
        }
    }

    #[test]
    fn immediates_keep_records_and_credits_apart() {
        for v in [0u32, 64, (1 << 30) + 64, (1 << 31) - 1] {
            assert_eq!(Imm::decode(Imm::Record { ring_bytes: v }.encode()), Imm::Record { ring_bytes: v });
            assert_eq!(Imm::decode(Imm::Credit { bytes: v }.encode()), Imm::Credit { bytes: v });
        }
        assert_ne!(Imm::Record { ring_bytes: 64 }.encode(), Imm::Credit { bytes: 64 }.encode());
    }

    #[test]
    fn hello_round_trips_and_rejects_strangers() {
        let h = Hello { ring_addr: 0x7f00_1234_5000, ring_rkey: 0xabcd, ring_bytes: 16 << 20 };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        // IB pads private data with zeros: a longer buffer still decodes.
        let mut padded = h.encode().to_vec();
        padded.resize(56, 0);
        assert_eq!(Hello::decode(&padded), Ok(h));
        let err = |b: &[u8]| match Hello::decode(b) {
            Err(WireError::Hello(m)) => m,
            other => panic!("expected a handshake error, got {other:?}"),
        };
        assert!(err(&h.encode()[..10]).contains("10 bytes"));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(err(&bad).contains("magic"));
        let mut bad = h.encode();
        bad[5] = 9;
        assert!(err(&bad).contains("version 9"));
        for ring in [0u32, 100, 64 * 3, (1 << 30) + 64] {
            let bad = Hello { ring_bytes: ring, ..h }.encode();
            assert!(err(&bad).contains("ring of"), "ring {ring}");
        }
    }
}
