//! kvfleet-proto: generated protobuf types (`kvfleet.v1`) and their conversions to core types.

pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/kvfleet.v1.rs"));
}
