use super::*;
use proptest::prelude::*;

/// A message shaped like a KV transfer frame: an id, a large bytes payload, a string.
#[derive(Clone, PartialEq, prost::Message)]
struct Block {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: Bytes,
    #[prost(string, tag = "3")]
    note: String,
}

fn block(id: u64, len: usize) -> Block {
    Block {
        id,
        data: Bytes::from((0..len).map(|i| (i as u64 * 31 + id) as u8).collect::<Vec<_>>()),
        note: format!("b{id}"),
    }
}

fn header(len: u32) -> BytesMut {
    BytesMut::from(&len.to_be_bytes()[..])
}

#[test]
fn frames_round_trip_and_partial_input_waits() {
    let mut wire = BytesMut::new();
    let msgs = [block(1, 0), block(2, 1000), block(3, 70_000)];
    for m in &msgs {
        encode(m, &mut wire).unwrap();
    }
    let total = wire.len();
    // Byte by byte: None until a frame is complete, then exactly that frame.
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for b in wire.iter() {
        buf.put_u8(*b);
        if let Some(m) = decode::<Block>(&mut buf).unwrap() {
            out.push(m);
        }
    }
    assert_eq!(out, msgs);
    assert!(buf.is_empty());
    assert_eq!(total, msgs.iter().map(|m| HEADER_BYTES + m.encoded_len()).sum::<usize>());
}

#[test]
fn decoded_bytes_fields_borrow_the_read_buffer() {
    let mut wire = BytesMut::new();
    encode(&block(7, 4096), &mut wire).unwrap();
    let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
    let m: Block = decode(&mut wire).unwrap().unwrap();
    assert!(range.contains(&(m.data.as_ptr() as usize)), "payload was copied out of the frame buffer");
}

#[test]
fn oversized_header_is_rejected_before_the_body_without_consuming() {
    let codec = FrameCodec::new(1024);
    let mut buf = header(1025);
    buf.extend_from_slice(b"abc");
    let cap = buf.capacity();
    match codec.decode::<Block>(&mut buf) {
        Err(FrameError::TooLarge { len: 1025, max: 1024 }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(buf.len(), 7, "nothing consumed");
    assert_eq!(buf.capacity(), cap, "nothing allocated");
    // The largest header possible under the default limit.
    let mut buf = header(u32::MAX);
    assert!(matches!(decode::<Block>(&mut buf), Err(FrameError::TooLarge { len, .. }) if len == u64::from(u32::MAX)));
}

#[test]
fn garbage_body_is_malformed_and_consumed() {
    let mut buf = header(4);
    buf.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
    encode(&block(9, 3), &mut buf).unwrap();
    assert!(matches!(decode::<Block>(&mut buf), Err(FrameError::Malformed(_))));
    // The bad frame is gone; the next one is intact.
    assert_eq!(decode::<Block>(&mut buf).unwrap(), Some(block(9, 3)));
}

#[test]
fn encoding_over_the_limit_fails_and_writes_nothing() {
    let codec = FrameCodec::new(100);
    let mut buf = BytesMut::new();
    assert!(matches!(codec.encode(&block(1, 200), &mut buf), Err(FrameError::TooLarge { max: 100, .. })));
    assert!(buf.is_empty());
    assert_eq!(FrameCodec::new(usize::MAX).max_frame_bytes, u32::MAX as usize);
}

#[tokio::test]
async fn reader_and_writer_round_trip_with_clean_eof() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let msgs: Vec<Block> = (0..20).map(|i| block(i, (i as usize * 7919) % 300_000)).collect();
    let sent = msgs.clone();
    let writer = tokio::spawn(async move {
        let mut w = FrameWriter::new(a);
        for m in &sent {
            w.send(m).await.unwrap();
        }
        w.finish().await.unwrap();
    });
    let mut r = FrameReader::new(b);
    let mut got = Vec::new();
    while let Some(m) = r.recv::<Block>().await.unwrap() {
        got.push(m);
    }
    writer.await.unwrap();
    assert_eq!(got, msgs);
    // EOF is sticky and clean.
    assert!(r.recv::<Block>().await.unwrap().is_none());
}

#[tokio::test]
async fn payload_frames_decode_as_the_message_with_the_field_set() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let big = block(5, 200_000);
    let writer = tokio::spawn(async move {
        let mut w = FrameWriter::with_codec(a, FrameCodec::new(300_000));
        let head = Block { data: Bytes::new(), ..big.clone() };
        w.send_with_payload(&head, &[2], big.data.clone()).await.unwrap();
        w.send_with_payload(&Block::default(), &[2], Bytes::new()).await.unwrap();
        // Over the limit with the payload counted: refused before anything is written.
        let too_big = Bytes::from(vec![0u8; 300_000]);
        assert!(matches!(w.send_with_payload(&head, &[2], too_big).await, Err(FrameError::TooLarge { .. })));
        for bad in [&[0u32][..], &[], &[1 << 29], &[2, 0]] {
            let sent = w.send_with_payload(&head, bad, Bytes::from_static(b"x")).await;
            assert!(matches!(sent, Err(FrameError::Io(_))), "path {bad:?}: {sent:?}");
        }
        w.send(&block(6, 10)).await.unwrap();
        w.finish().await.unwrap();
    });
    let mut r = FrameReader::new(b);
    assert_eq!(r.recv::<Block>().await.unwrap(), Some(block(5, 200_000)));
    assert_eq!(r.recv::<Block>().await.unwrap(), Some(Block::default()));
    assert_eq!(r.recv::<Block>().await.unwrap(), Some(block(6, 10)));
    assert_eq!(r.recv::<Block>().await.unwrap(), None);
    writer.await.unwrap();
}

/// A `oneof` wrapper around [`Block`], shaped like the migration protocol's `Frame`.
#[derive(Clone, PartialEq, prost::Message)]
struct Wrapper {
    #[prost(oneof = "Wrapped", tags = "1, 7")]
    body: Option<Wrapped>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Wrapped {
    #[prost(uint64, tag = "1")]
    Other(u64),
    #[prost(message, tag = "7")]
    Block(Block),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A payload nested one message deep (the KV block inside `Frame.block_data`) decodes as the
    /// whole message, at every payload and message size, including lengths whose varints change
    /// width (127/128, 16383/16384 bytes).
    #[test]
    fn nested_payload_frames_decode_as_the_whole_message(
        id in any::<u64>(),
        len in prop_oneof![0usize..300, 16_250usize..16_500, 120usize..140],
        note_len in 0usize..200,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let full = Block { note: "n".repeat(note_len), ..block(id, len) };
        let got = rt.block_on(async {
            let (a, b) = tokio::io::duplex(1 << 20);
            let mut w = FrameWriter::new(a);
            let head = Block { data: Bytes::new(), ..full.clone() };
            w.send_with_payload(&head, &[7, 2], full.data.clone()).await.unwrap();
            w.finish().await.unwrap();
            FrameReader::new(b).recv::<Wrapper>().await.unwrap()
        });
        prop_assert_eq!(got, Some(Wrapper { body: Some(Wrapped::Block(full)) }));
    }
}

#[tokio::test]
async fn eof_inside_a_frame_is_truncated() {
    for cut in [1, 3, 4, 5, 50] {
        let mut wire = BytesMut::new();
        encode(&block(1, 60), &mut wire).unwrap();
        let want = if cut < HEADER_BYTES { HEADER_BYTES } else { wire.len() };
        let mut r = FrameReader::new(&wire[..cut]);
        match r.recv::<Block>().await {
            Err(FrameError::Truncated { have, want: w }) => assert_eq!((have, w), (cut, want), "cut at {cut}"),
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn hostile_header_does_not_grow_the_buffer_and_closes_the_stream() {
    let (mut peer, ours) = tokio::io::duplex(1 << 16);
    // Announce 1 GiB (over the 64 MiB default) and keep the stream open.
    peer.write_all(&(1u32 << 30).to_be_bytes()).await.unwrap();
    let mut r = FrameReader::new(ours);
    match r.recv::<Block>().await {
        Err(FrameError::TooLarge { len, max }) => assert_eq!((len, max), (1 << 30, DEFAULT_MAX_FRAME_BYTES)),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(r.buffer_capacity() < 1 << 20, "buffer grew to {}", r.buffer_capacity());
    // The reader dropped its stream: the peer's writes now fail instead of piling up.
    let err = peer.write_all(&[0u8; 16]).await.expect_err("stream should be closed");
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    assert!(matches!(r.recv::<Block>().await, Err(FrameError::Io(_))));
    assert!(r.into_inner().is_none());
}

#[tokio::test]
async fn garbage_on_a_stream_is_malformed_then_closed() {
    let mut wire = header(3);
    wire.extend_from_slice(&[0x0f, 0x0f, 0x0f]);
    let mut r = FrameReader::new(&wire[..]);
    assert!(matches!(r.recv::<Block>().await, Err(FrameError::Malformed(_))));
    assert!(matches!(r.recv::<Block>().await, Err(FrameError::Io(_))));
}

proptest! {
    /// Arbitrary bytes never panic the decoder; every outcome is None, a frame, or an error, and
    /// the loop always terminates (a frame is consumed, or it stops).
    #[test]
    fn decoder_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..4096), max in 0usize..2048) {
        let codec = FrameCodec::new(max);
        let mut buf = BytesMut::from(&data[..]);
        loop {
            let before = buf.len();
            match codec.decode::<Block>(&mut buf) {
                Ok(Some(_)) | Err(FrameError::Malformed(_)) => prop_assert!(buf.len() < before),
                Ok(None) => { prop_assert_eq!(buf.len(), before); break }
                Err(FrameError::TooLarge { len, .. }) => { prop_assert!(len > max as u64); break }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
    }

    /// A random length header in front of random bytes: TooLarge iff over the limit, else
    /// None (short), a frame, or Malformed; never a panic.
    #[test]
    fn random_headers_are_classified(len in any::<u32>(), body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let codec = FrameCodec::new(256);
        let mut buf = header(len);
        buf.extend_from_slice(&body);
        match codec.decode::<Block>(&mut buf) {
            Err(FrameError::TooLarge { .. }) => prop_assert!(len > 256),
            Ok(None) => prop_assert!(len <= 256 && (len as usize) > body.len()),
            Ok(Some(_)) | Err(FrameError::Malformed(_)) => prop_assert!(len <= 256 && (len as usize) <= body.len()),
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    /// A valid stream cut anywhere yields its complete frames in order, then a clean EOF (cut at
    /// a boundary) or Truncated (cut inside a frame).
    #[test]
    fn truncated_streams_yield_their_whole_frames(sizes in proptest::collection::vec(0usize..3000, 1..8), cut_frac in 0.0f64..=1.0) {
        let msgs: Vec<Block> = sizes.iter().enumerate().map(|(i, &n)| block(i as u64, n)).collect();
        let mut wire = BytesMut::new();
        let mut ends = Vec::new();
        for m in &msgs {
            encode(m, &mut wire).unwrap();
            ends.push(wire.len());
        }
        let cut = (wire.len() as f64 * cut_frac) as usize;
        let whole = ends.iter().filter(|&&e| e <= cut).count();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (got, last) = rt.block_on(async {
            let mut r = FrameReader::new(&wire[..cut]);
            let mut got = Vec::new();
            loop {
                match r.recv::<Block>().await {
                    Ok(Some(m)) => got.push(m),
                    other => return (got, other),
                }
            }
        });
        prop_assert_eq!(&got[..], &msgs[..whole]);
        let at_boundary = cut == 0 || ends.contains(&cut);
        match last {
            Ok(None) => prop_assert!(at_boundary),
            Err(FrameError::Truncated { have, .. }) => {
                prop_assert!(!at_boundary);
                prop_assert_eq!(have, cut - if whole == 0 { 0 } else { ends[whole - 1] });
            }
            other => prop_assert!(false, "unexpected {:?}", other),
        }
    }
}

/// A stream that hands out fixed buffers: `read_chunk` returns slices of them (as QUIC does),
/// `AsyncRead` copies. `cuts` split the wire into the buffers.
struct Chunked {
    chunks: std::collections::VecDeque<Bytes>,
}

impl Chunked {
    fn new(wire: &[u8], cuts: &[usize]) -> Chunked {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        cuts.sort_unstable();
        let mut at = 0;
        let mut chunks = std::collections::VecDeque::new();
        for c in cuts.into_iter().chain([wire.len()]) {
            if c > at {
                chunks.push_back(Bytes::copy_from_slice(&wire[at..c]));
            }
            at = c;
        }
        Chunked { chunks }
    }
}

impl tokio::io::AsyncRead for Chunked {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        if let Some(front) = self.chunks.front_mut() {
            let n = front.len().min(buf.remaining());
            buf.put_slice(&front.split_to(n));
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        std::task::Poll::Ready(Ok(()))
    }
}

impl crate::RecvHalf for Chunked {
    fn read_chunk(&mut self, max: usize) -> crate::BoxFuture<'_, io::Result<Option<Bytes>>> {
        let chunk = self.chunks.front_mut().map(|front| front.split_to(max.min(front.len())));
        if self.chunks.front().is_some_and(Bytes::is_empty) {
            self.chunks.pop_front();
        }
        Box::pin(std::future::ready(Ok(chunk)))
    }
}

/// Put a separately returned payload back where the sender took it from.
fn rejoin(w: Wrapper, payload: Option<Payload>) -> Wrapper {
    match (w, payload) {
        (Wrapper { body: Some(Wrapped::Block(b)) }, Some(p)) => {
            assert!(b.data.is_empty(), "the payload came back twice");
            Wrapper { body: Some(Wrapped::Block(Block { data: p.to_bytes(), ..b })) }
        }
        (w, None) => w,
        (w, Some(_)) => panic!("a payload beside a frame without the field: {w:?}"),
    }
}

/// How a test frame is written.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `send_with_payload` at `[7, 2]`: the payload last (split off when it arrives in pieces).
    Split,
    /// `send`: prost's field order puts `note` after `data` (decoded whole).
    Whole,
    /// Another message (no payload field).
    Other,
}

fn wrapped(id: u64, len: usize, note_len: usize) -> Wrapper {
    Wrapper { body: Some(Wrapped::Block(Block { note: "n".repeat(note_len), ..block(id, len) })) }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Frames of every layout, cut into random buffers, read with `recv_with_payload` (and, every
    /// third frame, `recv`): each comes back as the message sent; a split-layout frame that
    /// arrived in several buffers comes back with its payload apart, as slices of those buffers
    /// (until a `recv` read ahead).
    #[test]
    fn payload_reads_return_every_frame_as_sent(
        frames in proptest::collection::vec(
            (prop_oneof![Just(Layout::Split), Just(Layout::Whole), Just(Layout::Other)], 0usize..20_000, 0usize..200),
            1..6,
        ),
        cuts in proptest::collection::vec(any::<usize>(), 0..40),
        mix_recv in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let sent: Vec<(Layout, Wrapper)> = frames
            .iter()
            .enumerate()
            .map(|(i, &(layout, len, note))| match layout {
                Layout::Other => (layout, Wrapper { body: Some(Wrapped::Other(i as u64)) }),
                _ => (layout, wrapped(i as u64, len, note)),
            })
            .collect();
        let wire = rt.block_on(async {
            let (a, mut b) = tokio::io::duplex(1 << 22);
            let mut w = FrameWriter::new(a);
            for (layout, m) in &sent {
                match (layout, &m.body) {
                    (Layout::Split, Some(Wrapped::Block(blk))) => {
                        let head = Block { data: Bytes::new(), ..blk.clone() };
                        w.send_with_payload(&head, &[7, 2], blk.data.clone()).await.unwrap();
                    }
                    _ => w.send(m).await.unwrap(),
                }
            }
            w.finish().await.unwrap();
            let mut wire = Vec::new();
            b.read_to_end(&mut wire).await.unwrap();
            wire
        });
        let source = Chunked::new(&wire, &cuts);
        let buffers: Vec<Bytes> = source.chunks.iter().cloned().collect();
        // Where each frame's body lies on the wire, and where the buffers end.
        let mut bodies = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let len = u32::from_be_bytes(wire[at..at + 4].try_into().unwrap()) as usize;
            bodies.push(at + HEADER_BYTES..at + HEADER_BYTES + len);
            at += HEADER_BYTES + len;
        }
        let ends: Vec<usize> = buffers.iter().scan(0, |end, b| { *end += b.len(); Some(*end) }).collect();
        let mut r = FrameReader::new(source);
        for (i, (layout, want)) in sent.iter().enumerate() {
            let (got, payload) = rt.block_on(async {
                if mix_recv && i % 3 == 2 {
                    (r.recv::<Wrapper>().await.unwrap().unwrap(), None)
                } else {
                    r.recv_with_payload::<Wrapper>(&[7, 2]).await.unwrap().unwrap()
                }
            });
            // (After a `recv`, which reads ahead through `AsyncRead`, the bytes are copies.)
            let recv_before = mix_recv && i > 2;
            let in_pieces = ends.iter().any(|e| bodies[i].start < *e && *e < bodies[i].end);
            if matches!(layout, Layout::Split) && in_pieces && !recv_before && !(mix_recv && i % 3 == 2) {
                prop_assert!(payload.is_some(), "frame {i}: written split, arrived in pieces, decoded whole");
            }
            if let Some(p) = &payload {
                // prost's own order puts the data last when the note is empty: split too.
                let data_last = matches!(&want.body, Some(Wrapped::Block(b)) if b.note.is_empty());
                prop_assert!(matches!(layout, Layout::Split) || data_last, "frame {i}: split though written {layout:?}");
                for c in p.chunks().iter().filter(|_| !recv_before) {
                    let within = buffers.iter().any(|b| {
                        let (lo, p) = (b.as_ptr() as usize, c.as_ptr() as usize);
                        p >= lo && p + c.len() <= lo + b.len()
                    });
                    prop_assert!(within, "frame {i}: a payload piece was copied");
                }
            }
            prop_assert_eq!(&rejoin(got, payload), want, "frame {}", i);
        }
        prop_assert!(rt.block_on(r.recv_with_payload::<Wrapper>(&[7, 2])).unwrap().is_none());
    }
}

#[test]
fn a_payload_is_split_off_only_where_it_is_the_last_field() {
    let body = |m: &Wrapper| -> Payload {
        let bytes = m.encode_to_vec();
        // Two pieces, so the split is tried.
        [Bytes::copy_from_slice(&bytes[..1]), Bytes::copy_from_slice(&bytes[1..])].into_iter().collect()
    };
    // prost writes `note` (3) after `data` (2): not last.
    assert!(split_payload(&body(&wrapped(1, 500, 3)), &[7, 2]).is_none());
    // Without a note the payload is last: split, and the head decodes to the message without it.
    let m = wrapped(1, 500, 0);
    let (head, payload) = split_payload(&body(&m), &[7, 2]).expect("split");
    assert_eq!(rejoin(Wrapper::decode(head).unwrap(), Some(payload)), m);
    // A wrong path, an empty one, or a different message: not split.
    assert!(split_payload(&body(&m), &[7, 3]).is_none());
    assert!(split_payload(&body(&m), &[6, 2]).is_none());
    assert!(split_payload(&body(&m), &[]).is_none());
    assert!(split_payload(&body(&Wrapper { body: Some(Wrapped::Other(9)) }), &[7, 2]).is_none());
    // An enclosing field followed by another field of its message: not split.
    let mut bytes = m.encode_to_vec();
    bytes.extend_from_slice(&[0x08, 0x01]); // field 1 (varint) = 1 after field 7
    let two: Payload = [Bytes::copy_from_slice(&bytes[..2]), Bytes::copy_from_slice(&bytes[2..])].into_iter().collect();
    assert!(split_payload(&two, &[7, 2]).is_none());
    // A group (wire type 3) before the payload: left to prost.
    let grouped: Payload =
        [Bytes::from_static(&[0x3a, 0x05, 0x1b, 0x1c]), Bytes::from_static(&[0x12, 0x01, 0xaa])].into_iter().collect();
    assert!(split_payload(&grouped, &[7, 2]).is_none());
}

#[tokio::test]
async fn payload_reads_reject_bad_frames_and_close_the_stream() {
    // Truncated: in the header, in the head, inside the payload.
    let mut wire = Vec::new();
    {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut w = FrameWriter::new(a);
        w.send_with_payload(&Block::default(), &[7, 2], Bytes::from(vec![7u8; 5000])).await.unwrap();
        w.finish().await.unwrap();
        b.read_to_end(&mut wire).await.unwrap();
    }
    for cut in [2, 4, 6, 100, wire.len() - 1] {
        let mut r = FrameReader::new(Chunked::new(&wire[..cut], &[1, 5, 50]));
        match r.recv_with_payload::<Wrapper>(&[7, 2]).await {
            Err(FrameError::Truncated { have, want }) => {
                assert_eq!(have, cut, "cut at {cut}");
                assert_eq!(want, if cut < HEADER_BYTES { HEADER_BYTES } else { wire.len() });
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
        assert!(matches!(r.recv_with_payload::<Wrapper>(&[7, 2]).await, Err(FrameError::Io(_))));
    }
    // Over the limit: refused on the header, nothing of the body read.
    let mut r = FrameReader::with_codec(Chunked::new(&wire, &[]), FrameCodec::new(1000));
    assert!(matches!(
        r.recv_with_payload::<Wrapper>(&[7, 2]).await,
        Err(FrameError::TooLarge { len: 5006, max: 1000 })
    ));
    assert!(r.into_inner().is_none());
    // Garbage in pieces: malformed, then closed.
    let mut garbage = header(6).to_vec();
    garbage.extend_from_slice(&[0x3a, 0x04, 0x0f, 0x0f, 0x0f, 0x0f]);
    let mut r = FrameReader::new(Chunked::new(&garbage, &[5, 7]));
    assert!(matches!(r.recv_with_payload::<Wrapper>(&[7, 2]).await, Err(FrameError::Malformed(_))));
    assert!(matches!(r.recv_with_payload::<Wrapper>(&[7, 2]).await, Err(FrameError::Io(_))));
}

/// One field of a hand-encoded `Block` (in any order, repeated, or unknown to it).
#[derive(Clone, Debug)]
enum Field {
    Id(u64),
    Data(Vec<u8>),
    Note(String),
    Fixed32(u32),
    Fixed64(u64),
    Unknown(Vec<u8>),
}

fn encode_field(f: &Field, out: &mut Vec<u8>) {
    use prost::encoding::encode_varint as v;
    let len_delim = |tag: u64, bytes: &[u8], out: &mut Vec<u8>| {
        v(tag << 3 | 2, out);
        v(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    };
    match f {
        Field::Id(x) => {
            v(1 << 3, out);
            v(*x, out);
        }
        Field::Data(d) => len_delim(2, d, out),
        Field::Note(s) => len_delim(3, s.as_bytes(), out),
        Field::Fixed32(x) => {
            v(9 << 3 | 5, out);
            out.extend_from_slice(&x.to_le_bytes());
        }
        Field::Fixed64(x) => {
            v(10 << 3 | 1, out);
            out.extend_from_slice(&x.to_le_bytes());
        }
        Field::Unknown(d) => len_delim(11, d, out),
    }
}

fn any_field() -> impl Strategy<Value = Field> {
    prop_oneof![
        any::<u64>().prop_map(Field::Id),
        proptest::collection::vec(any::<u8>(), 0..600).prop_map(Field::Data),
        "[a-z]{0,20}".prop_map(Field::Note),
        any::<u32>().prop_map(Field::Fixed32),
        any::<u64>().prop_map(Field::Fixed64),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(Field::Unknown),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Splitting a payload off never changes what a frame means: for any field order, repeated
    /// and unknown fields, a trailing outer field, a flipped byte and any cut into buffers,
    /// whenever a split happens the head decodes exactly when the whole body does, and with the
    /// payload put back it is the same message.
    #[test]
    fn a_split_frame_means_what_the_whole_frame_means(
        fields in proptest::collection::vec(any_field(), 0..6),
        last in proptest::collection::vec(any::<u8>(), 0..3000),
        outer_extra in any::<bool>(),
        flip in proptest::option::of((any::<usize>(), 1u8..=255)),
        cuts in proptest::collection::vec(any::<usize>(), 1..12),
    ) {
        let mut inner = Vec::new();
        for f in fields.iter().chain([&Field::Data(last)]) {
            encode_field(f, &mut inner);
        }
        let mut body = Vec::new();
        prost::encoding::encode_varint(7 << 3 | 2, &mut body);
        prost::encoding::encode_varint(inner.len() as u64, &mut body);
        body.extend_from_slice(&inner);
        if outer_extra {
            encode_field(&Field::Id(3), &mut body);
        }
        if let Some((at, x)) = flip {
            let at = at % body.len();
            body[at] ^= x;
        }
        let pieces = Chunked::new(&body, &cuts).chunks.into_iter().collect::<Payload>();
        let whole = Wrapper::decode(&body[..]);
        if let Some((head, payload)) = split_payload(&pieces, &[7, 2]) {
            prop_assert!(!outer_extra || flip.is_some());
            match (Wrapper::decode(head), whole) {
                (Ok(h), Ok(w)) => prop_assert_eq!(rejoin(h, Some(payload)), w),
                (Err(_), Err(_)) => {}
                (h, w) => prop_assert!(false, "head {:?} but whole {:?}", h, w),
            }
        } else {
            // Unflipped, a lone data field at the end always splits (with the outer field absent).
            let lone_data_last = !fields.iter().any(|f| matches!(f, Field::Data(_)));
            prop_assert!(flip.is_some() || outer_extra || !lone_data_last);
        }
    }
}
