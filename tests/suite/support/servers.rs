//! Real `redis-server` and Postgres processes on free ports in temporary directories, each
//! stopped by its process id when its handle is dropped.

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User};
use std::collections::HashMap;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

use super::tls::TestCa;

/// The first port of the kernel's ephemeral range (`ip_local_port_range`): the ports it hands
/// out to outgoing connections.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A port nothing listens on right now, in `range`, below the ephemeral ports: a port from that
/// range (what binding port 0 gives) could be taken by any outgoing connection (a client, a
/// replica's pool, k6) between this check and the server's bind, and the server would fail to
/// start, now and then.
fn free_port_in(range: std::ops::Range<u16>) -> u16 {
    for _ in 0..10_000 {
        let port = rand::random_range(range.clone());
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {range:?}");
}

/// A port nothing listens on right now (below the ephemeral ports).
pub fn free_port() -> u16 {
    free_port_in(20_000..ephemeral_start().max(21_000))
}

/// A free port for a Redis Cluster node, whose cluster bus listens 10,000 above it: that one must
/// be free too, and below the ephemeral ports as well.
pub fn free_cluster_port() -> u16 {
    loop {
        let port = free_port_in(12_000..ephemeral_start().saturating_sub(10_000).max(13_000));
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Polls `ready` every few milliseconds until it holds, or panics with `what` after `limit`: a
/// bound on a hang, not on the machine's speed, so a shared machine's slow hour fails nothing.
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

/// Whether process `pid` runs: it exists and is not a zombie (one that exited but whose parent has
/// not reaped it yet has stopped), as deploy/lib.sh's wl_alive decides.
pub fn running(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
    state.is_some_and(|state| state != 'Z' && state != 'X')
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
    /// Whether it speaks TLS only (see [`RedisServer::start_tls`]).
    tls: bool,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// A server with more arguments (an ACL file, say).
    pub fn start_with(extra: Vec<String>) -> Self {
        let mut server = Self {
            port: free_port(),
            dir: TempDir::new().expect("temp dir"),
            child: None,
            extra,
            tls: false,
        };
        server.spawn();
        server
    }

    /// A server that speaks TLS only (the plain port off), with `ca`'s server certificate, and
    /// asks clients for a certificate of `ca`.
    pub fn start_tls(ca: &TestCa) -> Self {
        let port = free_port();
        let dir = TempDir::new().expect("temp dir");
        let mut server = Self { port, dir, child: None, extra: ca.redis_args(port), tls: true };
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let child = redis_server(self.port, self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (deploy/test installs it)");
        self.child = Some(OwnedChild(child));
        let port = self.port;
        wait_until("redis-server", Duration::from_secs(60), || listening(port));
    }

    /// Kills the server and starts an empty one on the same port: every key is gone, the
    /// script cache too.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Kills the server (SIGKILL); [`RedisServer::start_again`] starts an empty one on its port.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.stop(Signal::SIGKILL, Duration::from_secs(5));
        }
    }

    /// Starts an empty server on the port of the one killed.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "kill it first");
        self.spawn();
    }

    /// Sends the running server `signal`: SIGSTOP hangs it (connections stay open, nothing is
    /// answered), SIGCONT lets it go on.
    pub fn signal(&self, sig: Signal) {
        let child = self.child.as_ref().expect("a running redis-server");
        signal(child.pid(), sig);
    }
}

/// A Postgres cluster of its own. Postgres refuses to run as root, so when the tests run as
/// root the server runs as the `postgres` user.
#[derive(Debug)]
pub struct PostgresServer {
    pub port: u16,
    dir: TempDir,
    child: Option<OwnedChild>,
    /// More `-c name=value` settings, after (so overriding) the defaults; kept for restarts.
    settings: Vec<String>,
    /// With TLS on: the URL query that verifies the server (see [`PostgresServer::start_tls`]).
    tls_query: Option<String>,
}

impl PostgresServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with more settings (`"synchronous_commit=on"`, say), overriding the defaults.
    pub fn start_with(settings: &[&str]) -> Self {
        let settings = settings.iter().map(|s| s.to_string()).collect();
        let mut server = Self::init(settings);
        server.spawn_on_a_free_port();
        server
    }

    /// A server that takes TCP connections over TLS only (`hostssl` lines only in its hba file),
    /// with `ca`'s server certificate; its URL verifies the server against `ca`, host name
    /// included.
    pub fn start_tls(ca: &TestCa) -> Self {
        let mut server = Self::init(Vec::new());
        let settings = super::fleet::lib_sh(&format!(
            "wl_postgres_tls_settings {} {} server",
            server.dir.path().display(),
            ca.dir().display()
        ));
        server.settings.extend(settings.lines().map(str::to_owned));
        server.tls_query = Some(ca.postgres_query());
        server.spawn_on_a_free_port();
        server
    }

    /// A new cluster, not started yet.
    fn init(settings: Vec<String>) -> Self {
        let dir = TempDir::new().expect("temp dir");
        let server = Self { port: free_port(), dir, child: None, settings, tls_query: None };
        server.chown_to_runner(server.dir.path());
        let status = server
            .as_runner(Command::new(pg_bin("initdb")))
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "-D"])
            .arg(server.data_dir())
            .stdout(Stdio::null())
            .status()
            .expect("initdb (deploy/test installs postgresql)");
        assert!(status.success(), "initdb failed");
        server
    }

    pub fn url(&self, database: &str) -> String {
        let query = self.tls_query.as_ref().map(|q| format!("?{q}")).unwrap_or_default();
        format!("postgres://postgres@127.0.0.1:{}/{database}{query}", self.port)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The directory of its socket, through which the superuser gets in without a password: a
    /// Citus node's name (see [`CitusCluster`]).
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the server on its port, or on another if a process took that port between
    /// [`free_port`] and the server's bind (the tests start servers side by side): such a server
    /// exits at once, and a readiness check over TCP would have asked the other process.
    fn spawn_on_a_free_port(&mut self) {
        for _ in 0..3 {
            if self.try_spawn() {
                return;
            }
            self.port = free_port();
        }
        panic!("postgres exited before it took connections, on three free ports in turn");
    }

    fn spawn(&mut self) {
        assert!(self.try_spawn(), "postgres on port {} exited before it took connections", self.port);
    }

    /// Starts the server; false if it exited before it took connections. Ready is asked through
    /// its own socket directory, which no other server shares.
    fn try_spawn(&mut self) -> bool {
        let child = self
            .as_runner(Command::new(pg_bin("postgres")))
            .arg("-D")
            .arg(self.data_dir())
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(self.dir.path())
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=300", "-c", "shared_buffers=64MB"])
            .args(self.settings.iter().flat_map(|setting| ["-c", setting]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        let mut child = OwnedChild(child);
        let (port, socket_dir) = (self.port.to_string(), self.dir.path().to_owned());
        let mut exited = false;
        wait_until("postgres", Duration::from_secs(20), || {
            exited = child.0.try_wait().is_ok_and(|status| status.is_some());
            exited
                || Command::new(pg_bin("pg_isready"))
                    .arg("-q")
                    .arg("-h")
                    .arg(&socket_dir)
                    .args(["-p", &port])
                    .status()
                    .is_ok_and(|s| s.success())
        });
        if !exited {
            self.child = Some(child);
        }
        !exited
    }

    /// Starts the server again after [`PostgresServer::stop`] or [`PostgresServer::crash`], on the
    /// same port and data. After a crash the old server's backends outlive it for a moment, still
    /// attached to its shared memory, and Postgres refuses to start until they are gone: wait for
    /// every process whose working directory is the data directory (each server process's is) to
    /// exit, and for the port to be free. The stale `postmaster.pid` the crash left is Postgres's
    /// to discard (its pid is dead).
    pub fn start_again(&mut self) {
        let (port, data_dir) = (self.port, self.data_dir());
        wait_until("the old server's processes to exit", Duration::from_secs(20), || {
            !listening(port) && processes_in(&data_dir).is_empty()
        });
        self.spawn();
    }

    /// Crashes the server: SIGKILLs the postmaster, the process whose pid is in the data
    /// directory's `postmaster.pid`. No shutdown checkpoint; the next start recovers from the WAL.
    /// Returns the postmaster's pid.
    pub fn crash(&mut self) -> u32 {
        let pid_file =
            std::fs::read_to_string(self.data_dir().join("postmaster.pid")).expect("postmaster.pid");
        let pid: u32 = pid_file.lines().next().and_then(|l| l.trim().parse().ok()).expect("a pid");
        let mut child = self.child.take().expect("the server is running");
        assert_eq!(pid, child.pid(), "the postmaster is the process this server started");
        signal(pid, Signal::SIGKILL);
        let _ = child.0.wait();
        pid
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
            // Its HOME too: libpq inside the server (Citus's connections to the other nodes) looks
            // for client certificates under $HOME/.postgresql, and root's is not readable.
            command.uid(user.uid.as_raw()).gid(user.gid.as_raw()).env("HOME", &user.dir);
        }
        command
    }
}

/// The live processes whose working directory is `dir` (a zombie has none).
fn processes_in(dir: &Path) -> Vec<u32> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == dir))
                .collect()
        })
        .unwrap_or_default()
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

/// A Redis primary with two replicas, watched by three Sentinels that fail it over quickly
/// (down after 1 s). Every process is stopped by pid when the set is dropped.
pub struct SentinelSet {
    _dir: TempDir,
    pub sentinel_ports: Vec<u16>,
    /// `redis-cli`'s TLS arguments, when the set speaks TLS.
    cli_tls: Vec<String>,
    /// A replica's Redis TLS settings, when the set speaks TLS (see [`TestCa::replica_env`]).
    pub replica_env: Vec<(String, String)>,
    /// Data nodes by port (the primary first), then the Sentinels.
    nodes: Vec<(u16, OwnedChild)>,
    sentinels: Vec<OwnedChild>,
}

pub const SENTINEL_MASTER: &str = "walletlock";

/// A `redis-server` on 127.0.0.1:`port`, keeping nothing on disk, its files in `dir`.
fn redis_server(port: u16, dir: &std::path::Path) -> Command {
    let mut command = Command::new("redis-server");
    command.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    command.arg("--dir").arg(dir);
    command
}

impl SentinelSet {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Every data node and Sentinel on TLS only, with `ca`'s certificates (replication and the
    /// Sentinels' links over TLS too).
    pub fn start_tls(ca: &TestCa) -> Self {
        Self::start_with(Some(ca))
    }

    fn start_with(tls: Option<&TestCa>) -> Self {
        let dir = TempDir::new().expect("temp dir");
        let mut nodes = Vec::new();
        let primary_port = free_port();
        for replica_of in [None, Some(primary_port), Some(primary_port)] {
            let port = if replica_of.is_none() { primary_port } else { free_port() };
            let mut command = redis_server(port, dir.path());
            command.args(["--dbfilename", &format!("dump-{port}.rdb"), "--repl-diskless-sync-delay", "0"]);
            if let Some(ca) = tls {
                command.args(ca.redis_args(port));
            }
            if let Some(primary) = replica_of {
                command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
            }
            let child = command.stdout(Stdio::null()).spawn().expect("redis-server");
            nodes.push((port, OwnedChild(child)));
            wait_until("redis node", Duration::from_secs(60), || listening(port));
        }
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        for n in 0..3 {
            let port = free_port();
            let config = dir.path().join(format!("sentinel-{n}.conf"));
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n{tls}\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 5000\n\
                     sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                    dir = dir.path().display(),
                    tls = tls.map(|ca| ca.sentinel_config(port)).unwrap_or_default(),
                ),
            )
            .expect("sentinel config");
            let child = Command::new("redis-server")
                .arg(&config)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server --sentinel");
            sentinels.push(OwnedChild(child));
            sentinel_ports.push(port);
            wait_until("sentinel", Duration::from_secs(60), || listening(port));
        }
        let cli_tls = tls.map(TestCa::redis_cli_args).unwrap_or_default();
        let replica_env = tls.map(TestCa::replica_env).unwrap_or_default();
        let set = Self { _dir: dir, sentinel_ports, cli_tls, replica_env, nodes, sentinels };
        // Ready when every Sentinel knows both replicas and the two other Sentinels.
        wait_until("sentinels agree on the topology", Duration::from_secs(30), || {
            set.sentinel_ports.iter().all(|port| {
                let info = set.cli(*port, &["SENTINEL", "MASTER", SENTINEL_MASTER]);
                let field = |name: &str| {
                    let lines: Vec<&str> = info.lines().collect();
                    lines
                        .iter()
                        .position(|l| *l == name)
                        .and_then(|i| lines.get(i + 1))
                        .map(|v| v.to_string())
                };
                field("num-slaves").as_deref() == Some("2")
                    && field("num-other-sentinels").as_deref() == Some("2")
            })
        });
        load_lease_functions(&set.url(), &set.replica_env);
        set
    }

    /// `redis-cli` on one of this set's nodes.
    fn cli(&self, port: u16, args: &[&str]) -> String {
        let tls: Vec<&str> = self.cli_tls.iter().map(String::as_str).collect();
        redis_cli(port, &[tls.as_slice(), args].concat())
    }

    /// `REDIS_URL` for this set.
    pub fn url(&self) -> String {
        let sentinels: Vec<String> = self.sentinel_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let scheme = if self.cli_tls.is_empty() { "redis" } else { "rediss" };
        format!("{scheme}+sentinel://{}/{SENTINEL_MASTER}", sentinels.join(","))
    }

    /// The port of the node the Sentinels call primary now.
    pub fn current_primary(&self) -> u16 {
        let answer =
            self.cli(self.sentinel_ports[0], &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER]);
        answer.lines().nth(1).and_then(|p| p.trim().parse().ok()).expect("a primary")
    }

    /// SIGKILLs the current primary.
    pub fn kill_primary(&mut self) -> u16 {
        let primary = self.current_primary();
        let (_, child) =
            self.nodes.iter_mut().find(|(port, _)| *port == primary).expect("the primary is ours");
        child.stop(Signal::SIGKILL, Duration::from_secs(5));
        primary
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for sentinel in &mut self.sentinels {
            sentinel.stop(Signal::SIGKILL, Duration::from_secs(5));
        }
    }
}

/// A Redis Cluster of three primaries and three replicas (node timeout 1 s), stopped by pid when
/// dropped.
pub struct ClusterSet {
    _dir: TempDir,
    nodes: Vec<(u16, OwnedChild)>,
    /// `redis-cli`'s TLS arguments, when the cluster speaks TLS.
    cli_tls: Vec<String>,
    /// A replica's Redis TLS settings, when the cluster speaks TLS (see [`TestCa::replica_env`]).
    pub replica_env: Vec<(String, String)>,
}

impl ClusterSet {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Every node on TLS only, with `ca`'s certificates (the cluster bus and replication too).
    pub fn start_tls(ca: &TestCa) -> Self {
        Self::start_with(Some(ca))
    }

    fn start_with(tls: Option<&TestCa>) -> Self {
        let dir = TempDir::new().expect("temp dir");
        let cli_tls = tls.map(TestCa::redis_cli_args).unwrap_or_default();
        let replica_env = tls.map(TestCa::replica_env).unwrap_or_default();
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = free_cluster_port();
            let child = redis_server(port, dir.path())
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                // Replicas sync at once (not after the default 5 s), so a failover finds them ready.
                .args(["--repl-diskless-sync-delay", "0"])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .args(tls.map(|ca| ca.redis_args(port)).unwrap_or_default())
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server");
            nodes.push((port, OwnedChild(child)));
            wait_until("cluster node", Duration::from_secs(60), || listening(port));
        }
        let addresses: Vec<String> = nodes.iter().map(|(port, _)| format!("127.0.0.1:{port}")).collect();
        let out = Command::new("redis-cli")
            .args(&cli_tls)
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let set = Self { _dir: dir, nodes, cli_tls, replica_env };
        wait_until("the cluster is ok", Duration::from_secs(30), || {
            set.nodes
                .iter()
                .all(|(port, _)| set.cli(*port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        });
        // On every primary; a replica that takes over has it by replication.
        load_lease_functions(&set.url(), &set.replica_env);
        let primaries = set.nodes.iter().filter(|(port, _)| set.cli(*port, &["ROLE"]).starts_with("master"));
        for (port, _) in primaries {
            assert!(set.cli(*port, &["FUNCTION", "LIST"]).contains("walletlock"), "library on :{port}");
        }
        set
    }

    /// `redis-cli` on one of this cluster's nodes.
    fn cli(&self, port: u16, args: &[&str]) -> String {
        let tls: Vec<&str> = self.cli_tls.iter().map(String::as_str).collect();
        redis_cli(port, &[tls.as_slice(), args].concat())
    }

    /// `REDIS_URL` for this cluster (every node as a seed).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|(port, _)| format!("127.0.0.1:{port}")).collect();
        let scheme = if self.cli_tls.is_empty() { "redis" } else { "rediss" };
        format!("{scheme}+cluster://{}", nodes.join(","))
    }

    /// The port of the primary that owns `key`'s slot.
    pub fn owner_of(&self, key: &str) -> u16 {
        let alive =
            self.nodes.iter().find(|(port, _)| listening(*port)).map(|(port, _)| *port).expect("a live node");
        let slot: u16 = self.cli(alive, &["CLUSTER", "KEYSLOT", key]).trim().parse().expect("a slot");
        for line in self.cli(alive, &["CLUSTER", "NODES"]).lines().filter(|l| l.contains("master")) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port: u16 = fields[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("port");
            for range in &fields[8..] {
                let (start, end) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(start), Ok(end)) = (start.parse::<u16>(), end.parse::<u16>())
                    && (start..=end).contains(&slot)
                {
                    return port;
                }
            }
        }
        panic!("no primary owns slot {slot}")
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let (_, child) = self.nodes.iter_mut().find(|(p, _)| *p == port).expect("ours");
        child.stop(Signal::SIGKILL, Duration::from_secs(5));
    }
}

/// The deploy step: loads the lease scripts as Redis Functions through `url` (its topology), with
/// the TLS settings in `env`. A deploy step is not in a hurry: it waits up to 5 s for each Redis
/// call (a Sentinel set over TLS is three handshakes away from its primary, on a loaded machine).
fn load_lease_functions(url: &str, env: &[(String, String)]) {
    let out = Command::new(env!("CARGO_BIN_EXE_walletlock"))
        .args(["redis-functions", "--redis-url", url, "--redis-timeout", "5s"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("walletlock redis-functions");
    assert!(out.status.success(), "redis-functions: {}", String::from_utf8_lossy(&out.stderr));
}

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out =
        Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Citus cluster of the test's own: a coordinator and two workers, each a [`PostgresServer`],
/// joined as `deploy/local up --postgres citus` joins them (deploy/citus.sh), in the `postgres`
/// database. Every table a scratch schema's migration makes in it is distributed by wallet.
#[derive(Debug)]
pub struct CitusCluster {
    pub coordinator: PostgresServer,
    pub workers: Vec<PostgresServer>,
}

impl CitusCluster {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A cluster whose every node runs with `settings` too (see [`PostgresServer::start_with`]).
    pub fn start_with(settings: &[&str]) -> Self {
        assert!(
            Command::new("bash")
                .args(["-c", "source deploy/lib.sh; source deploy/citus.sh; wl_citus_installed"])
                .current_dir(super::fleet::repo())
                .status()
                .is_ok_and(|s| s.success()),
            "Citus is not installed (deploy/test installs it: wl_citus_install in deploy/citus.sh)"
        );
        let node_settings = Self::node_settings();
        let settings: Vec<&str> =
            node_settings.iter().map(String::as_str).chain(settings.iter().copied()).collect();
        // The coordinator logs to a file in its data directory (log/postgresql.log), for
        // [`CitusCluster::remote_commands`].
        let logged: Vec<&str> =
            settings.iter().copied().chain(["logging_collector=on", "log_filename=postgresql.log"]).collect();
        let coordinator = PostgresServer::start_with(&logged);
        let workers: Vec<PostgresServer> = (0..2).map(|_| PostgresServer::start_with(&settings)).collect();
        let worker_nodes: Vec<String> = workers.iter().map(Self::node).collect();
        Self::citus(&format!(
            "wl_citus_join postgres {} {}",
            Self::node(&coordinator),
            worker_nodes.join(" ")
        ));
        Self { coordinator, workers }
    }

    /// Starts one more worker and adds it to the cluster (it holds no shard until a rebalance
    /// moves some to it); its node name, `host:port`.
    pub fn add_worker(&mut self) -> String {
        let settings = Self::node_settings();
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        let worker = PostgresServer::start_with(&settings);
        let node = Self::node(&worker);
        Self::citus(&format!("wl_citus_join postgres {} {node}", Self::node(&self.coordinator)));
        self.workers.push(worker);
        node
    }

    /// A node as Citus names it here: `host:port`, the host its socket directory.
    pub fn node(server: &PostgresServer) -> String {
        format!("{}:{}", server.socket_dir().display(), server.port)
    }

    /// What every node runs with: `wl_citus_settings`, and a commit acknowledged only once its
    /// WAL is out of Postgres's memory (the suite's own servers skip that, for speed), since these
    /// nodes are killed under load.
    fn node_settings() -> Vec<String> {
        Self::citus("wl_citus_settings")
            .lines()
            .map(str::to_owned)
            .chain(["synchronous_commit=on".to_owned()])
            .collect()
    }

    fn citus(script: &str) -> String {
        super::fleet::lib_sh(&format!("source deploy/citus.sh; {script}"))
    }

    /// The coordinator's `postgres` database, where the tests' schemas go.
    pub fn url(&self) -> String {
        self.coordinator.url("postgres")
    }

    /// Runs `work` with the coordinator logging every command it sends to a worker
    /// (`citus.log_remote_commands`), and returns the commands its client backends sent: by
    /// coordinator backend, in order, each with the node it went to. Citus's own background
    /// workers are left out: the maintenance daemon asks every node for its prepared transactions
    /// each `citus.recover_2pc_interval` (deploy/citus.sh).
    pub async fn remote_commands<F: std::future::Future<Output = ()>>(
        &self,
        work: impl FnOnce() -> F,
    ) -> HashMap<u32, Vec<RemoteCommand>> {
        let admin = sqlx::PgPool::connect(&self.url()).await.expect("the coordinator");
        let log = self.coordinator.data_dir().join("log/postgresql.log");
        let set = |on: bool| {
            let admin = admin.clone();
            async move {
                let (remote, level) = if on { ("on", "notice") } else { ("off", "warning") };
                for statement in [
                    format!("alter system set citus.log_remote_commands = {remote}"),
                    format!("alter system set log_min_messages = {level}"),
                ] {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                        .execute(&admin)
                        .await
                        .expect("alter system");
                }
                sqlx::query("select pg_reload_conf()").execute(&admin).await.expect("reload");
                // A reload reaches every backend at its next command; give them a moment.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        };
        set(true).await;
        let from = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        work().await;
        set(false).await;
        let background: Vec<i64> = sqlx::query_scalar(
            "select pid::bigint from pg_stat_activity where backend_type <> 'client backend'",
        )
        .fetch_all(&admin)
        .await
        .expect("the coordinator's background workers");
        let text = std::fs::read(&log).expect("the coordinator's log");
        let mut commands = parse_remote_commands(&String::from_utf8_lossy(&text[from as usize..]));
        commands.retain(|pid, _| !background.contains(&i64::from(*pid)));
        commands
    }
}

/// A command the coordinator sent to a worker, as `citus.log_remote_commands` logs it.
#[derive(Debug, Clone)]
pub struct RemoteCommand {
    pub sql: String,
    /// `host:port` of the node it went to.
    pub node: String,
}

/// The coordinator's log lines `[pid] NOTICE:  issuing <sql>`, each followed by its
/// `[pid] DETAIL:  on server <user>@<host>:<port> connectionId: <n>`, by pid.
fn parse_remote_commands(log: &str) -> HashMap<u32, Vec<RemoteCommand>> {
    let mut issued: HashMap<u32, Vec<RemoteCommand>> = HashMap::new();
    let mut pending: HashMap<u32, String> = HashMap::new();
    for line in log.lines() {
        let Some((pid, rest)) = line.split_once(" [").and_then(|(_, rest)| rest.split_once("] ")) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if let Some(sql) = rest.strip_prefix("NOTICE:  issuing ") {
            pending.insert(pid, sql.to_owned());
        } else if let Some(server) = rest.strip_prefix("DETAIL:  on server ") {
            let node = server.split_whitespace().next().unwrap_or_default();
            let node = node.rsplit_once('@').map_or(node, |(_, node)| node).to_owned();
            if let Some(sql) = pending.remove(&pid) {
                issued.entry(pid).or_default().push(RemoteCommand { sql, node });
            }
        }
    }
    issued
}
