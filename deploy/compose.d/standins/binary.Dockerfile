# The binary `cargo build --release` made on the host, at /out/walletlock: BINARY_IMAGE for
# deploy/Dockerfile where no Rust image can be pulled.
FROM scratch
COPY walletlock /out/walletlock
