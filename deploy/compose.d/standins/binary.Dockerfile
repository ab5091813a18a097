# The walletlock binary built on the host (`cargo build --release`, as deploy/local runs it), as an
# image holding /out/walletlock: deploy/compose builds it from a context holding only the binary,
# and passes it to deploy/Dockerfile as BINARY_IMAGE where no Rust image can be pulled.
FROM scratch
COPY walletlock /out/walletlock
