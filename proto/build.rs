fn main() {
    println!("cargo:rerun-if-changed=proto/kvfleet.proto");
    // Needs `protoc` (Debian: protobuf-compiler); scripts/lib/install-deps.sh installs it.
    tonic_prost_build::configure()
        .compile_protos(&["proto/kvfleet.proto"], &["proto/"])
        .expect("compile proto/kvfleet.proto (is protoc installed?)");
}
