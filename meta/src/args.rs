//! The etcd connection flags every kvfleet process takes (`--etcd`, credentials, TLS), defined
//! once so coordinators and workers agree.

use crate::{EtcdOptions, EtcdTls};
use std::path::PathBuf;

/// Flatten into a binary's clap arguments with `#[command(flatten)]`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// etcd user name (with --etcd-password).
    #[arg(long, env = "KVFLEET_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(long, env = "KVFLEET_ETCD_PASSWORD")]
    pub etcd_password: Option<String>,
    /// CA certificate (PEM) that signed etcd's server certificate: enables TLS to etcd.
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with etcd (with --etcd-key).
    #[arg(long)]
    pub etcd_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS with etcd.
    #[arg(long)]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    /// The connection options these flags describe.
    pub fn options(&self) -> EtcdOptions {
        let tls = (self.etcd_ca.is_some() || self.etcd_cert.is_some()).then(|| EtcdTls {
            ca_cert_pem: self.etcd_ca.clone(),
            client_cert_pem: self.etcd_cert.clone(),
            client_key_pem: self.etcd_key.clone(),
            domain_name: None,
        });
        EtcdOptions {
            username: self.etcd_user.clone(),
            password: self.etcd_password.clone(),
            tls,
            ..EtcdOptions::default()
        }
    }
}
