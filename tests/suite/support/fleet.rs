//! The fleet: the real `walletlock` binary as several replica processes behind a real nginx
//! running the top-level nginx.conf, all stopped by pid when the fleet is dropped.

use super::TestEnv;
use super::servers::{OwnedChild, free_port, listening, wait_until};
use super::tls::TestCa;
use nix::sys::signal::Signal;
use sqlx::PgPool;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use walletlock::ledger::schema::ScratchSchema;

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `walletlock audit` on `database_url`: whether the books balance, and what it printed.
pub fn audit(database_url: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .arg("audit")
        .env("DATABASE_URL", database_url)
        .output()
        .expect("walletlock audit");
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), report)
}

/// The bank check: `walletlock audit --acks`, with `acks` (what the clients were told, one
/// `ledger::books::Ack` each) as its file. Panics with its report unless the books balance and the
/// audit finds nothing.
pub fn audit_books(database_url: &str, acks: &[serde_json::Value]) {
    let mut file = tempfile::NamedTempFile::new().expect("a file for the acknowledgements");
    for ack in acks {
        writeln!(file, "{ack}").expect("an acknowledgement written");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .arg("audit")
        .arg("--acks")
        .arg(file.path())
        .env("DATABASE_URL", database_url)
        .output()
        .expect("walletlock audit --acks");
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && report.trim_end().ends_with(" OK"), "the bank check: {report}");
}

/// Runs a function of deploy/lib.sh, so tests and deploy/local share one way of doing it.
pub fn lib_sh(script: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("set -euo pipefail; source deploy/lib.sh; {script}"))
        .current_dir(repo())
        .output()
        .expect("bash");
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

pub struct Replica {
    pub name: String,
    pub port: u16,
    process: Option<OwnedChild>,
    log: PathBuf,
    /// The replica's environment; a test may change it before [`Replica::start`].
    pub env: Vec<(String, String)>,
}

/// Whether process `pid` is stopped (by SIGSTOP, or by a failpoint's `stop`), as `/proc` says.
pub fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
}

impl Replica {
    pub fn pid(&self) -> u32 {
        self.process.as_ref().expect("running").pid()
    }

    /// Waits until the replica, armed with a `:stop` failpoint, has stopped itself there while
    /// `request` (sent to it) is in flight. Bound by outcome: a request answered first fails the
    /// test with its answer and the replica's log (the failpoint was never reached), and only a
    /// replica neither stopped nor answering after 60 s fails it on time.
    pub async fn stopped_at_failpoint<T: std::fmt::Debug>(&self, what: &str, request: &mut JoinHandle<T>) {
        let (pid, deadline) = (self.pid(), std::time::Instant::now() + Duration::from_secs(60));
        while !is_stopped(pid) {
            if request.is_finished() {
                let answered = request.await;
                panic!("{what}: answered before it stopped at its failpoint: {answered:?}\n{}", self.log());
            }
            assert!(std::time::Instant::now() < deadline, "{what}: not within 60 s\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `signal` (SIGSTOP, SIGCONT...) to the replica.
    pub fn signal(&self, signal: Signal) {
        super::servers::signal(self.pid(), signal);
    }

    /// Stops the replica with `signal` and returns its exit status.
    pub fn stop_with(&mut self, signal: Signal) -> Option<std::process::ExitStatus> {
        let mut process = self.process.take()?;
        super::servers::signal(process.pid(), signal);
        process.0.wait().ok()
    }

    /// A URL on this replica directly, bypassing nginx.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Whether the process has exited (a failpoint aborted it, say).
    pub fn exited(&mut self) -> bool {
        self.process.as_mut().is_none_or(|p| matches!(p.0.try_wait(), Ok(Some(_))))
    }

    /// Starts the replica again (after a crash or a stop) and waits until it is ready.
    pub fn start(&mut self) {
        self.stop(Signal::SIGKILL);
        self.spawn();
        self.wait_ready();
    }

    /// Starts the replica again without waiting for it to be ready: it may never be, when a test
    /// has broken the way to its dependencies. Waits until it serves HTTP (`/healthz`).
    pub fn start_unready(&mut self) {
        self.stop(Signal::SIGKILL);
        self.spawn();
        let url = self.url("/healthz");
        wait_until(&format!("{} serving", self.name), Duration::from_secs(20), || {
            Command::new("curl")
                .args(["-fsS", "-o", "/dev/null", "--max-time", "1", &url])
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    /// Sets one environment variable for the next start; `None` removes it.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(value) = value {
            self.env.push((key.to_owned(), value.to_owned()));
        }
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_walletlock"))
            .arg("serve")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("walletlock serve");
        self.process = Some(OwnedChild(child));
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the replica answers /readyz.
    pub fn wait_ready(&self) {
        let url = format!("http://127.0.0.1:{}/readyz", self.port);
        wait_until(&format!("{} ready", self.name), Duration::from_secs(20), || {
            std::process::Command::new("curl")
                .args(["-fsS", "-o", "/dev/null", "--max-time", "1", &url])
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    /// Stops the replica with `signal` (SIGKILL: a crash; SIGTERM: a graceful stop).
    pub fn stop(&mut self, signal: Signal) {
        if let Some(mut process) = self.process.take() {
            process.stop(signal, Duration::from_secs(15));
        }
    }
}

pub struct Fleet {
    pub replicas: Vec<Replica>,
    /// The fleet's database (its schema first on the search path), for `walletlock audit`.
    pub database_url: String,
    pub nginx_port: u16,
    /// nginx's HTTPS listener, when the fleet has one (see [`Fleet::start_https`]).
    pub https_port: Option<u16>,
    pub db: PgPool,
    pub client: reqwest::Client,
    nginx: Option<OwnedChild>,
    /// Replica logs and nginx's files; removed with the fleet.
    _dir: TempDir,
    _schema: ScratchSchema,
}

impl Fleet {
    /// `count` replicas on one fresh schema, and nginx in front of them.
    pub async fn start(env: &TestEnv, count: usize, settings: &[(&str, &str)]) -> Fleet {
        Self::start_behind(env, count, settings, &[]).await
    }

    /// As [`Fleet::start`], with nginx prepared under `nginx_settings` (deploy/lib.sh's
    /// `WALLETLOCK_NGINX_*` variables, e.g. `WALLETLOCK_NGINX_MAX_CONNS`).
    pub async fn start_behind(
        env: &TestEnv,
        count: usize,
        settings: &[(&str, &str)],
        nginx_settings: &[(&str, &str)],
    ) -> Fleet {
        Self::launch(env, count, settings, nginx_settings, None).await
    }

    /// Like [`Fleet::start`], with nginx also listening for HTTPS (HTTP/2 allowed) with `ca`'s
    /// certificate, and a client that trusts `ca`.
    pub async fn start_https(env: &TestEnv, count: usize, settings: &[(&str, &str)], ca: &TestCa) -> Fleet {
        Self::launch(env, count, settings, &[], Some(ca)).await
    }

    async fn launch(
        env: &TestEnv,
        count: usize,
        settings: &[(&str, &str)],
        nginx_settings: &[(&str, &str)],
        https: Option<&TestCa>,
    ) -> Fleet {
        let (schema, db) = env.database(4).await;
        let dir = TempDir::new().expect("temp dir");
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let mut replicas = Vec::new();
        for n in 1..=count {
            let port = free_port();
            let mut vars: Vec<(String, String)> = vec![
                ("DATABASE_URL".into(), schema.url.clone()),
                ("REDIS_URL".into(), env.redis_url.clone()),
                ("REDIS_KEY_PREFIX".into(), env.prefix.clone()),
                ("LISTEN_ADDR".into(), format!("127.0.0.1:{port}")),
                ("REPLICA_NAME".into(), format!("replica-{n}")),
                ("LOG_FORMAT".into(), "json".into()),
                ("API_TOKENS".into(), super::API_TOKENS.into()),
                ("RUST_LOG".into(), "info".into()),
            ];
            vars.extend(settings.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            let log = dir.path().join(format!("replica-{n}.log"));
            let mut replica = Replica { name: format!("replica-{n}"), port, process: None, log, env: vars };
            replica.spawn();
            replicas.push(replica);
        }
        for replica in &replicas {
            replica.wait_ready();
        }

        let nginx_port = free_port();
        let nginx_dir = dir.path().join("nginx");
        let ports: Vec<String> = replicas.iter().map(|r| r.port.to_string()).collect();
        let https_port = https.map(|_| free_port());
        let mut nginx_env: String = nginx_settings.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        if let (Some(ca), Some(port)) = (https, https_port) {
            nginx_env += &format!(
                "WALLETLOCK_NGINX_HTTPS=127.0.0.1:{port} WALLETLOCK_NGINX_TLS_DIR={} ",
                ca.dir().display()
            );
        }
        lib_sh(&format!(
            "{nginx_env}WALLETLOCK_NGINX_STATUS_PORT={} wl_nginx_prepare {} 127.0.0.1:{nginx_port} {}",
            free_port(),
            nginx_dir.display(),
            ports.join(" ")
        ));
        let command: Vec<String> =
            lib_sh(&format!("wl_nginx_command {}", nginx_dir.display())).lines().map(str::to_owned).collect();
        // Appended to by every write: nginx's workers open its access log (/dev/stdout) anew, with
        // an offset of their own, while its errors go to the stderr it inherits; without O_APPEND
        // each error line overwrote access-log lines written since (a flood lost up to one in eight).
        let nginx_log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("nginx.log"))
            .expect("nginx log");
        let nginx = Command::new(&command[0])
            .args(&command[1..])
            .stdout(nginx_log.try_clone().expect("log"))
            .stderr(nginx_log)
            .stdin(Stdio::null())
            .spawn()
            .expect("nginx");
        wait_until("nginx", Duration::from_secs(60), || listening(nginx_port));

        let client = match https {
            Some(ca) => super::api_client_trusting(&ca.ca_pem()),
            None => super::api_client(),
        };
        let database_url = schema.url.clone();
        Fleet {
            replicas,
            database_url,
            nginx_port,
            https_port,
            db,
            client,
            nginx: Some(OwnedChild(nginx)),
            _dir: dir,
            _schema: schema,
        }
    }

    /// What each replica's `/readyz` says: (HTTP status, `status`, `payments`), asked of all at
    /// once (each may take its probe's bound while Redis hangs).
    pub async fn readiness(&self) -> Vec<(u16, String, String)> {
        futures::future::join_all(self.replicas.iter().map(|replica| async {
            let response = self.client.get(replica.url("/readyz")).send().await.expect("an answer");
            let code = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            let word = |field: &str| body[field].as_str().unwrap_or_default().to_owned();
            (code, word("status"), word("payments"))
        }))
        .await
    }

    /// nginx's error lines.
    pub fn nginx_errors(&self) -> String {
        let log = std::fs::read_to_string(self._dir.path().join("nginx.log")).unwrap_or_default();
        log.lines().filter(|line| !line.starts_with('{')).collect::<Vec<_>>().join("\n")
    }

    /// nginx's JSON access log, one object per line.
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self._dir.path().join("nginx.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    /// A URL through nginx.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.nginx_port)
    }

    /// The JSON body of `GET path` through nginx, whatever its status.
    pub async fn read(&self, path: &str) -> serde_json::Value {
        let response = self.client.get(self.url(path)).send().await.unwrap();
        response.json().await.unwrap()
    }

    /// A URL through nginx's HTTPS listener.
    pub fn https_url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.https_port.expect("a fleet with HTTPS"))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(mut nginx) = self.nginx.take() {
            nginx.stop(Signal::SIGQUIT, Duration::from_secs(5));
        }
        // The test is over: no need for a graceful drain (which would wait for the test client's
        // idle keep-alive connections to close).
        for replica in &mut self.replicas {
            replica.stop(Signal::SIGKILL);
        }
        // A failed test's cause is often in a replica's log (a 500's error), which goes with the
        // fleet's directory: keep its errors in the test's output (not tower-http's line for
        // each 5xx, which only repeats the status).
        if std::thread::panicking() {
            let logged_error = |line: &&str| {
                line.contains(r#""level":"ERROR""#)
                    && !line.contains(r#""target":"tower_http::trace::on_failure""#)
            };
            for replica in &self.replicas {
                for line in replica.log().lines().filter(logged_error) {
                    eprintln!("{}: {line}", replica.name);
                }
            }
        }
    }
}
