//! Real `redis-server` and Postgres processes on free ports in temporary directories, each
//! stopped by its process id when its handle is dropped.

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// Polls `ready` every few milliseconds until it holds, or panics with `what` after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not ready within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether something accepts TCP connections on `port`.
pub fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Sends `signal` to a process we started.
pub fn signal(pid: u32, signal: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), signal);
}

/// A child process that is killed (by pid) and reaped when dropped.
#[derive(Debug)]
pub struct OwnedChild(pub Child);

impl OwnedChild {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Stops the process with `sig`, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, sig: Signal, grace: Duration) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        signal(self.pid(), sig);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        signal(self.pid(), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

impl Drop for OwnedChild {
    fn drop(&mut self) {
        // SIGCONT first: a test may have left the process stopped, and a stopped process only
        // dies of SIGKILL.
        signal(self.pid(), Signal::SIGCONT);
        self.stop(Signal::SIGTERM, Duration::from_secs(5));
    }
}

/// A `redis-server` without persistence: a restart loses every key.
#[derive(Debug)]
pub struct RedisServer {
    pub port: u16,
    dir: TempDir,
    child: Option<OwnedChild>,
    /// More `redis-server` arguments, kept for restarts.
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// A server with more arguments (an ACL file, say).
    pub fn start_with(extra: Vec<String>) -> Self {
        let mut server =
            Self { port: free_port(), dir: TempDir::new().expect("temp dir"), child: None, extra };
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (deploy/test installs it)");
        self.child = Some(OwnedChild(child));
        let port = self.port;
        wait_until("redis-server", Duration::from_secs(10), || listening(port));
    }

    /// Kills the server and starts an empty one on the same port: every key is gone, the
    /// script cache too.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop(Signal::SIGKILL, Duration::from_secs(5));
        }
        self.spawn();
    }
}

/// A Postgres cluster of its own. Postgres refuses to run as root, so when the tests run as
/// root the server runs as the `postgres` user.
#[derive(Debug)]
pub struct PostgresServer {
    pub port: u16,
    dir: TempDir,
    child: Option<OwnedChild>,
}

impl PostgresServer {
    pub fn start() -> Self {
        let dir = TempDir::new().expect("temp dir");
        let mut server = Self { port: free_port(), dir, child: None };
        server.chown_to_runner(server.dir.path());
        let status = server
            .as_runner(Command::new(pg_bin("initdb")))
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "-D"])
            .arg(server.data_dir())
            .stdout(Stdio::null())
            .status()
            .expect("initdb (deploy/test installs postgresql)");
        assert!(status.success(), "initdb failed");
        server.spawn();
        server
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let child = self
            .as_runner(Command::new(pg_bin("postgres")))
            .arg("-D")
            .arg(self.data_dir())
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(self.dir.path())
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=300", "-c", "shared_buffers=64MB"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        self.child = Some(OwnedChild(child));
        let port = self.port;
        wait_until("postgres", Duration::from_secs(20), || {
            Command::new(pg_bin("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    /// Starts the server again after [`PostgresServer::stop`], on the same port and data.
    pub fn start_again(&mut self) {
        self.spawn();
    }

    /// Stops the server (fast shutdown: open connections are cut).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop(Signal::SIGINT, Duration::from_secs(10));
        }
    }

    fn runner() -> Option<User> {
        if nix::unistd::geteuid().is_root() { User::from_name("postgres").ok().flatten() } else { None }
    }

    fn chown_to_runner(&self, path: &Path) {
        if let Some(user) = Self::runner() {
            std::os::unix::fs::chown(path, Some(user.uid.as_raw()), Some(user.gid.as_raw())).expect("chown");
        }
    }

    fn as_runner(&self, mut command: Command) -> Command {
        if let Some(user) = Self::runner() {
            command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        }
        command
    }
}

/// The newest installed Postgres's server programs (Debian keeps them off PATH).
pub fn pg_bin(program: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dir| dir.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    versions.sort_by_key(|p| {
        p.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    versions.pop().map(|bin| bin.join(program)).unwrap_or_else(|| PathBuf::from(program))
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // Fast shutdown: a smart one (SIGTERM) would wait for every pooled connection to close.
        self.stop();
    }
}
