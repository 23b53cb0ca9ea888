fn main() {
    println!("cargo:rerun-if-changed=proto/kvfleet.proto");
    // prost-build needs `protoc` (Debian: protobuf-compiler); `.ci/run` and scripts/quickstart.sh install it.
    prost_build::compile_protos(&["proto/kvfleet.proto"], &["proto/"]).expect("compile kvfleet.proto (is protoc installed?)");
}
