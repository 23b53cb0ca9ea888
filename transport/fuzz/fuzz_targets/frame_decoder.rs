//! Arbitrary bytes into the frame decoder: it must never panic, every step must either consume
//! a frame or stop, and whatever decodes must re-encode to a frame that decodes to itself.
#![no_main]

use bytes::BytesMut;
use kvfleet_transport::frame::{FrameCodec, FrameError};
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// Every wire type and a few shapes a KV transfer frame has (ids, payload, strings, nesting).
#[derive(Clone, PartialEq, prost::Message)]
struct Frame {
    #[prost(uint64, tag = "1")]
    request: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: bytes::Bytes,
    #[prost(string, tag = "3")]
    note: String,
    #[prost(fixed64, repeated, tag = "4")]
    checksums: Vec<u64>,
    #[prost(message, optional, tag = "5")]
    inner: Option<Inner>,
    #[prost(sint32, tag = "6")]
    stage: i32,
    #[prost(fixed32, tag = "7")]
    flags: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Inner {
    #[prost(uint32, repeated, tag = "1")]
    blocks: Vec<u32>,
    #[prost(bool, tag = "2")]
    last: bool,
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the limit (× 256 bytes) so that both the TooLarge path and accepted
    // frames are reached.
    let (limit, wire) = match data.split_first() {
        Some((l, rest)) => (usize::from(*l) << 8, rest),
        None => (0, data),
    };
    let codec = FrameCodec::new(limit);
    let mut buf = BytesMut::from(wire);
    loop {
        let before = buf.len();
        match codec.decode::<Frame>(&mut buf) {
            Ok(Some(frame)) => {
                assert!(buf.len() < before, "a frame was returned without consuming input");
                let mut again = BytesMut::new();
                if codec.encode(&frame, &mut again).is_ok() {
                    let decoded = codec.decode::<Frame>(&mut again).expect("re-encoded frame decodes");
                    assert_eq!(decoded.as_ref(), Some(&frame));
                    assert!(again.is_empty());
                } else {
                    // Re-encoding can only exceed the limit if the canonical form is longer.
                    assert!(frame.encoded_len() > limit);
                }
            }
            Err(FrameError::Malformed(_)) => assert!(buf.len() < before, "a malformed frame was not consumed"),
            Ok(None) => {
                assert_eq!(buf.len(), before);
                break;
            }
            Err(FrameError::TooLarge { len, max }) => {
                assert!(len > max as u64);
                break;
            }
            Err(e) => panic!("the pure decoder cannot fail with {e}"),
        }
    }
});
