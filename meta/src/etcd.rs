//! [`EtcdStore`]: the [`MetaStore`] on a real etcd cluster (v3 API via `etcd-client`), used when
//! a coordinator or worker is given `--etcd` endpoints (several coordinators sharing one store).
//!
//! - KV: puts, prefix reads and conditional writes are etcd transactions, so the fencing check
//!   ([`Condition::leader`]) and the write it guards are atomic in etcd itself.
//! - Leases: [`MetaStore::keep_alive`] reuses one keep-alive stream per lease (reopened if it
//!   breaks), so a refresh every ttl/3 costs one round trip.
//! - Watch and Election: etcd's own services; a watch or observe stream ends with an error
//!   when the connection breaks, and the caller re-opens it (a watch from its last revision + 1).
//! - Connection: [`EtcdStore::connect`] makes one attempt and probes the cluster (a connection is
//!   otherwise lazy, and an unreachable etcd would only show up as a hung request);
//!   [`EtcdStore::connect_with_retry`] retries with exponential backoff (100 ms → 5 s), so
//!   processes started before etcd, or across an etcd restart, come up without a panic.
//!   User/password and TLS (CA, client certificate and key as PEM files) pass through to
//!   `etcd-client`.
//!
//! Unary requests are bounded by [`EtcdOptions::op_timeout`]; `campaign` and streams are not
//! (they block by design). No gRPC-level request timeout is set for the same reason.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    Txn, TxnOp, WatchOptions,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::{
    Condition, EventKind, KeyValue, LeaderKey, LeaseId, Listing, MetaError, MetaFuture, MetaStore, MetaStream,
    Revision, WatchEvent,
};

/// First and largest pause of [`EtcdStore::connect_with_retry`].
pub const RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Largest pause of [`EtcdStore::connect_with_retry`] (the backoff doubles up to it).
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// Buffered watch events / leader values per stream before etcd's flow control applies.
const STREAM_BUFFER: usize = 1024;

/// TLS towards etcd; paths to PEM files (the `--etcd-cacert`, `--etcd-cert`, `--etcd-key` flags).
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    /// CA certificate to verify the etcd servers with (`--etcd-cacert`).
    pub ca_cert_pem: Option<PathBuf>,
    /// Client certificate and key for mutual TLS: both or neither.
    pub client_cert_pem: Option<PathBuf>,
    /// Client private key for mutual TLS (`--etcd-key`).
    pub client_key_pem: Option<PathBuf>,
    /// Server name to verify, when the endpoints are IP addresses the certificate does not name.
    pub domain_name: Option<String>,
}

/// How to connect to etcd: authentication, TLS and timeouts.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// etcd authentication: both or neither.
    pub username: Option<String>,
    /// etcd password (with `username`).
    pub password: Option<String>,
    /// TLS; endpoints without a scheme then use `https://`.
    pub tls: Option<EtcdTls>,
    /// Bound on one connection attempt (connect + authenticate + status probe).
    pub connect_timeout: Duration,
    /// Bound on each unary request (get, put, txn, lease calls).
    pub op_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            username: None,
            password: None,
            tls: None,
            connect_timeout: Duration::from_secs(2),
            op_timeout: Duration::from_secs(5),
        }
    }
}

type Keeper = (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

/// A [`MetaStore`] backed by an etcd cluster (KV, Lease, Watch and Election services).
pub struct EtcdStore {
    client: Client,
    endpoints: Vec<String>,
    op_timeout: Duration,
    /// One open keep-alive stream per lease this process refreshes.
    keepers: tokio::sync::Mutex<HashMap<i64, Keeper>>,
}

/// Why an attempt failed: worth retrying (etcd not up yet) or not (bad configuration).
enum AttemptError {
    Retryable(String),
    Fatal(MetaError),
}

impl EtcdStore {
    /// Connects and checks that the cluster answers; one attempt bounded by
    /// `opts.connect_timeout`. An unreachable cluster gives [`MetaError::Unreachable`] naming
    /// the endpoints.
    pub async fn connect(endpoints: &[String], opts: &EtcdOptions) -> Result<Self, MetaError> {
        let connect_opts = connect_options(endpoints, opts)?;
        match attempt(endpoints, &connect_opts, opts).await {
            Ok(store) => Ok(store),
            Err(AttemptError::Fatal(e)) => Err(e),
            Err(AttemptError::Retryable(reason)) => {
                Err(MetaError::Unreachable { endpoints: endpoints.join(","), attempts: 1, reason })
            }
        }
    }

    /// Like [`EtcdStore::connect`], retrying for up to `max_wait` with exponential backoff
    /// (100 ms doubling to 5 s), logging each failed attempt with `tracing::warn!`. Gives up
    /// with [`MetaError::Unreachable`] once `max_wait` has passed (the last attempt may overrun
    /// it by up to `connect_timeout`); configuration errors are returned at once.
    pub async fn connect_with_retry(
        endpoints: &[String],
        opts: &EtcdOptions,
        max_wait: Duration,
    ) -> Result<Self, MetaError> {
        let connect_opts = connect_options(endpoints, opts)?;
        let started = Instant::now();
        let mut delay = RETRY_INITIAL;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            match attempt(endpoints, &connect_opts, opts).await {
                Ok(store) => {
                    if attempts > 1 {
                        tracing::info!(endpoints = %endpoints.join(","), attempts, "connected to etcd");
                    }
                    return Ok(store);
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retryable(reason)) => {
                    let elapsed = started.elapsed();
                    if elapsed >= max_wait {
                        return Err(MetaError::Unreachable { endpoints: endpoints.join(","), attempts, reason });
                    }
                    let pause = delay.min(max_wait - elapsed);
                    tracing::warn!(
                        endpoints = %endpoints.join(","),
                        attempt = attempts,
                        retry_in_ms = pause.as_millis() as u64,
                        %reason,
                        "etcd not reachable; retrying"
                    );
                    tokio::time::sleep(pause).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// The endpoints it was connected with.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Runs one unary request under the op timeout.
    async fn unary<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, MetaError> {
        match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(MetaError::Etcd { op, source }),
            Err(_) => Err(MetaError::Timeout { op, timeout_ms: self.op_timeout.as_millis() as u64 }),
        }
    }

    async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, MetaError> {
        let mut kv = self.client.kv_client();
        self.unary("txn", kv.txn(txn)).await
    }

    /// One refresh on the lease's cached keep-alive stream, reopening it if needed.
    async fn refresh(&self, keepers: &mut HashMap<i64, Keeper>, lease: LeaseId) -> Result<Duration, MetaError> {
        if let Some((keeper, stream)) = keepers.get_mut(&lease.0) {
            let answer = match keeper.keep_alive().await {
                Ok(()) => stream.message().await,
                Err(e) => Err(e),
            };
            match answer {
                Ok(Some(resp)) if resp.ttl() > 0 => return Ok(Duration::from_secs(resp.ttl() as u64)),
                Ok(Some(_)) => {
                    keepers.remove(&lease.0);
                    return Err(MetaError::LeaseNotFound(lease));
                }
                // Broken stream (etcd restarted, connection reset): reopen below.
                Ok(None) | Err(_) => {
                    keepers.remove(&lease.0);
                }
            }
        }
        let not_found = |e: etcd_client::Error| {
            if is_lease_not_found(&e) {
                MetaError::LeaseNotFound(lease)
            } else {
                MetaError::Etcd { op: "lease keep-alive", source: e }
            }
        };
        let mut leases = self.client.lease_client();
        // Opening the stream refreshes once and proves the lease exists; a second refresh on it
        // reads the TTL etcd granted.
        let (mut keeper, mut stream) = leases.keep_alive(lease.0).await.map_err(not_found)?;
        keeper.keep_alive().await.map_err(not_found)?;
        let ttl = match stream.message().await.map_err(not_found)? {
            Some(resp) if resp.ttl() > 0 => Duration::from_secs(resp.ttl() as u64),
            Some(_) => return Err(MetaError::LeaseNotFound(lease)),
            None => {
                return Err(MetaError::StreamClosed {
                    what: "lease keep-alive",
                    reason: "etcd closed the stream".into(),
                })
            }
        };
        keepers.insert(lease.0, (keeper, stream));
        Ok(ttl)
    }
}

/// Builds etcd-client's options from ours, reading the TLS files (errors name the file).
fn connect_options(endpoints: &[String], opts: &EtcdOptions) -> Result<ConnectOptions, MetaError> {
    if endpoints.is_empty() || endpoints.iter().any(|e| e.trim().is_empty()) {
        return Err(MetaError::InvalidOption {
            field: "endpoints",
            reason: format!("need at least one non-empty endpoint, got {endpoints:?}"),
        });
    }
    if let Some(bad) = endpoints.iter().find(|e| !is_endpoint(e)) {
        return Err(MetaError::InvalidOption {
            field: "endpoints",
            reason: format!("`{bad}` is not HOST:PORT or http(s)://HOST:PORT"),
        });
    }
    // etcd rejects gRPC keep-alive pings more often than every 5 s (`--grpc-keepalive-min-time`)
    // and pings on idle connections; these values stay inside that policy.
    let mut co = ConnectOptions::new()
        .with_connect_timeout(opts.connect_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    match (&opts.username, &opts.password) {
        (Some(user), Some(password)) => co = co.with_user(user.clone(), password.clone()),
        (None, None) => {}
        _ => {
            return Err(MetaError::InvalidOption { field: "username/password", reason: "give both or neither".into() })
        }
    }
    if let Some(tls) = &opts.tls {
        co = co.with_tls(tls_options(tls)?);
    }
    Ok(co)
}

/// `HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT` (a path after it allowed): what
/// etcd-client dials. Anything else would be retried forever as an unreachable etcd.
fn is_endpoint(endpoint: &str) -> bool {
    let rest = endpoint.strip_prefix("https://").or_else(|| endpoint.strip_prefix("http://")).unwrap_or(endpoint);
    let authority = rest.split('/').next().unwrap_or_default();
    match authority.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && !host.contains("://") && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

fn read_pem(field: &'static str, path: &Path) -> Result<Vec<u8>, MetaError> {
    std::fs::read(path).map_err(|source| MetaError::TlsFile { field, path: path.to_owned(), source })
}

fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, MetaError> {
    let mut out = TlsOptions::new();
    if let Some(ca) = &tls.ca_cert_pem {
        out = out.ca_certificate(Certificate::from_pem(read_pem("CA certificate", ca)?));
    }
    match (&tls.client_cert_pem, &tls.client_key_pem) {
        (Some(cert), Some(key)) => {
            out = out.identity(Identity::from_pem(read_pem("client certificate", cert)?, read_pem("client key", key)?));
        }
        (None, None) => {}
        _ => {
            return Err(MetaError::InvalidOption {
                field: "client_cert_pem/client_key_pem",
                reason: "give both the client certificate and its key, or neither".into(),
            })
        }
    }
    if let Some(domain) = &tls.domain_name {
        out = out.domain_name(domain.clone());
    }
    Ok(out)
}

/// One connection attempt: connect (lazy in etcd-client), authenticate if configured, and
/// probe with a status request so an unreachable cluster is reported now, not as a hung call.
async fn attempt(
    endpoints: &[String],
    connect_opts: &ConnectOptions,
    opts: &EtcdOptions,
) -> Result<EtcdStore, AttemptError> {
    let fut = async {
        let mut client = Client::connect(endpoints, Some(connect_opts.clone())).await?;
        client.status().await?;
        Ok::<_, etcd_client::Error>(client)
    };
    match tokio::time::timeout(opts.connect_timeout, fut).await {
        Ok(Ok(client)) => Ok(EtcdStore {
            client,
            endpoints: endpoints.to_vec(),
            op_timeout: opts.op_timeout,
            keepers: tokio::sync::Mutex::new(HashMap::new()),
        }),
        Ok(Err(e)) => Err(classify_connect_error(e)),
        Err(_) => Err(AttemptError::Retryable(format!("no answer within {} ms", opts.connect_timeout.as_millis()))),
    }
}

fn classify_connect_error(e: etcd_client::Error) -> AttemptError {
    use etcd_client::Error as E;
    match &e {
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            AttemptError::Fatal(MetaError::InvalidOption { field: "endpoints", reason: e.to_string() })
        }
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument | tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            ) =>
        {
            AttemptError::Fatal(MetaError::Etcd { op: "connect", source: e })
        }
        _ => AttemptError::Retryable(e.to_string()),
    }
}

fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::NotFound || s.message().contains("lease not found")
        }
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
        _ => false,
    }
}

fn convert_kv(kv: &etcd_client::KeyValue) -> Result<KeyValue, MetaError> {
    let key = std::str::from_utf8(kv.key())
        .map_err(|_| MetaError::NonUtf8Key { key: String::from_utf8_lossy(kv.key()).into_owned() })?;
    Ok(KeyValue {
        key: key.to_owned(),
        value: kv.value().to_vec(),
        create_revision: Revision(kv.create_revision()),
        mod_revision: Revision(kv.mod_revision()),
        lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
    })
}

fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Revision {
    Revision(header.map_or(0, |h| h.revision()))
}

fn compare(condition: &Condition) -> Compare {
    match condition {
        // A key that does not exist has create revision 0.
        Condition::Absent { key } => Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
        Condition::ModRevision { key, revision } => Compare::mod_revision(key.as_str(), CompareOp::Equal, revision.0),
        Condition::CreateRevision { key, revision } => {
            Compare::create_revision(key.as_str(), CompareOp::Equal, revision.0)
        }
    }
}

fn lease_error(lease: LeaseId, op: &'static str) -> impl Fn(MetaError) -> MetaError {
    move |e| match e {
        MetaError::Etcd { source, .. } if is_lease_not_found(&source) => MetaError::LeaseNotFound(lease),
        MetaError::Etcd { source, .. } => MetaError::Etcd { op, source },
        other => other,
    }
}

impl MetaStore for EtcdStore {
    fn store_kind(&self) -> &'static str {
        "etcd"
    }

    fn put<'a>(&'a self, key: &'a str, value: &'a [u8]) -> MetaFuture<'a, Revision> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = self.unary("put", kv.put(key, value, None)).await?;
            Ok(header_revision(resp.header()))
        })
    }

    fn put_with_lease<'a>(&'a self, key: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, Revision> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let opts = PutOptions::new().with_lease(lease.0);
            let resp = self.unary("put", kv.put(key, value, Some(opts))).await.map_err(lease_error(lease, "put"))?;
            Ok(header_revision(resp.header()))
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> MetaFuture<'a, Option<KeyValue>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = self.unary("get", kv.get(key, None)).await?;
            resp.kvs().first().map(convert_kv).transpose()
        })
    }

    fn get_prefix<'a>(&'a self, prefix: &'a str) -> MetaFuture<'a, Listing> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = self.unary("get", kv.get(prefix, Some(GetOptions::new().with_prefix()))).await?;
            let kvs = resp.kvs().iter().map(convert_kv).collect::<Result<Vec<_>, _>>()?;
            Ok(Listing { kvs, revision: header_revision(resp.header()) })
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> MetaFuture<'a, bool> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = self.unary("delete", kv.delete(key, None)).await?;
            Ok(resp.deleted() > 0)
        })
    }

    fn put_if<'a>(
        &'a self,
        key: &'a str,
        value: &'a [u8],
        lease: Option<LeaseId>,
        conditions: &'a [Condition],
    ) -> MetaFuture<'a, Option<Revision>> {
        Box::pin(async move {
            let opts = lease.map(|l| PutOptions::new().with_lease(l.0));
            let txn = Txn::new()
                .when(conditions.iter().map(compare).collect::<Vec<_>>())
                .and_then(vec![TxnOp::put(key, value, opts)]);
            let resp = match lease {
                Some(l) => self.txn(txn).await.map_err(lease_error(l, "txn"))?,
                None => self.txn(txn).await?,
            };
            Ok(resp.succeeded().then(|| header_revision(resp.header())))
        })
    }

    fn delete_if<'a>(&'a self, key: &'a str, conditions: &'a [Condition]) -> MetaFuture<'a, Option<Revision>> {
        Box::pin(async move {
            let txn = Txn::new()
                .when(conditions.iter().map(compare).collect::<Vec<_>>())
                .and_then(vec![TxnOp::delete(key, None)]);
            let resp = self.txn(txn).await?;
            Ok(resp.succeeded().then(|| header_revision(resp.header())))
        })
    }

    fn grant_lease(&self, ttl: Duration) -> MetaFuture<'_, LeaseId> {
        Box::pin(async move {
            if ttl.is_zero() {
                return Err(MetaError::InvalidOption {
                    field: "lease ttl",
                    reason: "must be greater than zero".into(),
                });
            }
            // etcd counts whole seconds; round up so a lease never lives shorter than asked.
            let ttl_s = ttl.as_millis().div_ceil(1000).min(i64::MAX as u128) as i64;
            let mut leases = self.client.lease_client();
            let resp = self.unary("lease grant", leases.grant(ttl_s, None)).await?;
            if !resp.error().is_empty() {
                return Err(MetaError::InvalidOption { field: "lease ttl", reason: resp.error().to_owned() });
            }
            Ok(LeaseId(resp.id()))
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> MetaFuture<'_, Duration> {
        Box::pin(async move {
            let mut keepers = self.keepers.lock().await;
            match tokio::time::timeout(self.op_timeout, self.refresh(&mut keepers, lease)).await {
                Ok(result) => result,
                Err(_) => {
                    // A half-finished exchange would desynchronise the stream: start afresh.
                    keepers.remove(&lease.0);
                    Err(MetaError::Timeout { op: "lease keep-alive", timeout_ms: self.op_timeout.as_millis() as u64 })
                }
            }
        })
    }

    fn revoke(&self, lease: LeaseId) -> MetaFuture<'_, ()> {
        Box::pin(async move {
            self.keepers.lock().await.remove(&lease.0);
            let mut leases = self.client.lease_client();
            self.unary("lease revoke", leases.revoke(lease.0)).await.map_err(lease_error(lease, "lease revoke"))?;
            Ok(())
        })
    }

    fn watch_prefix<'a>(
        &'a self,
        prefix: &'a str,
        from_revision: Option<Revision>,
    ) -> MetaFuture<'a, MetaStream<WatchEvent>> {
        Box::pin(async move {
            let mut opts = WatchOptions::new().with_prefix();
            if let Some(from) = from_revision {
                opts = opts.with_start_revision(from.0);
            }
            let mut watch = self.client.watch_client();
            let mut ws = self.unary("watch", watch.watch(prefix, Some(opts))).await?;
            // Wait until etcd confirms the watch, so changes made after we return are seen.
            let mut early = Vec::new();
            loop {
                let resp = self.unary("watch", ws.message()).await?;
                let Some(resp) = resp else {
                    return Err(MetaError::StreamClosed { what: "watch", reason: "closed before creation".into() });
                };
                if resp.canceled() {
                    return Err(watch_cancelled(&resp, from_revision));
                }
                early.push(resp.clone());
                if resp.created() {
                    break;
                }
            }
            let (tx, rx) = mpsc::channel(STREAM_BUFFER);
            tokio::spawn(async move {
                for resp in early {
                    if !forward_events(&resp, &tx).await {
                        return;
                    }
                }
                loop {
                    let msg = tokio::select! {
                        _ = tx.closed() => return,
                        msg = ws.message() => msg,
                    };
                    let resp = match msg {
                        Ok(Some(resp)) => resp,
                        Ok(None) => {
                            let closed =
                                MetaError::StreamClosed { what: "watch", reason: "etcd ended the stream".into() };
                            let _ = tx.send(Err(closed)).await;
                            return;
                        }
                        Err(source) => {
                            let _ = tx.send(Err(MetaError::Etcd { op: "watch", source })).await;
                            return;
                        }
                    };
                    if resp.canceled() {
                        let _ = tx.send(Err(watch_cancelled(&resp, from_revision))).await;
                        return;
                    }
                    if !forward_events(&resp, &tx).await {
                        return;
                    }
                }
            });
            let stream: MetaStream<WatchEvent> = Box::pin(ReceiverStream::new(rx));
            Ok(stream)
        })
    }

    fn campaign<'a>(&'a self, name: &'a str, value: &'a [u8], lease: LeaseId) -> MetaFuture<'a, LeaderKey> {
        Box::pin(async move {
            let mut election = self.client.election_client();
            // No op timeout: campaigning blocks until this candidate leads.
            let resp = election.campaign(name, value, lease.0).await.map_err(|e| {
                if is_lease_not_found(&e) {
                    MetaError::LeaseNotFound(lease)
                } else {
                    MetaError::Etcd { op: "campaign", source: e }
                }
            })?;
            let Some(leader) = resp.leader() else {
                return Err(MetaError::Election {
                    election: name.to_owned(),
                    reason: "etcd answered the campaign without a leader key".into(),
                });
            };
            let key = std::str::from_utf8(leader.key())
                .map_err(|_| MetaError::NonUtf8Key { key: String::from_utf8_lossy(leader.key()).into_owned() })?;
            Ok(LeaderKey {
                name: name.to_owned(),
                key: key.to_owned(),
                create_revision: Revision(leader.rev()),
                lease: LeaseId(leader.lease()),
            })
        })
    }

    fn observe<'a>(&'a self, name: &'a str) -> MetaFuture<'a, MetaStream<Vec<u8>>> {
        Box::pin(async move {
            let mut election = self.client.election_client();
            let name = name.to_owned();
            let (tx, rx) = mpsc::channel(STREAM_BUFFER);
            // etcd answers the observe call only once there is a leader, so open it in the task
            // (no op timeout: waiting for a first leader is the point).
            tokio::spawn(async move {
                let opened = tokio::select! {
                    _ = tx.closed() => return,
                    opened = election.observe(name) => opened,
                };
                let mut obs = match opened {
                    Ok(obs) => obs,
                    Err(source) => {
                        let _ = tx.send(Err(MetaError::Etcd { op: "observe", source })).await;
                        return;
                    }
                };
                loop {
                    let msg = tokio::select! {
                        _ = tx.closed() => return,
                        msg = obs.message() => msg,
                    };
                    let item = match msg {
                        Ok(Some(resp)) => match resp.kv() {
                            Some(kv) => Ok(kv.value().to_vec()),
                            None => continue,
                        },
                        Ok(None) => {
                            Err(MetaError::StreamClosed { what: "observe", reason: "etcd ended the stream".into() })
                        }
                        Err(source) => Err(MetaError::Etcd { op: "observe", source }),
                    };
                    let end = item.is_err();
                    if tx.send(item).await.is_err() || end {
                        return;
                    }
                }
            });
            let stream: MetaStream<Vec<u8>> = Box::pin(ReceiverStream::new(rx));
            Ok(stream)
        })
    }

    fn resign<'a>(&'a self, leader: &'a LeaderKey) -> MetaFuture<'a, ()> {
        Box::pin(async move {
            // Deleting the key under the same fencing check etcd's Resign uses; a plain txn
            // avoids the election service's session bookkeeping on a possibly-expired lease.
            let txn = Txn::new()
                .when(vec![compare(&Condition::leader(leader))])
                .and_then(vec![TxnOp::delete(leader.key.as_str(), None)]);
            self.txn(txn).await?;
            Ok(())
        })
    }

    fn leader<'a>(&'a self, name: &'a str) -> MetaFuture<'a, Option<Vec<u8>>> {
        Box::pin(async move {
            let mut election = self.client.election_client();
            match tokio::time::timeout(self.op_timeout, election.leader(name)).await {
                Ok(Ok(resp)) => Ok(resp.kv().map(|kv| kv.value().to_vec())),
                Ok(Err(etcd_client::Error::GRpcStatus(s))) if s.message().contains("no leader") => Ok(None),
                Ok(Err(source)) => Err(MetaError::Etcd { op: "leader", source }),
                Err(_) => Err(MetaError::Timeout { op: "leader", timeout_ms: self.op_timeout.as_millis() as u64 }),
            }
        })
    }
}

fn watch_cancelled(resp: &etcd_client::WatchResponse, from: Option<Revision>) -> MetaError {
    if resp.compact_revision() > 0 {
        MetaError::Compacted { requested: from.unwrap_or(Revision(0)), compacted: Revision(resp.compact_revision()) }
    } else {
        MetaError::StreamClosed { what: "watch", reason: format!("cancelled by etcd: {}", resp.cancel_reason()) }
    }
}

/// Sends a response's events in order; `false` once the receiver is gone.
async fn forward_events(resp: &etcd_client::WatchResponse, tx: &mpsc::Sender<Result<WatchEvent, MetaError>>) -> bool {
    for ev in resp.events() {
        let Some(kv) = ev.kv() else { continue };
        let item = convert_kv(kv).map(|kv| WatchEvent {
            kind: match ev.event_type() {
                EventType::Put => EventKind::Put,
                EventType::Delete => EventKind::Delete,
            },
            revision: kv.mod_revision,
            key: kv.key,
            value: kv.value,
        });
        if tx.send(item).await.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_errors_name_the_field_or_file() {
        let eps = vec!["127.0.0.1:2379".to_owned()];
        let cases: Vec<(EtcdOptions, &str)> = vec![
            (EtcdOptions { username: Some("u".into()), ..Default::default() }, "username/password"),
            (
                EtcdOptions {
                    tls: Some(EtcdTls { client_cert_pem: Some("/x.pem".into()), ..Default::default() }),
                    ..Default::default()
                },
                "client_cert_pem/client_key_pem",
            ),
            (
                EtcdOptions {
                    tls: Some(EtcdTls { ca_cert_pem: Some("/nonexistent/ca.pem".into()), ..Default::default() }),
                    ..Default::default()
                },
                "/nonexistent/ca.pem",
            ),
        ];
        for (opts, expected) in cases {
            let err = connect_options(&eps, &opts).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(expected), "{err:?} should mention {expected}");
        }
        let err = connect_options(&[], &EtcdOptions::default()).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("endpoints")));
    }

    #[tokio::test]
    async fn malformed_endpoint_is_a_configuration_error_not_a_retry() {
        let eps = vec!["http://exa mple:1".to_owned()];
        let started = std::time::Instant::now();
        let err = EtcdStore::connect_with_retry(&eps, &EtcdOptions::default(), Duration::from_secs(30))
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("endpoints"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn endpoints_are_host_port_with_or_without_a_scheme() {
        for ok in ["127.0.0.1:2379", "http://etcd:2379", "https://[::1]:2379", "etcd-0.etcd:2379/", "localhost:1"] {
            assert!(is_endpoint(ok), "{ok}");
        }
        for bad in ["notaurl", "etcd", "http://etcd", ":2379", "etcd:0", "etcd:99999", "unix://x:1", "https://"] {
            assert!(!is_endpoint(bad), "{bad}");
            let eps = vec![bad.to_owned()];
            let err = connect_options(&eps, &EtcdOptions::default()).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(&format!("`{bad}` is not HOST:PORT")), "{bad}: {err}");
        }
    }
}
