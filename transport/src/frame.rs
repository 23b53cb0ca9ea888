//! Length-prefixed protobuf frames: a 4-byte big-endian body length, then the prost body.
//!
//! Generic over any [`prost::Message`], so the migration protocol's `Frame` (and the benchmark's
//! chunks) share one codec. The length limit ([`FrameCodec::max_frame_bytes`], 64 MiB by default)
//! is checked on the header, before a byte of the body is read or a buffer is grown for it, so a
//! hostile or corrupt header cannot make a reader allocate.
//!
//! Zero-copy where it counts: a received frame is split off the read buffer and frozen into
//! [`Bytes`], so `bytes` fields declared `#[prost(bytes = "bytes")]` decode as slices of it. On
//! the send side the header and body are encoded into one reused buffer and written with a single
//! `write_all`; a large payload (a KV block) can instead be handed to the stream whole, uncopied
//! ([`FrameWriter::send_with_payload`]).
//!
//! After any error a [`FrameReader`] drops its stream (closing it towards the peer) and every
//! later `recv` fails: a stream that carried a bad frame is not trusted again.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kvfleet_netmodel::Payload;
use prost::Message;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The default (and recommended) frame size limit: 64 MiB, room for a 4 MiB KV block many times.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 << 20;
/// Bytes of the length header.
pub const HEADER_BYTES: usize = 4;
/// How much a reader asks for at least when it does not yet know the next frame's size.
const MIN_READ_BYTES: usize = 64 << 10;
/// The largest protobuf field number.
const MAX_FIELD_TAG: u32 = (1 << 29) - 1;
/// A writer keeps its encode buffer between frames unless it grew past this for a rare big one.
const SHRINK_ABOVE_BYTES: usize = 16 << 20;

/// The protobuf key of length-delimited field `tag` (wire type 2).
fn len_delimited_key(tag: u32) -> u64 {
    u64::from(tag) << 3 | 2
}

/// What went wrong with a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The header announces a body larger than the limit (nothing was read past the header).
    #[error("frame body of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced body length, bytes.
        len: u64,
        /// The limit, bytes.
        max: usize,
    },
    /// The stream ended inside a frame (`want` counts the header).
    #[error("stream ended inside a frame: have {have} of {want} bytes")]
    Truncated {
        /// Bytes of the frame received.
        have: usize,
        /// Bytes the frame needs.
        want: usize,
    },
    /// The body is not a valid encoding of the expected message.
    #[error("malformed frame body: {0}")]
    Malformed(#[from] prost::DecodeError),
    /// The stream failed (connection lost, reset, closed after an earlier error).
    #[error("frame stream I/O: {0}")]
    Io(#[from] io::Error),
}

/// Frame limits; [`Default`] is [`DEFAULT_MAX_FRAME_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCodec {
    /// The largest body accepted or sent, in bytes (a hard limit; at most `u32::MAX`).
    pub max_frame_bytes: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        FrameCodec { max_frame_bytes: DEFAULT_MAX_FRAME_BYTES }
    }
}

impl FrameCodec {
    /// A codec with this body limit (clamped to `u32::MAX`, what the header can express).
    pub fn new(max_frame_bytes: usize) -> FrameCodec {
        FrameCodec { max_frame_bytes: max_frame_bytes.min(u32::MAX as usize) }
    }

    fn limit(&self) -> usize {
        self.max_frame_bytes.min(u32::MAX as usize)
    }

    /// The body length announced by the header at the start of `buf`, checked against the limit;
    /// `None` while fewer than [`HEADER_BYTES`] are buffered.
    pub fn body_len(&self, buf: &[u8]) -> Result<Option<usize>, FrameError> {
        let Some(header) = buf.get(..HEADER_BYTES) else { return Ok(None) };
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        if len as usize > self.limit() {
            return Err(FrameError::TooLarge { len: u64::from(len), max: self.limit() });
        }
        Ok(Some(len as usize))
    }

    /// Append `msg` as one frame to `dst`.
    pub fn encode<M: Message>(&self, msg: &M, dst: &mut BytesMut) -> Result<(), FrameError> {
        let len = msg.encoded_len();
        if len > self.limit() {
            return Err(FrameError::TooLarge { len: len as u64, max: self.limit() });
        }
        dst.reserve(HEADER_BYTES + len);
        dst.put_u32(len as u32);
        // Cannot fail: the capacity was reserved above.
        msg.encode(dst).map_err(|e| io::Error::other(format!("encoding a frame: {e}")))?;
        Ok(())
    }

    /// Take one frame off the front of `buf`: `Ok(None)` when it holds no complete frame yet
    /// (nothing consumed). A malformed body is consumed; a too-large header is not.
    pub fn decode<M: Message + Default>(&self, buf: &mut BytesMut) -> Result<Option<M>, FrameError> {
        let Some(len) = self.body_len(buf)? else { return Ok(None) };
        if buf.len() < HEADER_BYTES + len {
            return Ok(None);
        }
        buf.advance(HEADER_BYTES);
        let body: Bytes = buf.split_to(len).freeze();
        Ok(Some(M::decode(body)?))
    }
}

/// [`FrameCodec::encode`] with the default limit.
pub fn encode<M: Message>(msg: &M, dst: &mut BytesMut) -> Result<(), FrameError> {
    FrameCodec::default().encode(msg, dst)
}

/// [`FrameCodec::decode`] with the default limit.
pub fn decode<M: Message + Default>(buf: &mut BytesMut) -> Result<Option<M>, FrameError> {
    FrameCodec::default().decode(buf)
}

/// Writes frames to an async stream.
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    codec: FrameCodec,
    buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// A writer with the default limit.
    pub fn new(inner: W) -> Self {
        Self::with_codec(inner, FrameCodec::default())
    }

    /// A writer with `codec`'s limit.
    pub fn with_codec(inner: W, codec: FrameCodec) -> Self {
        FrameWriter { inner, codec, buf: BytesMut::new() }
    }

    /// Send one frame (header and body in one `write_all` from a reused buffer).
    pub async fn send<M: Message>(&mut self, msg: &M) -> Result<(), FrameError> {
        self.buf.clear();
        self.codec.encode(msg, &mut self.buf)?;
        self.inner.write_all(&self.buf).await?;
        // Do not pin a one-off huge buffer for the stream's lifetime.
        if self.buf.capacity() > SHRINK_ABOVE_BYTES && self.buf.len() < self.buf.capacity() / 4 {
            self.buf = BytesMut::new();
        }
        Ok(())
    }

    /// Flush the underlying stream.
    pub async fn flush(&mut self) -> Result<(), FrameError> {
        Ok(self.inner.flush().await?)
    }

    /// End the stream cleanly (the peer's reader sees EOF after the last frame).
    pub async fn finish(&mut self) -> Result<(), FrameError> {
        Ok(self.inner.shutdown().await?)
    }

    /// The underlying stream.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: crate::SendHalf> FrameWriter<W> {
    /// Send a frame whose `bytes` field at `path` holds `payload`, without copying the payload:
    /// the header, `msg` and the fields' keys and lengths are encoded into the buffer and the
    /// payload is handed to the stream whole ([`crate::SendHalf::write_chunk`]).
    ///
    /// `path` lists field numbers from the frame's message down to the payload field: `[6]` puts
    /// the payload in field 6 of `msg`; `[3, 6]` puts `msg` in field 3 of the frame's message
    /// (an enclosing message with no other field set, such as a `oneof` wrapper) and the payload
    /// in field 6 of `msg`. The receiver decodes exactly the nested message with that field set
    /// (protobuf fields may come in any order). `msg` must leave the payload field empty (a
    /// repeated field gets `payload` appended).
    pub async fn send_with_payload<M: Message>(
        &mut self,
        msg: &M,
        path: &[u32],
        payload: Bytes,
    ) -> Result<(), FrameError> {
        let keys = path
            .iter()
            .map(|&tag| {
                if (1..=MAX_FIELD_TAG).contains(&tag) {
                    Ok(len_delimited_key(tag))
                } else {
                    Err(FrameError::Io(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("protobuf field number {tag} is out of range"),
                    )))
                }
            })
            .collect::<Result<Vec<u64>, _>>()?;
        let Some((&payload_key, enclosing)) = keys.split_last() else {
            return Err(FrameError::Io(io::Error::new(io::ErrorKind::InvalidInput, "empty payload path")));
        };
        // From the inside out: `len` grows to the whole body; `bodies` holds the length that
        // follows each enclosing key (innermost first, reversed below to match `enclosing`).
        let mut len = msg.encoded_len()
            + prost::encoding::encoded_len_varint(payload_key)
            + prost::encoding::encoded_len_varint(payload.len() as u64)
            + payload.len();
        let mut bodies = Vec::with_capacity(enclosing.len());
        for &key in enclosing.iter().rev() {
            bodies.push(len);
            len += prost::encoding::encoded_len_varint(key) + prost::encoding::encoded_len_varint(len as u64);
        }
        bodies.reverse();
        if len > self.codec.limit() {
            return Err(FrameError::TooLarge { len: len as u64, max: self.codec.limit() });
        }
        self.buf.clear();
        self.buf.reserve(HEADER_BYTES + len - payload.len());
        self.buf.put_u32(len as u32);
        for (&key, &body) in enclosing.iter().zip(&bodies) {
            prost::encoding::encode_varint(key, &mut self.buf);
            prost::encoding::encode_varint(body as u64, &mut self.buf);
        }
        msg.encode(&mut self.buf).map_err(|e| io::Error::other(format!("encoding a frame: {e}")))?;
        prost::encoding::encode_varint(payload_key, &mut self.buf);
        prost::encoding::encode_varint(payload.len() as u64, &mut self.buf);
        self.inner.write_all(&self.buf).await?;
        if !payload.is_empty() {
            self.inner.write_chunk(payload).await?;
        }
        Ok(())
    }
}

/// Reads frames from an async stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    /// `None` after an error: the stream was dropped.
    inner: Option<R>,
    codec: FrameCodec,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader with the default limit.
    pub fn new(inner: R) -> Self {
        Self::with_codec(inner, FrameCodec::default())
    }

    /// A reader with `codec`'s limit.
    pub fn with_codec(inner: R, codec: FrameCodec) -> Self {
        FrameReader { inner: Some(inner), codec, buf: BytesMut::new() }
    }

    /// The next frame; `Ok(None)` at a clean end of stream (EOF between frames).
    ///
    /// On any error the stream is dropped and later calls fail with [`FrameError::Io`].
    pub async fn recv<M: Message + Default>(&mut self) -> Result<Option<M>, FrameError> {
        let result = self.recv_inner().await;
        if result.is_err() {
            self.inner = None;
            self.buf = BytesMut::new();
        }
        result
    }

    async fn recv_inner<M: Message + Default>(&mut self) -> Result<Option<M>, FrameError> {
        loop {
            // The length is checked (in `decode`/`body_len`) before the buffer grows for the body.
            if let Some(msg) = self.codec.decode(&mut self.buf)? {
                return Ok(Some(msg));
            }
            let body = self.codec.body_len(&self.buf)?;
            let want = HEADER_BYTES + body.unwrap_or(0);
            // Read the rest of this frame (so large bodies arrive in large reads), or a small
            // batch while the next header is unknown. Never past a large frame's end: what the
            // buffer holds beyond the frame split off would be copied again when it grows for the
            // next one (a capacity-sized overshoot, megabytes per KV block).
            let limit = match body {
                Some(_) if want > MIN_READ_BYTES => want - self.buf.len(),
                _ => want.saturating_sub(self.buf.len()).max(MIN_READ_BYTES.min(self.codec.limit() + HEADER_BYTES)),
            };
            self.buf.reserve(limit);
            let inner = self
                .inner
                .as_mut()
                .ok_or_else(|| io::Error::other("frame stream was closed after an earlier error"))?;
            let n = inner.read_buf(&mut (&mut self.buf).limit(limit)).await?;
            if n == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(FrameError::Truncated { have: self.buf.len(), want });
            }
        }
    }

    /// Bytes buffered but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The read buffer's capacity (tests check that a hostile header does not grow it).
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// The underlying stream, unless it was dropped after an error. Buffered bytes are lost.
    pub fn into_inner(self) -> Option<R> {
        self.inner
    }
}

impl<R: crate::RecvHalf> FrameReader<R> {
    /// The next frame, its bulk payload kept as the buffers it arrived in: the receiving side of
    /// [`FrameWriter::send_with_payload`]. `Ok(None)` at a clean end of stream.
    ///
    /// The frame is read with [`crate::RecvHalf::read_chunk`] (never past its end) and not joined
    /// into one buffer. When its `bytes` field at `path` is the body's last field, with each
    /// enclosing message (`path`'s leading field numbers) the only field of its parent, the
    /// message comes back without that field and the field's bytes as the [`Payload`]; any other
    /// valid encoding (or a frame that arrived in one buffer) decodes whole, the payload inside
    /// the message, and `None`. Either way it is the same message, and errors are [`Self::recv`]'s.
    pub async fn recv_with_payload<M: Message + Default>(
        &mut self,
        path: &[u32],
    ) -> Result<Option<(M, Option<Payload>)>, FrameError> {
        let result = self.recv_payload_inner(path).await;
        if result.is_err() {
            self.inner = None;
            self.buf = BytesMut::new();
        }
        result
    }

    async fn recv_payload_inner<M: Message + Default>(
        &mut self,
        path: &[u32],
    ) -> Result<Option<(M, Option<Payload>)>, FrameError> {
        let mut header = Payload::new();
        if !self.fill(&mut header, HEADER_BYTES).await? {
            if header.is_empty() {
                return Ok(None);
            }
            return Err(FrameError::Truncated { have: header.len(), want: HEADER_BYTES });
        }
        let len = self.codec.body_len(&header.to_bytes())?.unwrap_or_default();
        let mut body = Payload::new();
        if !self.fill(&mut body, len).await? {
            return Err(FrameError::Truncated { have: HEADER_BYTES + body.len(), want: HEADER_BYTES + len });
        }
        if body.chunks().len() > 1 {
            if let Some((head, payload)) = split_payload(&body, path) {
                return Ok(Some((M::decode(head)?, Some(payload))));
            }
        }
        Ok(Some((M::decode(body.to_bytes())?, None)))
    }

    /// Append the stream's next bytes to `dst` until it holds `want` (buffered bytes first, then
    /// chunks of at most what is missing); `false` if the stream ended first.
    async fn fill(&mut self, dst: &mut Payload, want: usize) -> io::Result<bool> {
        while dst.len() < want {
            let missing = want - dst.len();
            if !self.buf.is_empty() {
                dst.push(self.buf.split_to(missing.min(self.buf.len())).freeze());
                continue;
            }
            let inner = self
                .inner
                .as_mut()
                .ok_or_else(|| io::Error::other("frame stream was closed after an earlier error"))?;
            match inner.read_chunk(missing).await? {
                Some(chunk) if chunk.len() > missing => {
                    return Err(io::Error::other(format!(
                        "the stream returned {} bytes where at most {missing} were asked for",
                        chunk.len()
                    )))
                }
                Some(chunk) => dst.push(chunk),
                None => return Ok(false),
            }
        }
        Ok(true)
    }
}

/// Split a frame body into its message without the `bytes` field at `path` (re-encoded, small)
/// and that field's bytes, if the field is the body's last and each enclosing field is the only
/// one of its message (the layout [`FrameWriter::send_with_payload`] writes); `None` otherwise.
fn split_payload(body: &Payload, path: &[u32]) -> Option<(Bytes, Payload)> {
    let (&payload_tag, enclosing) = path.split_last()?;
    let mut cur = Cursor::new(body.chunks());
    for &tag in enclosing {
        let key = prost::encoding::decode_varint(&mut cur).ok()?;
        let len = prost::encoding::decode_varint(&mut cur).ok()?;
        if key != len_delimited_key(tag) || len != cur.remaining() as u64 {
            return None;
        }
    }
    let inner_start = cur.offset();
    let inner_end = loop {
        if !cur.has_remaining() {
            return None; // no payload field
        }
        let field_start = cur.offset();
        let key = prost::encoding::decode_varint(&mut cur).ok()?;
        let skip = match key & 7 {
            0 => {
                prost::encoding::decode_varint(&mut cur).ok()?;
                0
            }
            1 => 8,
            2 => {
                let len = prost::encoding::decode_varint(&mut cur).ok()?;
                if key >> 3 == u64::from(payload_tag) {
                    if len != cur.remaining() as u64 {
                        return None; // not the last field
                    }
                    break field_start;
                }
                usize::try_from(len).ok()?
            }
            5 => 4,
            _ => return None, // groups: leave them to prost
        };
        if skip > cur.remaining() {
            return None;
        }
        cur.advance(skip);
    };
    let payload: Payload = Cursor::new(body.chunks()).slices(cur.offset(), body.len()).collect();
    let mut head = BytesMut::with_capacity(inner_end - inner_start + 16 * enclosing.len());
    for c in Cursor::new(body.chunks()).slices(inner_start, inner_end) {
        head.extend_from_slice(&c);
    }
    for &tag in enclosing.iter().rev() {
        let mut outer = BytesMut::with_capacity(head.len() + 16);
        prost::encoding::encode_varint(len_delimited_key(tag), &mut outer);
        prost::encoding::encode_varint(head.len() as u64, &mut outer);
        outer.extend_from_slice(&head);
        head = outer;
    }
    Some((head.freeze(), payload))
}

/// A [`Buf`] over a list of buffers (protobuf varints may straddle two of them).
struct Cursor<'a> {
    chunks: &'a [Bytes],
    /// Index of the current chunk and the position within it.
    index: usize,
    at: usize,
    /// Bytes consumed before the current chunk.
    before: usize,
    total: usize,
}

impl<'a> Cursor<'a> {
    fn new(chunks: &'a [Bytes]) -> Cursor<'a> {
        let total = chunks.iter().map(Bytes::len).sum();
        let mut c = Cursor { chunks, index: 0, at: 0, before: 0, total };
        c.skip_exhausted();
        c
    }

    fn offset(&self) -> usize {
        self.before + self.at
    }

    fn skip_exhausted(&mut self) {
        while self.index < self.chunks.len() && self.at == self.chunks[self.index].len() {
            self.before += self.chunks[self.index].len();
            self.index += 1;
            self.at = 0;
        }
    }

    /// The bytes between offsets `from` and `to` as slices of the chunks (no copy).
    fn slices(self, from: usize, to: usize) -> impl Iterator<Item = Bytes> + 'a {
        let mut start = 0;
        self.chunks.iter().filter_map(move |c| {
            let (lo, hi) = (start, start + c.len());
            start = hi;
            let (a, b) = (from.max(lo), to.min(hi));
            (a < b).then(|| c.slice(a - lo..b - lo))
        })
    }
}

impl Buf for Cursor<'_> {
    fn remaining(&self) -> usize {
        self.total - self.offset()
    }

    fn chunk(&self) -> &[u8] {
        self.chunks.get(self.index).map_or(&[], |c| &c[self.at..])
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining(), "advancing past the end");
        while cnt > 0 {
            let step = cnt.min(self.chunks[self.index].len() - self.at);
            self.at += step;
            cnt -= step;
            self.skip_exhausted();
        }
    }
}

#[cfg(test)]
mod tests;
