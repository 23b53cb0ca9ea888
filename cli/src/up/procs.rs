//! Child processes of `kvfleet up`: started with their output captured, their advertised address
//! read from the first `listening on ADDR` line, and killed when dropped, so that no process
//! outlives the command, not even on an error or a panic.

use anyhow::{anyhow, bail, Context};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Send signal `name` (`STOP`, `CONT`, …) to process `pid`.
pub fn signal_pid(pid: u32, name: &str) {
    // A process gone meanwhile is not an error here: `kill`'s complaint would only garble the output.
    let _ = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).stderr(Stdio::null()).status();
}

/// A child process we own.
pub struct Proc {
    pub name: String,
    child: Child,
    /// The address it printed (`listening on ADDR`), if it prints one.
    pub addr: Option<String>,
    /// How it was started, to start it again ([`Proc::restart`]).
    launch: Launch,
    /// Times it was restarted.
    pub restarts: u32,
    /// Its stdout lines not read yet ([`Proc::announced`] reads on past the `listening on` line).
    lines: mpsc::Receiver<String>,
    /// Stopped or killed by `kvfleet up` itself (a fault it injected, or the run's end): its exit
    /// is no surprise ([`Proc::ended_unasked`]).
    ended_by_us: bool,
}

/// A process's command line, environment and log, as [`Proc::spawn_with_env`] got them.
#[derive(Clone)]
struct Launch {
    program: std::path::PathBuf,
    args: Vec<String>,
    env: Vec<(String, Option<String>)>,
    log: std::path::PathBuf,
    own_group: bool,
}

impl Proc {
    /// Start `program args…`, stderr appended to `log`. With `wait_addr`, block until the child
    /// prints `listening on ADDR` (or the trace sink's `otlp on ADDR`) on stdout (or fail naming
    /// the log when it exits or times out).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        wait_addr: Option<Duration>,
    ) -> anyhow::Result<Proc> {
        Self::spawn_with(name, program, args, log, wait_addr, false)
    }

    /// [`Proc::spawn`]; with `own_group`, the child gets a process group of its own, so a Ctrl-C
    /// at the terminal reaches only the parent, which then stops the children in order.
    pub fn spawn_with(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        wait_addr: Option<Duration>,
        own_group: bool,
    ) -> anyhow::Result<Proc> {
        Self::spawn_with_env(name, program, args, &[], log, wait_addr, own_group)
    }

    /// [`Proc::spawn_with`], with environment changes: `(NAME, Some(value))` sets a variable,
    /// `(NAME, None)` removes an inherited one (secrets travel here rather than in argv, where
    /// `ps` shows them).
    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, Option<&str>)],
        log: &Path,
        wait_addr: Option<Duration>,
        own_group: bool,
    ) -> anyhow::Result<Proc> {
        use std::os::unix::process::CommandExt as _;
        let log_file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut command = Command::new(program);
        if own_group {
            command.process_group(0);
        }
        die_with_parent(&mut command);
        for (var, value) in env {
            match value {
                Some(v) => command.env(var, v),
                None => command.env_remove(var),
            };
        }
        let mut child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {} ({})", name, program.display()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            // Drain to the end even once nobody reads the lines: a closed pipe would fail the
            // child's next write to stdout (a restarted worker exits on that EPIPE).
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let launch = Launch {
            program: program.to_path_buf(),
            args: args.to_vec(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.map(str::to_string))).collect(),
            log: log.to_path_buf(),
            own_group,
        };
        let mut proc =
            Proc { name: name.to_string(), child, addr: None, launch, restarts: 0, lines: rx, ended_by_us: false };
        if let Some(limit) = wait_addr {
            let addr = proc.read_until(&["listening on ", "otlp on "], limit)?;
            proc.addr = Some(addr);
        }
        Ok(proc)
    }

    /// The address it prints after its `listening on` line as `<prefix>ADDR` (`metrics on `,
    /// `http on `), waiting up to `limit`. Parents pass port 0 and read the port here rather than
    /// pick a free one that another process can take before the child binds it; `flag`'s value in
    /// the command line becomes that address, so a restart listens where it did.
    pub fn announced(&mut self, prefix: &str, flag: &str, limit: Duration) -> anyhow::Result<String> {
        let addr = self.read_until(&[prefix], limit)?;
        let args = &mut self.launch.args;
        if let Some(i) = args.iter().position(|a| a == flag) {
            if let Some(value) = args.get_mut(i + 1) {
                value.clone_from(&addr);
            }
        }
        Ok(addr)
    }

    /// Read stdout lines until one starts with one of `prefixes`; the rest of it, trimmed. Fails,
    /// quoting the end of its log, when the child exits, closes stdout or takes over `limit`.
    fn read_until(&mut self, prefixes: &[&str], limit: Duration) -> anyhow::Result<String> {
        let (name, log) = (&self.name, &self.launch.log);
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!("{name} exited with {status} before it was ready; see {}{}", log.display(), log_tail(log));
            }
            match self.lines.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => {
                    if let Some(rest) = prefixes.iter().find_map(|p| line.strip_prefix(p)) {
                        return Ok(rest.trim().to_string());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // It closed stdout: exiting. Give it a moment, so the status and the log's
                    // last line say why.
                    let until = Instant::now() + Duration::from_millis(500);
                    while Instant::now() < until && matches!(self.child.try_wait(), Ok(None)) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    bail!("{name} closed its output before it was ready; see {}{}", log.display(), log_tail(log))
                }
            }
            if Instant::now() > deadline {
                bail!("{name} was not ready within {limit:?}; see {}{}", log.display(), log_tail(log));
            }
        }
    }

    /// kill -9 it (if it still runs) and start it again with the same command line, listening
    /// on the address it had (so peers and `--coordinators` lists still find it), without
    /// waiting for it to be ready; its output goes to `<log>.restart<N>.log`.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        let mut launch = self.launch.clone();
        if let Some(addr) = &self.addr {
            if !launch.args.iter().any(|a| a == "--listen") {
                launch.args.extend(["--listen".to_string(), addr.clone()]);
            }
        }
        self.restarts += 1;
        let log = launch.log.with_extension(format!("restart{}.log", self.restarts));
        let env: Vec<(&str, Option<&str>)> = launch.env.iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect();
        // Not waiting for it to be ready (it may wait for etcd, itself being restarted): it
        // listens where it did, so its address stays known.
        let mut fresh =
            Proc::spawn_with_env(&self.name, &launch.program, &launch.args, &env, &log, None, launch.own_group)?;
        fresh.addr = self.addr.clone();
        fresh.restarts = self.restarts;
        fresh.launch = Launch { log: self.launch.log.clone(), ..launch };
        // The old process (killed and reaped above) drops here.
        std::mem::swap(self, &mut fresh);
        Ok(())
    }

    pub fn addr(&self) -> anyhow::Result<&str> {
        self.addr.as_deref().ok_or_else(|| anyhow!("{} has no address", self.name))
    }

    /// Its exit status, if it has exited (reaped here).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status if it exited although nothing here stopped or killed it.
    pub fn ended_unasked(&mut self) -> Option<std::process::ExitStatus> {
        if self.ended_by_us {
            return None;
        }
        self.exit_status()
    }

    /// Its log file (stderr).
    pub fn log(&self) -> &Path {
        &self.launch.log
    }

    /// Ask it to stop (SIGTERM), wait up to `grace`, then SIGKILL. Returns its exit status text.
    pub fn stop(&mut self, grace: Duration) -> String {
        self.ended_by_us = true;
        if let Ok(Some(s)) = self.child.try_wait() {
            return s.to_string();
        }
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.to_string();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().map(|s| format!("{s} (killed after {grace:?})")).unwrap_or_else(|e| e.to_string())
    }

    /// Send a signal by name (`STOP`, `CONT`, …) without waiting for anything.
    pub fn signal(&self, name: &str) {
        signal_pid(self.child.id(), name);
    }

    /// SIGKILL now (fault injection).
    pub fn kill9(&mut self) {
        self.ended_by_us = true;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A `sleep 30` child named `name`, logging into `dir` (tests of what watches and faults processes).
#[cfg(test)]
pub(crate) fn sleeper(name: &str, dir: &Path) -> Proc {
    let args = vec!["-c".to_string(), "sleep 30".to_string()];
    Proc::spawn(name, Path::new("/bin/sh"), &args, &dir.join(format!("{name}.log")), None).expect("sh starts")
}

/// The last lines of a child's log, each on its own indented line after a colon (empty when the
/// log is empty or unreadable), for an error that names the log.
fn log_tail(log: &Path) -> String {
    const LINES: usize = 6;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail = &lines[lines.len().saturating_sub(LINES)..];
    format!(", which ends:\n    {}", tail.join("\n    "))
}

/// A free loopback TCP port (bound, read, released).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The sibling binary `name` of the running `kvfleet` (they are built together).
pub fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("locating the kvfleet binary")?;
    let dir = me.parent().ok_or_else(|| anyhow!("kvfleet binary has no directory"))?;
    // Integration tests run from target/<profile>/deps.
    for d in [dir.to_path_buf(), dir.parent().map(Path::to_path_buf).unwrap_or_default()] {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("`{name}` not found next to {}; build it with `cargo build --release --workspace`", me.display())
}

/// `etcd` on PATH, if installed.
pub fn find_etcd() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("etcd")).find(|p| p.is_file()))
}

/// What etcd logs once it serves clients (3.4's capnslog and 3.5's zap say the same).
const ETCD_READY: &str = "ready to serve client requests";

/// etcd's TLS material: its own certificate from the cluster CA and that CA as its only trust
/// root, for clients and peers alike.
#[derive(Clone, Debug)]
pub struct EtcdTlsFiles {
    /// The cluster CA certificate (`--trusted-ca-file`, `--peer-trusted-ca-file`).
    pub ca: PathBuf,
    /// etcd's certificate (`--cert-file`, `--peer-cert-file`): SANs `127.0.0.1` and `localhost`,
    /// server and client authentication.
    pub cert: PathBuf,
    /// Its key (`--key-file`, `--peer-key-file`).
    pub key: PathBuf,
}

/// A private single-member etcd on loopback, data in `dir`; restartable on the same ports.
///
/// With [`EtcdSpec::tls`] it serves clients over `https` only and requires a client certificate
/// from the cluster CA (`--client-cert-auth`); the peer port uses the same certificate with
/// `--peer-client-cert-auth` (a single member has no peers, but the port still answers: the
/// lease renewal and membership handlers must not be open to anyone on the host). Without it
/// (`--plaintext`), both are plain `http` on loopback.
pub struct EtcdSpec {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub client_port: u16,
    pub peer_port: u16,
    /// Start it in a process group of its own (see [`Proc::spawn_with`]).
    pub own_group: bool,
    /// Mutual TLS on the client and peer URLs (`None`: plain http, `--plaintext`).
    pub tls: Option<EtcdTlsFiles>,
}

impl EtcdSpec {
    /// Pick free ports for a new etcd (plain http until `tls` is set).
    pub fn new(bin: &Path, dir: &Path) -> anyhow::Result<EtcdSpec> {
        Ok(EtcdSpec {
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            client_port: free_port()?,
            peer_port: free_port()?,
            own_group: false,
            tls: None,
        })
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The client URL (`https://127.0.0.1:PORT` with TLS).
    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme(), self.client_port)
    }

    /// The command line (the same for the first start and every restart).
    pub fn args(&self) -> Vec<String> {
        let url = self.url();
        let peer = format!("{}://127.0.0.1:{}", self.scheme(), self.peer_port);
        let mut args: Vec<String> = vec![
            "--name".into(),
            "kvfleet-up".into(),
            "--data-dir".into(),
            self.dir.join("etcd-data").display().to_string(),
            "--listen-client-urls".into(),
            url.clone(),
            "--advertise-client-urls".into(),
            url,
            "--listen-peer-urls".into(),
            peer.clone(),
            "--initial-advertise-peer-urls".into(),
            peer.clone(),
            "--initial-cluster".into(),
            format!("kvfleet-up={peer}"),
        ];
        if let Some(tls) = &self.tls {
            let path = |p: &PathBuf| p.display().to_string();
            args.extend([
                "--cert-file".into(),
                path(&tls.cert),
                "--key-file".into(),
                path(&tls.key),
                "--trusted-ca-file".into(),
                path(&tls.ca),
                "--client-cert-auth".into(),
                "--peer-cert-file".into(),
                path(&tls.cert),
                "--peer-key-file".into(),
                path(&tls.key),
                "--peer-trusted-ca-file".into(),
                path(&tls.ca),
                "--peer-client-cert-auth".into(),
            ]);
        }
        args
    }

    /// Start a new etcd and wait until it serves clients. Its ports were free when picked, but
    /// another process on the host can bind one before etcd does (it then exits: "address
    /// already in use"): such a start is retried on fresh ports, a few times. Any other early
    /// exit, or no readiness within `limit`, fails quoting its log.
    pub fn launch(&mut self, limit: Duration) -> anyhow::Result<Proc> {
        const TRIES: u32 = 5;
        let log = self.dir.join("etcd.log");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut p = self.start()?;
            let deadline = Instant::now() + limit;
            loop {
                let text = || std::fs::read_to_string(&log).unwrap_or_default();
                if let Some(status) = p.exit_status() {
                    if text().contains("address already in use") && attempt < TRIES {
                        self.client_port = free_port()?;
                        self.peer_port = free_port()?;
                        break;
                    }
                    bail!("etcd exited with {status} before it was ready; see {}{}", log.display(), log_tail(&log));
                }
                if text().contains(ETCD_READY) {
                    return Ok(p);
                }
                if Instant::now() > deadline {
                    bail!("etcd was not ready within {limit:?}; see {}{}", log.display(), log_tail(&log));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Start (or restart: same ports, same data directory, same certificates) the etcd process.
    pub fn start(&self) -> anyhow::Result<Proc> {
        let args = self.args();
        let log = self.dir.join("etcd.log");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        drop(log_file);
        Proc::spawn_with("etcd", &self.bin, &args, &log, None, self.own_group)
    }
}

/// The child gets SIGTERM when the process that started it dies, however it dies (kill -9 of
/// `kvfleet up` included): workers and coordinators in their own process groups would otherwise
/// outlive it. Linux ties this to the spawning *thread*; every spawn here runs on the thread that
/// drives the cluster, which lives as long as the run.
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the child between fork and exec and only makes the
    // async-signal-safe calls prctl(2) and getppid(2).
    let parent = std::process::id();
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then nobody would signal this child.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("kvfleet up exited while starting this process"));
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken between picking and starting (here: held by the test) costs a retry on fresh
    /// ports, not the run.
    #[test]
    fn etcd_starting_on_a_taken_port_moves_to_free_ones_and_serves() {
        let Some(bin) = find_etcd() else {
            eprintln!("skipping: etcd not installed");
            return;
        };
        let dir = std::env::temp_dir().join(format!("kvfleet-procs-etcd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let thief = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = thief.local_addr().unwrap().port();
        let mut spec = EtcdSpec { client_port: taken, ..EtcdSpec::new(&bin, &dir).unwrap() };
        let mut etcd = spec.launch(Duration::from_secs(30)).expect("etcd starts on other ports");
        assert_ne!(spec.client_port, taken);
        assert!(etcd.exit_status().is_none(), "etcd runs");
        std::net::TcpStream::connect(("127.0.0.1", spec.client_port)).expect("etcd accepts clients on its new port");
        etcd.stop(Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
