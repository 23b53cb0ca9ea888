//! kvfleet-proto: the gRPC services of `kvfleet.v1` (`Worker`, `Coordinator`; tonic clients and
//! servers) over the protobuf messages of `kvfleet-wire`.
//!
//! Every message, and its conversions to `kvfleet-core` types, lives in `kvfleet-wire` (no RPC
//! stack, so the sans-IO crates can use it); this crate re-exports it under the same paths
//! (`kvfleet_proto::v1::RequestSpec` is `kvfleet_wire::v1::RequestSpec`) and adds what needs tonic:
//! the services, and validation failures as `Status::invalid_argument`.

#![warn(missing_docs)]

/// `kvfleet.v1`: the messages of [`kvfleet_wire::v1`] and the generated services
/// (`worker_client`, `worker_server`, `coordinator_client`, `coordinator_server`).
#[allow(missing_docs)]
pub mod v1 {
    pub use kvfleet_wire::v1::*;
    tonic::include_proto!("kvfleet.v1");
}

pub use kvfleet_wire::migration;
pub use kvfleet_wire::{
    kv_events_from_proto, kv_events_to_proto, InvalidField, MAX_TOKENS_PER_REQUEST, REFUSED_PREFIX,
};

use kvfleet_core::RequestSpec;

/// A message that failed validation, as the gRPC status to answer with (names the field).
pub fn invalid_argument(e: InvalidField) -> tonic::Status {
    tonic::Status::invalid_argument(e.to_string())
}

/// The `spec` field of a message that must carry one, validated; `invalid_argument` otherwise
/// ([`kvfleet_wire::require_spec`] for the `InvalidField` itself).
pub fn require_spec(spec: Option<&v1::RequestSpec>) -> Result<RequestSpec, tonic::Status> {
    kvfleet_wire::require_spec(spec).map_err(invalid_argument)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_specs_are_invalid_arguments_naming_the_field() {
        let status = require_spec(None).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("`spec`"), "{}", status.message());
        let bad = v1::RequestSpec { id: 1, answer_tokens: 0, ..Default::default() };
        assert!(require_spec(Some(&bad)).unwrap_err().message().contains("spec.answer_tokens"));
    }

    #[test]
    fn services_use_the_wire_types() {
        // `kvfleet_proto::v1::X` is `kvfleet_wire::v1::X` (a re-export, not a second copy).
        fn takes(_: tonic::Request<kvfleet_wire::v1::InfoRequest>) {}
        let req: tonic::Request<v1::InfoRequest> = tonic::Request::new(v1::InfoRequest::default());
        takes(req);
    }
}
