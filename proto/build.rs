fn main() {
    println!("cargo:rerun-if-changed=proto/kvfleet.proto");
    println!("cargo:rerun-if-changed=proto/migration.proto");
    // Needs `protoc` (Debian: protobuf-compiler); scripts/lib/install-deps.sh installs it.
    tonic_prost_build::configure()
        // KV blocks and request state are handed around without copying (`bytes::Bytes`).
        .bytes(".kvfleet.migration.v1.BlockData.data")
        .bytes(".kvfleet.migration.v1.Commit.state")
        .compile_protos(&["proto/kvfleet.proto", "proto/migration.proto"], &["proto/"])
        .expect("compile proto/kvfleet.proto and proto/migration.proto (is protoc installed?)");
}
