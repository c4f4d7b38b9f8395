//! Generates the message types from proto/*.proto: prost structs (protox parses the files, so no
//! protoc is needed) and serde implementations following the protobuf JSON mapping (pbjson), which is
//! what E2B's Connect clients speak.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let files = [root.join("process.proto"), root.join("filesystem.proto")];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor = out.join("descriptor.bin");
    std::fs::write(&descriptor, prost::Message::encode_to_vec(&fds))?;
    prost_build::Config::new()
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(fds)?;
    let set = std::fs::read(&descriptor)?;
    pbjson_build::Builder::new()
        .register_descriptors(&set)?
        // Newer clients may send fields this version does not know; Connect's JSON codec ignores them.
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
