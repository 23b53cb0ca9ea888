//! The cluster PKI: one CA per cluster, one certificate per process, mutual TLS everywhere.
//!
//! Every process of a kvfleet cluster (coordinator, worker, client) holds a certificate signed by
//! the cluster CA and trusts only that CA: a server accepts a connection only from a client whose
//! certificate chains to it, and a client accepts only a server whose certificate does. So a
//! process without a cluster certificate can neither register as a worker, submit work, read
//! results, nor open a KV transfer. Membership, not host names, is what is checked: every node
//! certificate carries the SAN [`CLUSTER_SERVER_NAME`] and clients verify servers against that
//! name, so the same certificates work on loopback, in docker-compose and across hosts (each
//! certificate also names its own hosts for operators' tools).
//!
//! `kvfleet up` generates a CA and per-process certificates in its output directory; operators
//! supply their own (`kvfleet certs init` / `kvfleet certs issue`, or any CA: the files are plain
//! PEM). [`TlsArgs`] is the flag set every binary shares; `--plaintext` turns TLS off for local
//! debugging, loudly.

#![warn(missing_docs)]

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name every node certificate carries and every client verifies (cluster membership).
pub const CLUSTER_SERVER_NAME: &str = "kvfleet.cluster";

/// File name of the CA certificate in a PKI directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the CA key in a PKI directory (only where certificates are issued).
pub const CA_KEY_FILE: &str = "ca.key";

/// What went wrong, naming the file or the step.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A PEM file could not be read.
    #[error("reading {path}: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A PEM file (or its directory, or its permissions) could not be written.
    #[error("writing {path}: {cause}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// rcgen failed to generate a key, certificate parameters or a certificate.
    #[error("{what}: {cause}")]
    Generate {
        /// The step that failed (e.g. "CA key", "node certificate").
        what: String,
        /// rcgen's error.
        cause: rcgen::Error,
    },
    /// A certificate or key is not valid PEM, or holds no block of the expected kind.
    #[error("{what}: not valid PEM ({cause})")]
    Pem {
        /// The file or object that was parsed.
        what: String,
        /// Why it was rejected.
        cause: String,
    },
    /// rustls rejected the TLS configuration (certificate, key or protocol versions).
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client-certificate verifier could not be built from the CA roots.
    #[error("TLS client verifier: {0}")]
    Verifier(String),
    /// No TLS flags were given and `--plaintext` was not either.
    #[error(
        "no cluster certificate: pass --tls-dir DIR (with ca.pem, node.pem, node.key) or \
         --tls-ca/--tls-cert/--tls-key, or --plaintext for an insecure local debugging cluster"
    )]
    Missing,
    /// Only some of `--tls-ca`, `--tls-cert`, `--tls-key` were given; names the first missing flag.
    #[error("--tls-ca, --tls-cert and --tls-key go together; missing {0}")]
    Incomplete(&'static str),
}

/// The role a certificate is issued for, recorded as its subject's organizational unit
/// ([`role_of`]); the servers check it per RPC ([`authorize`]) and on the KV port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The coordinator (leader or standby): places requests, orders migrations, drains workers.
    Coordinator,
    /// A worker hosting engine instances; the only role the KV (QUIC) port accepts.
    Worker,
    /// A client submitting requests and reading results (the CLI's replay, a load generator).
    Client,
    /// An operator's tool: reads status, drains and shuts down workers, submits.
    Operator,
}

impl Role {
    /// Every role, in the order `kvfleet certs` lists them.
    pub const ALL: [Role; 4] = [Role::Coordinator, Role::Worker, Role::Client, Role::Operator];

    /// The role's name as written in certificate subjects (`coordinator`, `worker`, `client`,
    /// `operator`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Coordinator => "coordinator",
            Role::Worker => "worker",
            Role::Client => "client",
            Role::Operator => "operator",
        }
    }

    /// The role named `name` (as [`Role::as_str`] writes it).
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// The role a DER certificate was issued for (its subject's organizational unit), if any.
pub fn role_of(cert_der: &[u8]) -> Option<Role> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let ou = cert.subject().iter_organizational_unit().next()?.as_str().ok()?;
    Role::parse(ou)
}

/// Refuses (`PERMISSION_DENIED`, naming what is needed) an RPC whose caller's certificate is not
/// one of `allowed`. A server without TLS (`--plaintext`) has no certificates to check and lets
/// every call through: plaintext is for local debugging only.
pub fn authorize<T>(request: &tonic::Request<T>, allowed: &[Role], rpc: &str) -> Result<(), tonic::Status> {
    let Some(certs) = request.peer_certs() else { return Ok(()) };
    match certs.first().and_then(|c| role_of(c.as_ref())) {
        Some(role) if allowed.contains(&role) => Ok(()),
        got => {
            let want: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
            Err(tonic::Status::permission_denied(format!(
                "{rpc} needs a {} certificate; the caller's is {}",
                want.join(" or "),
                got.map_or("without a kvfleet role".to_string(), |r| format!("a {} certificate", r.as_str()))
            )))
        }
    }
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|cause| PkiError::Read { path: path.to_path_buf(), cause })
}

/// Write `path` whole or not at all: the contents go to a temporary file beside it, which is
/// then renamed over it, so a process reading it meanwhile (etcd loads its `--trusted-ca-file`
/// after it says it is ready, while the next certificate is issued) sees the old file or the new
/// one, never a truncated one. A key's temporary file is created with mode 0600.
fn write(path: &Path, contents: &str, private: bool) -> Result<(), PkiError> {
    use std::io::Write as _;
    let err = |cause| PkiError::Write { path: path.to_path_buf(), cause };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        open.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    let written = open.open(&tmp).and_then(|mut f| {
        // An existing temporary file keeps its mode: set it again.
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::PermissionsExt as _;
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        }
        f.write_all(contents.as_bytes())?;
        f.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(cause) => {
            let _ = std::fs::remove_file(&tmp);
            Err(err(cause))
        }
    }
}

fn generate<T>(what: &str, r: Result<T, rcgen::Error>) -> Result<T, PkiError> {
    r.map_err(|cause| PkiError::Generate { what: what.to_string(), cause })
}

/// A cluster CA that can issue node certificates.
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A fresh CA (ECDSA P-256) named after `cluster`.
    pub fn generate(cluster: &str) -> Result<ClusterCa, PkiError> {
        let key = generate("CA key", KeyPair::generate())?;
        let mut params = generate("CA parameters", CertificateParams::new(Vec::<String>::new()))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("kvfleet cluster CA ({cluster})"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = generate("CA certificate", params.self_signed(&key))?;
        let cert_pem = cert.pem();
        let key_pem = key.serialize_pem();
        Ok(ClusterCa { cert_pem, key_pem, issuer: Issuer::new(params, key) })
    }

    /// Load `ca.pem` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<ClusterCa, PkiError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = read(&cert_path)?;
        let key_pem = read(&key_path)?;
        let pem_err = |path: &Path| {
            let what = path.display().to_string();
            move |cause: rcgen::Error| PkiError::Pem { what, cause: cause.to_string() }
        };
        let key = KeyPair::from_pem(&key_pem).map_err(pem_err(&key_path))?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(pem_err(&cert_path))?;
        Ok(ClusterCa { cert_pem, key_pem, issuer })
    }

    /// Write `ca.pem` and `ca.key` (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), PkiError> {
        write(&dir.join(CA_CERT_FILE), &self.cert_pem, false)?;
        write(&dir.join(CA_KEY_FILE), &self.key_pem, true)
    }

    /// The CA certificate (PEM), to distribute to every process as its trust root.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for one process: subject `kvfleet <role> <name>`, SANs the cluster name,
    /// `localhost`, `127.0.0.1` and `hosts` (names or IP addresses).
    pub fn issue(&self, role: Role, name: &str, hosts: &[String]) -> Result<NodeIdentity, PkiError> {
        self.issue_as(Some(role), name, hosts)
    }

    /// A certificate for a service the cluster runs beside its own processes (its etcd): subject
    /// `kvfleet service <name>`, the same SANs and extended key usages as [`ClusterCa::issue`]
    /// (server and client authentication: etcd also presents its server certificate as a client
    /// to its own gRPC gateway), but **no role**, so the kvfleet servers' role checks
    /// ([`authorize`], the KV port) refuse it: the service's key opens no kvfleet RPC.
    pub fn issue_service(&self, name: &str, hosts: &[String]) -> Result<NodeIdentity, PkiError> {
        self.issue_as(None, name, hosts)
    }

    fn issue_as(&self, role: Option<Role>, name: &str, hosts: &[String]) -> Result<NodeIdentity, PkiError> {
        let mut sans = vec![CLUSTER_SERVER_NAME.to_string(), "localhost".to_string(), "127.0.0.1".to_string()];
        for h in hosts {
            if !sans.contains(h) {
                sans.push(h.clone());
            }
        }
        let key = generate("node key", KeyPair::generate())?;
        let mut params = generate("node certificate parameters", CertificateParams::new(sans))?;
        let kind = role.map_or("service", Role::as_str);
        params.distinguished_name.push(DnType::CommonName, format!("kvfleet {kind} {name}"));
        if let Some(role) = role {
            params.distinguished_name.push(DnType::OrganizationalUnitName, role.as_str());
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = generate("node certificate", params.signed_by(&key, &self.issuer))?;
        Ok(NodeIdentity { ca_pem: self.cert_pem.clone(), cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }
}

/// One process's TLS material: the cluster CA certificate, its own certificate and key (PEM).
#[derive(Clone)]
pub struct NodeIdentity {
    /// The cluster CA certificate (PEM): the only trust root.
    pub ca_pem: String,
    /// This process's certificate (PEM), signed by the cluster CA.
    pub cert_pem: String,
    /// This process's private key (PEM).
    pub key_pem: String,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity").finish_non_exhaustive()
    }
}

/// The three files of one identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityFiles {
    /// The cluster CA certificate (`ca.pem`).
    pub ca: PathBuf,
    /// This process's certificate (`<stem>.pem`).
    pub cert: PathBuf,
    /// This process's private key (`<stem>.key`, mode 0600).
    pub key: PathBuf,
}

impl IdentityFiles {
    /// `DIR/ca.pem`, `DIR/<stem>.pem`, `DIR/<stem>.key`.
    pub fn in_dir(dir: &Path, stem: &str) -> IdentityFiles {
        IdentityFiles {
            ca: dir.join(CA_CERT_FILE),
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}.key")),
        }
    }
}

impl NodeIdentity {
    /// Read and check the three PEM files.
    pub fn load(files: &IdentityFiles) -> Result<NodeIdentity, PkiError> {
        let id = NodeIdentity { ca_pem: read(&files.ca)?, cert_pem: read(&files.cert)?, key_pem: read(&files.key)? };
        // Parse now so a bad file is named here, not as an opaque handshake failure later.
        certs(&id.ca_pem, &files.ca.display().to_string())?;
        certs(&id.cert_pem, &files.cert.display().to_string())?;
        key(&id.key_pem, &files.key.display().to_string())?;
        Ok(id)
    }

    /// Write the three files (the key with mode 0600).
    pub fn save(&self, files: &IdentityFiles) -> Result<(), PkiError> {
        write(&files.ca, &self.ca_pem, false)?;
        write(&files.cert, &self.cert_pem, false)?;
        write(&files.key, &self.key_pem, true)
    }

    /// gRPC server side: present this certificate, require a client certificate from the CA.
    pub fn tonic_server(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(tonic::transport::Certificate::from_pem(&self.ca_pem))
    }

    /// gRPC client side: trust only the CA, present this certificate, verify the cluster name.
    pub fn tonic_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .identity(tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(CLUSTER_SERVER_NAME)
    }

    /// TLS 1.3 suites for the KV transport (QUIC), AES-128-GCM first: the same AEAD as
    /// AES-256-GCM with 10 AES rounds instead of 14, and the bulk KV bytes are all encrypted and
    /// decrypted on the hosts' CPUs (ring's default order puts AES-256 first).
    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        use rustls::crypto::ring::cipher_suite as cs;
        let mut p = rustls::crypto::ring::default_provider();
        p.cipher_suites =
            vec![cs::TLS13_AES_128_GCM_SHA256, cs::TLS13_AES_256_GCM_SHA384, cs::TLS13_CHACHA20_POLY1305_SHA256];
        Arc::new(p)
    }

    fn roots(&self) -> Result<rustls::RootCertStore, PkiError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&self.ca_pem, "the CA certificate")? {
            roots.add(c)?;
        }
        Ok(roots)
    }

    /// A TLS 1.3 server config (for QUIC) that requires a client certificate from the CA.
    pub fn rustls_server(&self) -> Result<rustls::ServerConfig, PkiError> {
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), Self::provider())
                .build()
                .map_err(|e| PkiError::Verifier(e.to_string()))?;
        Ok(rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs(&self.cert_pem, "the node certificate")?, key(&self.key_pem, "the node key")?)?)
    }

    /// A TLS 1.3 client config (for QUIC) trusting only the CA and presenting this certificate.
    /// Connect with server name [`CLUSTER_SERVER_NAME`].
    pub fn rustls_client(&self) -> Result<rustls::ClientConfig, PkiError> {
        Ok(rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(
                certs(&self.cert_pem, "the node certificate")?,
                key(&self.key_pem, "the node key")?,
            )?)
    }
}

fn certs(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| PkiError::Pem { what: what.to_string(), cause: e.to_string() })?;
    if certs.is_empty() {
        return Err(PkiError::Pem { what: what.to_string(), cause: "no CERTIFICATE block".to_string() });
    }
    Ok(certs)
}

fn key(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>, PkiError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| PkiError::Pem { what: what.to_string(), cause: e.to_string() })
}

/// The control-plane TLS flags every kvfleet binary takes.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TlsArgs {
    /// Directory with the cluster CA certificate and this process's certificate:
    /// `ca.pem`, `node.pem`, `node.key` (see `kvfleet certs`).
    #[arg(long, env = "KVFLEET_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// The cluster CA certificate (PEM); with --tls-cert and --tls-key, instead of --tls-dir.
    #[arg(long, env = "KVFLEET_TLS_CA", conflicts_with = "tls_dir")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), signed by the cluster CA.
    #[arg(long, env = "KVFLEET_TLS_CERT", conflicts_with = "tls_dir")]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long, env = "KVFLEET_TLS_KEY", conflicts_with = "tls_dir")]
    pub tls_key: Option<PathBuf>,
    /// INSECURE: run the control plane in plain text (local debugging only: any process that can
    /// reach a port can register as a worker, submit work and read results).
    #[arg(long, conflicts_with_all = ["tls_dir", "tls_ca", "tls_cert", "tls_key"])]
    pub plaintext: bool,
}

/// The warning a plain-text process prints first.
pub const PLAINTEXT_WARNING: &str = "WARNING: --plaintext: the control plane is NOT authenticated or encrypted; \
any process that can reach these ports can register as a worker, submit work and read results. \
Use it for local debugging only.";

impl TlsArgs {
    /// Flags naming an identity's files.
    pub fn files(files: &IdentityFiles) -> TlsArgs {
        TlsArgs {
            tls_ca: Some(files.ca.clone()),
            tls_cert: Some(files.cert.clone()),
            tls_key: Some(files.key.clone()),
            ..TlsArgs::default()
        }
    }

    /// The identity to use, or `None` in plain-text mode (after printing [`PLAINTEXT_WARNING`]
    /// to stderr and the log). No flags at all is an error: TLS is the default.
    pub fn load(&self) -> Result<Option<NodeIdentity>, PkiError> {
        if self.plaintext {
            eprintln!("{PLAINTEXT_WARNING}");
            tracing::warn!("{PLAINTEXT_WARNING}");
            return Ok(None);
        }
        let files = match (&self.tls_dir, &self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(dir), ..) => IdentityFiles::in_dir(dir, "node"),
            (None, None, None, None) => return Err(PkiError::Missing),
            (None, ca, cert, key) => IdentityFiles {
                ca: ca.clone().ok_or(PkiError::Incomplete("--tls-ca"))?,
                cert: cert.clone().ok_or(PkiError::Incomplete("--tls-cert"))?,
                key: key.clone().ok_or(PkiError::Incomplete("--tls-key"))?,
            },
        };
        NodeIdentity::load(&files).map(Some)
    }

    /// The flags as command-line arguments (to start a child process with the same identity).
    pub fn to_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.plaintext {
            out.push("--plaintext".to_string());
        }
        let mut push = |flag: &str, p: &Option<PathBuf>| {
            if let Some(p) = p {
                out.push(flag.to_string());
                out.push(p.display().to_string());
            }
        };
        push("--tls-dir", &self.tls_dir);
        push("--tls-ca", &self.tls_ca);
        push("--tls-cert", &self.tls_cert);
        push("--tls-key", &self.tls_key);
        out
    }
}

/// The URI scheme of a control-plane endpoint: `https` with TLS, `http` without.
pub fn scheme(tls: Option<&NodeIdentity>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

#[cfg(test)]
mod tests;

/// How often a channel from [`endpoint`] pings its peer.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(1000);
/// How long a ping may go unanswered before the connection (and its streams) is dropped: long
/// enough that a peer merely slowed by a loaded host (2 cores, a build running) is not cut off.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(4000);

/// A gRPC endpoint for `addr` (`host:port`): `https` with mutual TLS when `tls` is given,
/// plain `http` otherwise.
pub fn endpoint(addr: &str, tls: Option<&NodeIdentity>) -> Result<tonic::transport::Endpoint, String> {
    // HTTP/2 pings, also on idle connections: a peer that stopped (SIGSTOP, a frozen host) still
    // has its kernel ACK our TCP segments, so without them a stream from it just goes quiet and
    // its reader waits for as long as the pause lasts. Unanswered pings end the connection, its
    // streams fail, and callers move on (a client to the next leader) within about a second.
    let ep = tonic::transport::Endpoint::from_shared(format!("{}://{addr}", scheme(tls)))
        .map_err(|e| format!("bad address {addr}: {e}"))?
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    match tls {
        Some(id) => ep.tls_config(id.tonic_client()).map_err(|e| format!("TLS for {addr}: {e}")),
        None => Ok(ep),
    }
}
