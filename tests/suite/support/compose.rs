//! The docker compose stack (docker-compose.yml), brought up for real by `deploy/compose` on a
//! Docker engine: under a project name of its own (so it never meets a stack someone runs here),
//! with nginx and Postgres published on free loopback ports, and taken down with its volumes when
//! dropped. On a machine that cannot pull the public images, `deploy/compose` starts the engine and
//! builds the local stand-ins (cached between runs); see its header.

use super::fleet::repo;
use super::load::Bank;
use sqlx::PgPool;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use tempfile::TempDir;

/// The owner's password: docker-compose.yml's default for WALLETLOCK_PG_PASSWORD.
const OWNER_PASSWORD: &str = "walletlock-dev-only";

pub struct ComposeStack {
    project: String,
    pub http_port: u16,
    pub pg_port: u16,
    /// deploy/compose's state (the pid of a dockerd it started).
    state: TempDir,
    /// Authenticates with the token the secrets step made.
    pub client: reqwest::Client,
    /// The stack's Postgres as its owner, through the published port.
    pub db: PgPool,
    pub database_url: String,
}

impl ComposeStack {
    /// `deploy/compose up --scale replicas`: returns once that many replicas are healthy behind
    /// nginx.
    pub async fn up(replicas: usize) -> ComposeStack {
        // Under WALLETLOCK_TEST_COMPOSE_ROOT when deploy/test sets it, with the project's name in
        // it: a test stopped before its drop (nextest's time limit) leaves its stack there for
        // deploy/test to take down.
        let mut builder = tempfile::Builder::new();
        builder.prefix("stack-");
        let state = match std::env::var_os("WALLETLOCK_TEST_COMPOSE_ROOT") {
            Some(root) => builder.tempdir_in(root),
            None => builder.tempdir(),
        }
        .expect("temp dir");
        let project = format!("walletlock-test-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        std::fs::write(state.path().join("project"), &project).expect("the project's name");
        let (http_port, pg_port) = (super::servers::free_port(), super::servers::free_port());
        let database_url = format!("postgres://walletlock:{OWNER_PASSWORD}@127.0.0.1:{pg_port}/walletlock");
        let mut stack = ComposeStack {
            project,
            http_port,
            pg_port,
            state,
            client: reqwest::Client::new(),
            db: sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect_lazy(&database_url)
                .expect("url"),
            database_url,
        };
        stack.scale(replicas);
        stack.client = super::api_client_with(&stack.token());
        stack
    }

    /// `deploy/compose up --scale replicas` on the running stack.
    pub fn scale(&self, replicas: usize) {
        self.deploy_compose(&["up", "--scale", &replicas.to_string()]);
    }

    /// `deploy/compose token`.
    pub fn token(&self) -> String {
        self.deploy_compose(&["token"]).trim().to_owned()
    }

    /// `deploy/compose down`, with `-v` when `volumes`.
    pub fn down(&self, volumes: bool) {
        self.deploy_compose(if volumes { &["down", "-v"] } else { &["down"] });
    }

    /// A command in a running container of `service` (`deploy/compose exec -T`): what it printed,
    /// on stdout and stderr, whatever its exit status (redis-cli exits 1 on a refusal).
    pub fn exec(&self, service: &str, command: &[&str]) -> String {
        let mut args = vec!["exec", "-T", service];
        args.extend_from_slice(command);
        let out = self.command(&args).output().expect("deploy/compose exec");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    /// The running containers of `service`, by id (a container's hostname is its short id).
    pub fn containers(&self, service: &str) -> BTreeSet<String> {
        docker(&[
            "ps",
            "-q",
            "--filter",
            &format!("label=com.docker.compose.project={}", self.project),
            "--filter",
            &format!("label=com.docker.compose.service={service}"),
        ])
        .lines()
        .map(str::to_owned)
        .collect()
    }

    /// What the stack has on this machine: the host pids of its containers' main processes (and of
    /// the dockerd deploy/compose started, if it did), and where its volumes keep their data.
    pub fn footprint(&self) -> Footprint {
        let label = format!("label=com.docker.compose.project={}", self.project);
        let containers: Vec<String> =
            docker(&["ps", "-q", "--filter", &label]).lines().map(str::to_owned).collect();
        let mut pids: Vec<u32> = containers
            .iter()
            .map(|id| docker(&["inspect", "-f", "{{.State.Pid}}", id]).trim().parse().expect("a pid"))
            .collect();
        if let Ok(pid) = std::fs::read_to_string(self.dockerd_pid_file()) {
            pids.push(pid.trim().parse().expect("dockerd's pid"));
        }
        // The project's volumes, and the anonymous ones its containers (those that ran once too)
        // have from their images' VOLUME lines.
        let volumes: Vec<String> =
            docker(&["volume", "ls", "-q", "--filter", &label]).lines().map(str::to_owned).collect();
        let mut volume_dirs = BTreeSet::new();
        for volume in &volumes {
            volume_dirs.insert(PathBuf::from(
                docker(&["volume", "inspect", "-f", "{{.Mountpoint}}", volume]).trim(),
            ));
        }
        for container in docker(&["ps", "-aq", "--filter", &label]).lines() {
            let format = r#"{{range .Mounts}}{{if eq .Type "volume"}}{{println .Source}}{{end}}{{end}}"#;
            volume_dirs.extend(docker(&["inspect", "-f", format, container]).lines().map(PathBuf::from));
        }
        Footprint { pids, volume_dirs: volume_dirs.into_iter().collect() }
    }

    /// One variable of a container's environment.
    pub fn container_env(&self, container: &str, name: &str) -> String {
        let env = docker(&["inspect", "-f", "{{range .Config.Env}}{{println .}}{{end}}", container]);
        env.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}=")).map(str::to_owned))
            .unwrap_or_else(|| panic!("{container} has no {name}"))
    }

    /// A container's address on the compose network.
    pub fn container_ip(&self, container: &str) -> String {
        docker(&["inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container])
            .trim()
            .to_owned()
    }

    /// When a container last started (Docker's timestamp).
    pub fn started_at(&self, container: &str) -> String {
        docker(&["inspect", "-f", "{{.State.StartedAt}}", container]).trim().to_owned()
    }

    /// The pid file of the dockerd `deploy/compose` started, if it started one.
    pub fn dockerd_pid_file(&self) -> PathBuf {
        self.state.path().join("dockerd.pid")
    }

    /// `deploy/compose ARGS` on this stack's project, ports and state.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(repo().join("deploy/compose"));
        command
            .args(args)
            .current_dir(repo())
            .env("COMPOSE_PROJECT_NAME", &self.project)
            .env("COMPOSE_FILE", "docker-compose.yml:deploy/compose.d/publish-postgres.yml")
            .env("WALLETLOCK_HTTP_PORT", self.http_port.to_string())
            .env("WALLETLOCK_PG_PORT", self.pg_port.to_string())
            .env("WALLETLOCK_COMPOSE_STATE", self.state.path());
        // Without the variables cargo sets for a test binary (CARGO_MANIFEST_DIR, CARGO_PKG_*, and
        // OUT_DIR, since the crate has a build script): `deploy/compose up` runs `cargo build
        // --release`, and ring's build script reruns when they differ from the last build's, which
        // rebuilt ring and all above it (2 to 5 minutes on two cores) at every test run. Cargo
        // says which: `CARGO_LOG=cargo::core::compiler::fingerprint=info` printed
        // `EnvVarChanged { name: "OUT_DIR" ... }` for ring's build script.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let set_by_cargo = name == "OUT_DIR"
                || name == "CARGO"
                || name.starts_with("CARGO_") && name != "CARGO_HOME" && name != "CARGO_TARGET_DIR";
            if set_by_cargo {
                command.env_remove(name.as_ref());
            }
        }
        command
    }

    fn deploy_compose(&self, args: &[&str]) -> String {
        let started = std::time::Instant::now();
        let out = self.command(args).output().expect("deploy/compose");
        eprintln!("deploy/compose {}: {:.1} s", args.join(" "), started.elapsed().as_secs_f64());
        assert!(
            out.status.success(),
            "deploy/compose {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }
}

/// See [`ComposeStack::footprint`].
#[derive(Debug)]
pub struct Footprint {
    pub pids: Vec<u32>,
    pub volume_dirs: Vec<PathBuf>,
}

impl Footprint {
    /// What of it is still there: processes running, volume directories on disk.
    pub fn left(&self) -> Vec<String> {
        let running = self.pids.iter().filter(|pid| super::servers::running(**pid));
        let kept = self.volume_dirs.iter().filter(|dir| dir.exists());
        running
            .map(|pid| format!("process {pid}"))
            .chain(kept.map(|dir| format!("volume {}", dir.display())))
            .collect()
    }
}

/// Runs the docker client: its output.
pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().expect("docker");
    assert!(out.status.success(), "docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

impl Bank for ComposeStack {
    fn client(&self) -> &reqwest::Client {
        &self.client
    }
    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http_port)
    }
    fn db(&self) -> &PgPool {
        &self.db
    }
    fn database_url(&self) -> &str {
        &self.database_url
    }
}

impl Drop for ComposeStack {
    fn drop(&mut self) {
        // Whatever the test left: its containers and volumes, and the engine if it started one.
        let _ = self.command(&["down", "-v"]).output();
    }
}
