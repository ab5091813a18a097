//! A throwaway certificate authority for the TLS tests, made with `openssl` by the same
//! deploy/lib.sh functions `deploy/local up --tls` uses, in a temporary directory removed with it.
//!
//! Every certificate names `IP:127.0.0.1` and nothing else, so a client that asks for `localhost`
//! meets a certificate for another host: the wrong-host case needs no second server.

use super::fleet::lib_sh;
use std::path::PathBuf;
use tempfile::TempDir;

pub struct TestCa {
    dir: TempDir,
}

impl TestCa {
    /// The CA, a server certificate (Redis nodes, Postgres, nginx) and the replicas' client
    /// certificate.
    pub fn new() -> Self {
        let dir = TempDir::new().expect("temp dir");
        let d = dir.path().display();
        lib_sh(&format!(
            "wl_tls_ca {d} && wl_tls_issue {d} server IP:127.0.0.1 && wl_tls_issue {d} nginx IP:127.0.0.1 \
             && wl_tls_issue {d} replica DNS:walletlock-replica"
        ));
        Self { dir }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    pub fn file(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// The PEM of the CA's certificate.
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.file("ca.pem")).expect("ca.pem")
    }

    /// `redis-server` arguments for a TLS-only node with the server certificate, listening on
    /// `port` (after its `--port`).
    pub fn redis_args(&self, port: u16) -> Vec<String> {
        let mut args: Vec<String> =
            lib_sh(&format!("wl_redis_tls_args {} server", self.dir.path().display()))
                .lines()
                .map(str::to_owned)
                .collect();
        args.extend(["--tls-port".to_owned(), port.to_string()]);
        args
    }

    /// The same settings as lines of a Sentinel's config file.
    pub fn sentinel_config(&self, port: u16) -> String {
        let lines = lib_sh(&format!("wl_redis_tls_conf {} server", self.dir.path().display()));
        format!("{lines}tls-port {port}\n")
    }

    /// `redis-cli` arguments to reach a node of this CA, with the replicas' client certificate.
    pub fn redis_cli_args(&self) -> Vec<String> {
        [
            "--tls",
            "--cacert",
            &self.file("ca.pem"),
            "--cert",
            &self.file("replica.pem"),
            "--key",
            &self.file("replica.key"),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// A replica's Redis TLS settings: verify against this CA, present the client certificate.
    pub fn replica_env(&self) -> Vec<(String, String)> {
        vec![
            ("REDIS_TLS_CA_FILE".into(), self.file("ca.pem")),
            ("REDIS_TLS_CERT_FILE".into(), self.file("replica.pem")),
            ("REDIS_TLS_KEY_FILE".into(), self.file("replica.key")),
        ]
    }

    /// The query that makes a Postgres URL verify the server against this CA, host name included.
    pub fn postgres_query(&self) -> String {
        format!("sslmode=verify-full&sslrootcert={}", self.file("ca.pem"))
    }
}
