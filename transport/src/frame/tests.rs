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
