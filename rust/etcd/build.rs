//! Generates the etcd v3 gRPC client from etcd's API definitions in `proto/` (taken from
//! etcd's `api/etcdserverpb`, with the gogoproto and HTTP-gateway options removed). protox
//! parses them in Rust, so building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(["proto/rpc.proto"], ["proto"])?;
    tonic_build::configure().build_server(false).compile_fds(descriptors)?;
    Ok(())
}
