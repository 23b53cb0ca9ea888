//! Generates the gRPC services of `kvfleet.v1` (tonic). The messages are not generated again:
//! `extern_path` points the service code at the types in `kvfleet-wire`, whose `proto/` directory
//! holds the one copy of the .proto files.
fn main() {
    println!("cargo:rerun-if-changed=../wire/proto/kvfleet.proto");
    // Needs `protoc` (Debian: protobuf-compiler); scripts/lib/install-deps.sh installs it.
    tonic_prost_build::configure()
        .extern_path(".kvfleet.v1", "::kvfleet_wire::v1")
        .extern_path(".kvfleet.migration.v1", "::kvfleet_wire::migration")
        .compile_protos(&["../wire/proto/kvfleet.proto"], &["../wire/proto/"])
        .expect("compile ../wire/proto/kvfleet.proto (is protoc installed?)");
}
