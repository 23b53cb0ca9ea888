//! A frame's bulk payload kept as the buffers it arrived in.
//!
//! A KV block is megabytes and QUIC delivers it as tens of packet-sized buffers. Joining them
//! into one contiguous buffer was the receiver's largest cost of its own (~22 % of its CPU on
//! loopback); a [`Payload`] keeps the list instead, so the bytes are copied once, into the KV
//! arena. The checksum ([`crate::migration::checksum_payload`]) runs over the pieces.

use bytes::{Bytes, BytesMut};

/// Bytes held as a list of buffers (no copy to build; [`Payload::to_bytes`] joins them).
///
/// Equality compares the bytes, not how they are split.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    chunks: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// No bytes.
    pub fn new() -> Payload {
        Payload::default()
    }

    /// Append `chunk` (empty chunks are skipped).
    pub fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push(chunk);
        }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffers in order (none empty).
    pub fn chunks(&self) -> &[Bytes] {
        &self.chunks
    }

    /// The bytes as one buffer: free for zero or one chunk, a copy otherwise.
    pub fn to_bytes(&self) -> Bytes {
        match self.chunks.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut out = BytesMut::with_capacity(self.len);
                for c in many {
                    out.extend_from_slice(c);
                }
                out.freeze()
            }
        }
    }

    /// Copy the bytes into `dst`, which must be exactly [`Payload::len`] long.
    ///
    /// # Panics
    /// If `dst.len() != self.len()`.
    pub fn copy_to_slice(&self, dst: &mut [u8]) {
        assert_eq!(dst.len(), self.len, "destination length differs from the payload's");
        let mut at = 0;
        for c in &self.chunks {
            dst[at..at + c.len()].copy_from_slice(c);
            at += c.len();
        }
    }

    /// [`Payload::copy_to_slice`], returning the xxh3-64 of the bytes as they landed in `dst`
    /// (the same value as `migration::checksum` over them). One pass: each piece is hashed
    /// while it is still in the cache from its copy.
    pub fn copy_checksummed(&self, dst: &mut [u8]) -> u64 {
        /// Bytes copied, then hashed, at a time (fits a core's L1 data cache).
        const PIECE: usize = 16 << 10;
        assert_eq!(dst.len(), self.len, "destination length");
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        let mut at = 0;
        for chunk in &self.chunks {
            for piece in chunk.chunks(PIECE) {
                let landed = &mut dst[at..at + piece.len()];
                landed.copy_from_slice(piece);
                hash.update(landed);
                at += piece.len();
            }
        }
        hash.digest()
    }

    /// Each byte in order (tests and diagnostics; use [`Payload::chunks`] for bulk work).
    pub fn iter(&self) -> impl Iterator<Item = u8> + '_ {
        self.chunks.iter().flat_map(|c| c.iter().copied())
    }
}

impl From<Bytes> for Payload {
    fn from(chunk: Bytes) -> Payload {
        let mut p = Payload::new();
        p.push(chunk);
        p
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload::from(Bytes::from(v))
    }
}

impl FromIterator<Bytes> for Payload {
    fn from_iter<I: IntoIterator<Item = Bytes>>(iter: I) -> Payload {
        let mut p = Payload::new();
        for c in iter {
            p.push(c);
        }
        p
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        if self.len != other.len {
            return false;
        }
        // Walk both chunk lists, comparing the overlapping runs.
        let (mut a, mut b) = (self.chunks.iter(), other.chunks.iter());
        let (mut x, mut y): (&[u8], &[u8]) = (&[], &[]);
        loop {
            if x.is_empty() {
                match a.next() {
                    Some(c) => x = c,
                    None => return true, // equal lengths: `y` is exhausted too
                }
            }
            if y.is_empty() {
                y = b.next().expect("equal lengths");
            }
            let n = x.len().min(y.len());
            if x[..n] != y[..n] {
                return false;
            }
            x = &x[n..];
            y = &y[n..];
        }
    }
}

impl Eq for Payload {}

impl PartialEq<[u8]> for Payload {
    fn eq(&self, other: &[u8]) -> bool {
        self.len == other.len() && {
            let mut at = 0;
            self.chunks.iter().all(|c| {
                let same = other[at..at + c.len()] == c[..];
                at += c.len();
                same
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(data: &[u8], cuts: &[usize]) -> Payload {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
        cuts.sort_unstable();
        let mut at = 0;
        let mut p = Payload::new();
        for c in cuts.into_iter().chain([data.len()]) {
            p.push(Bytes::copy_from_slice(&data[at..c]));
            at = c;
        }
        p
    }

    proptest! {
        #[test]
        fn any_split_holds_the_same_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            other_cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let p = split(&data, &cuts);
            prop_assert_eq!(p.len(), data.len());
            prop_assert!(p.chunks().iter().all(|c| !c.is_empty()));
            prop_assert_eq!(&p.to_bytes()[..], &data[..]);
            prop_assert_eq!(p.iter().collect::<Vec<u8>>(), data.clone());
            prop_assert!(p == data[..]);
            let mut dst = vec![0u8; data.len()];
            p.copy_to_slice(&mut dst);
            prop_assert_eq!(&dst, &data);
            prop_assert_eq!(&p, &split(&data, &other_cuts));
        }

        /// The one-pass copy lands the same bytes and hashes them as the migration checksum
        /// does, whatever the pieces (blocks longer than the copy's own 16 KiB pieces too).
        #[test]
        fn a_checksummed_copy_is_the_copy_and_its_checksum(
            len in 0usize..70_000,
            seed in any::<u64>(),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut x = seed | 1;
            let data: Vec<u8> = (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
            let p = split(&data, &cuts);
            let mut dst = vec![0u8; len];
            let sum = p.copy_checksummed(&mut dst);
            prop_assert_eq!(&dst, &data);
            prop_assert_eq!(sum, crate::migration::checksum(&data));
        }

        #[test]
        fn a_changed_byte_makes_them_differ(
            data in proptest::collection::vec(any::<u8>(), 1..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            at in any::<usize>(),
        ) {
            let mut changed = data.clone();
            let at = at % data.len();
            changed[at] ^= 0x5a;
            prop_assert_ne!(&split(&data, &cuts), &split(&changed, &cuts));
            prop_assert!(split(&data, &cuts) != changed[..]);
            prop_assert_ne!(&split(&data, &cuts), &split(&data[..data.len() - 1], &cuts));
        }
    }
}
