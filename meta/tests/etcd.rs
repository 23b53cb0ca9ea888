//! `EtcdStore` against a real etcd process: the behavioural suite (`tests/suite`), connection
//! errors, connecting before etcd is up, surviving an etcd restart, and mutual TLS.
//!
//! Each test starts its own etcd on free loopback ports with a temporary data dir and kills it
//! on drop (also when the test panics). Without an `etcd` binary the tests print
//! "skipping: etcd not installed" and pass.

mod suite;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfleet_meta::{EtcdOptions, EtcdStore, EtcdTls, MetaError, MetaStore};
use tokio_stream::StreamExt;

fn etcd_binary() -> Option<PathBuf> {
    let fixed = PathBuf::from("/usr/bin/etcd");
    if fixed.is_file() {
        return Some(fixed);
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join("etcd")).find(|p| p.is_file())
}

macro_rules! etcd_or_skip {
    () => {
        match etcd_binary() {
            Some(bin) => bin,
            None => {
                eprintln!("skipping: etcd not installed");
                return;
            }
        }
    };
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    l.local_addr().expect("local addr").port()
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "kvfleet-meta-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How etcd serves clients: plain, or TLS with these PEM files (server cert, key, client CA).
#[derive(Clone)]
enum Serve {
    Plain,
    MutualTls { cert: PathBuf, key: PathBuf, ca: PathBuf },
}

/// One etcd member; killed (and waited for) on drop.
struct Etcd {
    child: Option<Child>,
    bin: PathBuf,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    serve: Serve,
    log: PathBuf,
}

impl Etcd {
    fn start(bin: &Path, dir: &Path, client_port: u16, serve: Serve) -> Etcd {
        let mut e = Etcd {
            child: None,
            bin: bin.to_owned(),
            client_port,
            peer_port: free_port(),
            data: dir.join("data"),
            serve,
            log: dir.join("etcd.log"),
        };
        e.spawn();
        e
    }

    fn scheme(&self) -> &'static str {
        match self.serve {
            Serve::Plain => "http",
            Serve::MutualTls { .. } => "https",
        }
    }

    fn endpoint(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme(), self.client_port)
    }

    fn spawn(&mut self) {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open etcd log");
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--name", "meta-test", "--data-dir"])
            .arg(&self.data)
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("meta-test={peer_url}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        if let Serve::MutualTls { cert, key, ca } = &self.serve {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
            cmd.arg("--trusted-ca-file").arg(ca).arg("--client-cert-auth");
        }
        self.child = Some(cmd.spawn().expect("spawn etcd"));
    }

    /// Kills the process, keeping its data dir (for a restart).
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or("").to_owned()
    }

    /// Polls until etcd answers, or fails the test with the end of its log. A port taken by
    /// another process between picking and binding (etcd exits "address already in use") moves
    /// this etcd to fresh ports, a few times.
    async fn wait_ready(&mut self, opts: &EtcdOptions, patience: Duration) -> EtcdStore {
        let deadline = Instant::now() + patience;
        let mut probe = opts.clone();
        probe.connect_timeout = Duration::from_millis(500);
        let mut moves = 0;
        loop {
            let exited = self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited && moves < 5 && self.log_tail().contains("address already in use") {
                moves += 1;
                self.stop();
                let _ = std::fs::remove_file(&self.log);
                // It never got as far as its data (the listeners come first).
                let _ = std::fs::remove_dir_all(&self.data);
                self.client_port = free_port();
                self.peer_port = free_port();
                self.spawn();
            }
            match EtcdStore::connect(&[self.endpoint()], &probe).await {
                Ok(store) => return store,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("etcd at {} not ready after {patience:?}: {e}\n{}", self.endpoint(), self.log_tail()),
            }
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_passes_the_suite() {
    let bin = etcd_or_skip!();
    let dir = TempDir::new("suite");
    let mut etcd = Etcd::start(&bin, &dir.0, free_port(), Serve::Plain);
    let store = etcd.wait_ready(&EtcdOptions::default(), Duration::from_secs(20)).await;
    assert_eq!(store.store_kind(), "etcd");
    let store: Arc<dyn MetaStore> = Arc::new(store);
    // etcd 3.4 raises a 1 s TTL to its ~2 s minimum and checks expiry every 500 ms.
    let opts = suite::SuiteOpts { short_ttl: Duration::from_secs(1), patience: Duration::from_secs(10) };
    suite::run_all(store, "/t", &opts).await;
}

#[tokio::test]
async fn unreachable_endpoint_is_named_in_a_prompt_error() {
    // No etcd needed: nothing listens on this port.
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let opts = EtcdOptions { connect_timeout: Duration::from_millis(500), ..Default::default() };
    let started = Instant::now();
    let err = match EtcdStore::connect(std::slice::from_ref(&endpoint), &opts).await {
        Ok(_) => panic!("connected to nothing at {endpoint}"),
        Err(e) => e,
    };
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    assert!(matches!(err, MetaError::Unreachable { attempts: 1, .. }), "{err}");
    eprintln!("unreachable as expected: {err}");
    assert!(err.to_string().contains(&endpoint), "error does not name the endpoint: {err}");

    let started = Instant::now();
    let err =
        match EtcdStore::connect_with_retry(std::slice::from_ref(&endpoint), &opts, Duration::from_millis(800)).await {
            Ok(_) => panic!("connected to nothing at {endpoint}"),
            Err(e) => e,
        };
    assert!(started.elapsed() < Duration::from_secs(4), "retry overran: {:?}", started.elapsed());
    match &err {
        MetaError::Unreachable { attempts, endpoints, .. } => {
            assert!(*attempts >= 2, "no retry happened: {err}");
            assert!(endpoints.contains(&endpoint));
        }
        other => panic!("expected Unreachable, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_with_retry_waits_for_a_late_etcd() {
    let bin = etcd_or_skip!();
    let dir = TempDir::new("late");
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let data_dir = dir.0.clone();
    // etcd comes up only after the first attempts have failed.
    let starter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        Etcd::start(&bin, &data_dir, port, Serve::Plain)
    });
    let opts = EtcdOptions { connect_timeout: Duration::from_millis(500), ..Default::default() };
    let result = EtcdStore::connect_with_retry(&[endpoint], &opts, Duration::from_secs(20)).await;
    let etcd = starter.await.expect("starter task");
    let store = match result {
        Ok(s) => s,
        Err(e) => panic!("never connected: {e}\n{}", etcd.log_tail()),
    };
    store.put("/late/k", b"v").await.unwrap();
    assert_eq!(store.get("/late/k").await.unwrap().unwrap().value, b"v");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_carries_on_across_an_etcd_restart() {
    let bin = etcd_or_skip!();
    let dir = TempDir::new("restart");
    let mut etcd = Etcd::start(&bin, &dir.0, free_port(), Serve::Plain);
    let opts = EtcdOptions { op_timeout: Duration::from_secs(1), ..Default::default() };
    let store = etcd.wait_ready(&opts, Duration::from_secs(20)).await;
    let r1 = store.put("/restart/a", b"1").await.unwrap();
    let lease = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    store.keep_alive(lease).await.unwrap();
    let mut watch = store.watch_prefix("/restart/", Some(r1)).await.unwrap();
    assert_eq!(watch.next().await.unwrap().unwrap().revision, r1);

    etcd.stop();
    // While etcd is down: a bounded error, not a hang.
    let started = Instant::now();
    assert!(store.get("/restart/a").await.is_err());
    assert!(started.elapsed() < Duration::from_secs(3));
    // The watch reports the broken connection (it is then re-opened from the last revision).
    match suite::within(Duration::from_secs(30), "watch to report etcd gone", watch.next()).await {
        Some(Err(_)) | None => {}
        Some(Ok(ev)) => panic!("unexpected event while etcd was down: {ev:?}"),
    }

    etcd.spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    let kv = loop {
        match store.get("/restart/a").await {
            Ok(kv) => break kv,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("store never recovered after restart: {e}\n{}", etcd.log_tail()),
        }
    };
    assert_eq!(kv.unwrap().value, b"1", "data lost across restart");
    // The lease survived; its keep-alive stream broke and is reopened transparently.
    assert!(store.keep_alive(lease).await.unwrap() >= Duration::from_secs(1));
    let r2 = store.put("/restart/b", b"2").await.unwrap();
    let mut watch = store.watch_prefix("/restart/", Some(r2)).await.unwrap();
    assert_eq!(watch.next().await.unwrap().unwrap().key, "/restart/b");
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in `dir`.
fn write_test_pki(dir: &Path) -> (PathBuf, PathBuf, PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().expect("leaf key");
        let cert = CertificateParams::new(names).expect("leaf params").signed_by(&key, &issuer).expect("leaf cert");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["kvfleet-client".into()]);
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write pem");
        p
    };
    (
        write("ca.pem", &ca_cert.pem()),
        write("server.pem", &server_cert),
        write("server-key.pem", &server_key),
        write("client.pem", &client_cert),
        write("client-key.pem", &client_key),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_is_passed_through() {
    let bin = etcd_or_skip!();
    let dir = TempDir::new("tls");
    let (ca, server_cert, server_key, client_cert, client_key) = write_test_pki(&dir.0);
    let serve = Serve::MutualTls { cert: server_cert, key: server_key, ca: ca.clone() };
    let mut etcd = Etcd::start(&bin, &dir.0, free_port(), serve);
    let tls = EtcdTls {
        ca_cert_pem: Some(ca.clone()),
        client_cert_pem: Some(client_cert),
        client_key_pem: Some(client_key),
        domain_name: None,
    };
    let opts = EtcdOptions { tls: Some(tls), ..Default::default() };
    let store = etcd.wait_ready(&opts, Duration::from_secs(20)).await;
    store.put("/tls/k", b"v").await.unwrap();
    assert_eq!(store.get("/tls/k").await.unwrap().unwrap().value, b"v");

    // Without a client certificate the cluster refuses us.
    let anonymous = EtcdOptions {
        tls: Some(EtcdTls { ca_cert_pem: Some(ca), ..Default::default() }),
        connect_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let refused = EtcdStore::connect(&[etcd.endpoint()], &anonymous).await;
    let err = refused.err().expect("connected without a client certificate");
    eprintln!("refused as expected: {err}");
}

/// The harness's own port race: a client port taken before etcd binds it moves etcd elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_moves_the_test_etcd_to_a_free_one() {
    let bin = etcd_or_skip!();
    let dir = TempDir::new("taken");
    let thief = TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = thief.local_addr().expect("addr").port();
    let mut etcd = Etcd::start(&bin, &dir.0, taken, Serve::Plain);
    let store = etcd.wait_ready(&EtcdOptions::default(), Duration::from_secs(20)).await;
    assert_ne!(etcd.client_port, taken);
    store.put("/taken/k", b"v").await.unwrap();
}
