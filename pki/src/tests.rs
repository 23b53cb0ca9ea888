use super::*;
use rustls::pki_types::ServerName;
use std::sync::Arc;

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvfleet-pki-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Run a TLS handshake between two in-memory rustls endpoints; `Err` names the side that failed.
fn handshake(client: rustls::ClientConfig, server: rustls::ServerConfig) -> Result<(), String> {
    let name = ServerName::try_from(CLUSTER_SERVER_NAME).unwrap();
    let mut c = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
    let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
    for _ in 0..10 {
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).unwrap();
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            s.read_tls(&mut rd).unwrap();
        }
        s.process_new_packets().map_err(|e| format!("server: {e}"))?;
        let mut buf = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut buf).unwrap();
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            c.read_tls(&mut rd).unwrap();
        }
        c.process_new_packets().map_err(|e| format!("client: {e}"))?;
        if !c.is_handshaking() && !s.is_handshaking() {
            return Ok(());
        }
    }
    Err("handshake did not finish".into())
}

#[test]
fn cluster_members_complete_a_mutual_handshake() {
    let ca = ClusterCa::generate("test").unwrap();
    let server = ca.issue(Role::Worker, "0", &["10.0.0.7".into()]).unwrap();
    let client = ca.issue(Role::Coordinator, "0", &[]).unwrap();
    handshake(client.rustls_client().unwrap(), server.rustls_server().unwrap()).unwrap();
}

#[test]
fn a_service_certificate_has_no_role_and_serves_on_loopback() {
    let ca = ClusterCa::generate("test").unwrap();
    let etcd = ca.issue_service("etcd", &[]).unwrap();
    let der = certs(&etcd.cert_pem, "etcd").unwrap().remove(0);
    // No role: the kvfleet servers' role checks refuse it.
    assert_eq!(role_of(der.as_ref()), None);
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
    // Both EKUs: etcd needs serverAuth to serve and clientAuth for its own gateway.
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth);
    let sans = &cert.subject_alternative_name().unwrap().unwrap().value.general_names;
    use x509_parser::extensions::GeneralName;
    assert!(sans.contains(&GeneralName::IPAddress(&[127, 0, 0, 1])), "{sans:?}");
    assert!(sans.contains(&GeneralName::DNSName("localhost")), "{sans:?}");
    // A cluster member completes a mutual handshake with it.
    let member = ca.issue(Role::Coordinator, "0", &[]).unwrap();
    handshake(member.rustls_client().unwrap(), etcd.rustls_server().unwrap()).unwrap();
}

#[test]
fn a_certificate_from_another_ca_is_refused_both_ways() {
    let ca = ClusterCa::generate("ours").unwrap();
    let other = ClusterCa::generate("theirs").unwrap();
    let member = ca.issue(Role::Worker, "0", &[]).unwrap();
    let outsider = other.issue(Role::Worker, "x", &[]).unwrap();
    // An outsider client: the server refuses its certificate.
    let err = handshake(outsider_client_trusting(&outsider, &ca), member.rustls_server().unwrap()).unwrap_err();
    assert!(err.starts_with("server"), "{err}");
    // An outsider server: our client refuses it.
    let err = handshake(member.rustls_client().unwrap(), outsider.rustls_server().unwrap()).unwrap_err();
    assert!(err.starts_with("client"), "{err}");
}

/// A client with a foreign certificate that (cheating) trusts our CA, so only the server's check
/// can stop it.
fn outsider_client_trusting(outsider: &NodeIdentity, ca: &ClusterCa) -> rustls::ClientConfig {
    NodeIdentity { ca_pem: ca.cert_pem().to_string(), ..outsider.clone() }.rustls_client().unwrap()
}

#[test]
fn a_client_without_a_certificate_is_refused() {
    let ca = ClusterCa::generate("test").unwrap();
    let member = ca.issue(Role::Worker, "0", &[]).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca.cert_pem(), "ca").unwrap() {
        roots.add(c).unwrap();
    }
    let anonymous = rustls::ClientConfig::builder_with_provider(NodeIdentity::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let err = handshake(anonymous, member.rustls_server().unwrap()).unwrap_err();
    assert!(err.starts_with("server"), "{err}");
}

#[test]
fn ca_and_identities_round_trip_through_files() {
    let dir = tempdir("files");
    let ca = ClusterCa::generate("test").unwrap();
    ca.save(&dir).unwrap();
    let reloaded = ClusterCa::load(&dir).unwrap();
    assert_eq!(reloaded.cert_pem(), ca.cert_pem());
    // A certificate issued by the reloaded CA verifies against the original CA certificate.
    let files = IdentityFiles::in_dir(&dir, "node");
    reloaded.issue(Role::Worker, "1", &[]).unwrap().save(&files).unwrap();
    let node = NodeIdentity::load(&files).unwrap();
    let peer = ca.issue(Role::Client, "c", &[]).unwrap();
    handshake(peer.rustls_client().unwrap(), node.rustls_server().unwrap()).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let args = TlsArgs { tls_dir: Some(dir.clone()), ..TlsArgs::default() };
    assert!(args.load().unwrap().is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// etcd loads its trusted CA file after it says it is ready, while `kvfleet up` issues the next
/// certificate into the same directory (rewriting `ca.pem`): a reader meanwhile must see the
/// whole file, never an empty or partial one (an empty CA pool refused every client).
#[test]
fn a_reader_never_sees_a_half_written_ca_file() {
    let dir = tempdir("atomic");
    let ca = ClusterCa::generate("test").unwrap();
    ca.save(&dir).unwrap();
    let path = dir.join(CA_CERT_FILE);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (stop, path, want) = (stop.clone(), path.clone(), ca.cert_pem().to_string());
        std::thread::spawn(move || {
            let (mut reads, mut bad) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                reads += 1;
                if std::fs::read_to_string(&path).unwrap_or_default() != want {
                    bad += 1;
                }
            }
            (reads, bad)
        })
    };
    for i in 0..300 {
        let files = IdentityFiles::in_dir(&dir, &format!("node-{}", i % 3));
        ca.issue(Role::Worker, "w", &[]).unwrap().save(&files).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (reads, bad) = reader.join().unwrap();
    assert!(reads > 0);
    assert_eq!(bad, 0, "{bad} of {reads} reads saw a partial ca.pem");
    // No temporary files are left behind.
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tls_flags_fail_clearly() {
    assert!(matches!(TlsArgs::default().load(), Err(PkiError::Missing)));
    let partial = TlsArgs { tls_ca: Some("ca.pem".into()), ..TlsArgs::default() };
    assert!(matches!(partial.load(), Err(PkiError::Incomplete("--tls-cert"))));
    let dir = tempdir("bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ca.pem"), "not pem").unwrap();
    std::fs::write(dir.join("node.pem"), "not pem").unwrap();
    std::fs::write(dir.join("node.key"), "not pem").unwrap();
    let err = TlsArgs { tls_dir: Some(dir.clone()), ..TlsArgs::default() }.load().unwrap_err().to_string();
    assert!(err.contains("ca.pem") && err.contains("not valid PEM"), "{err}");
    let missing = TlsArgs { tls_dir: Some(dir.join("nowhere")), ..TlsArgs::default() }.load().unwrap_err();
    assert!(missing.to_string().contains("nowhere"), "{missing}");
    assert!(TlsArgs { plaintext: true, ..TlsArgs::default() }.load().unwrap().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_round_trip_to_arguments() {
    let files = IdentityFiles::in_dir(Path::new("/pki"), "worker-3");
    let args = TlsArgs::files(&files).to_args();
    assert_eq!(args, ["--tls-ca", "/pki/ca.pem", "--tls-cert", "/pki/worker-3.pem", "--tls-key", "/pki/worker-3.key"]);
    assert_eq!(TlsArgs { plaintext: true, ..TlsArgs::default() }.to_args(), ["--plaintext"]);
}
