//! `kvfleet certs`: the cluster PKI for operators who start processes by hand (several hosts,
//! docker-compose). `init` makes a cluster CA; `issue` signs one process's certificate. Every
//! process then runs with `--tls-dir DIR` (`ca.pem`, `node.pem`, `node.key`). Any other CA works
//! too: the files are plain PEM, and every certificate must carry the SAN `kvfleet.cluster`.

use crate::{say, InputError};
use clap::{Args, Subcommand};
use kvfleet_pki::{ClusterCa, IdentityFiles, Role};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum CertsCommand {
    /// Create a cluster CA: `DIR/ca.pem` and `DIR/ca.key` (keep the key off the cluster's hosts).
    Init(InitArgs),
    /// Issue a certificate for one process, signed by the CA in `--ca-dir`, into `--out`
    /// (`ca.pem`, `node.pem`, `node.key`: what `--tls-dir` expects).
    Issue(IssueArgs),
}

#[derive(Args)]
pub struct InitArgs {
    /// Where to write the CA.
    #[arg(long, default_value = "pki")]
    dir: PathBuf,
    /// A name for the cluster (in the CA's subject).
    #[arg(long, default_value = "kvfleet")]
    cluster: String,
}

#[derive(Args)]
pub struct IssueArgs {
    /// The CA directory (`ca.pem`, `ca.key`).
    #[arg(long, default_value = "pki")]
    ca_dir: PathBuf,
    /// The process's role: `coordinator`, `worker`, `client` (submit, read) or `operator`
    /// (status, drain, shut down). Servers check it per RPC; the KV port takes workers only.
    /// `service`: a certificate with no kvfleet role, for etcd (`--cert-file`); name the hosts
    /// clients reach it at with `--host`.
    #[arg(long, value_parser = ["coordinator", "worker", "client", "operator", "service"])]
    role: String,
    /// The process's name (in the certificate subject), e.g. `worker-3`.
    #[arg(long)]
    name: String,
    /// Host names or IP addresses the process is reached at (repeatable; informational: peers
    /// verify cluster membership, not host names).
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// Output directory for `ca.pem`, `node.pem`, `node.key`.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(cmd: CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Init(a) => {
            if a.dir.join(kvfleet_pki::CA_KEY_FILE).exists() {
                return Err(
                    InputError(format!("{} already holds a CA key; not overwriting it", a.dir.display())).into()
                );
            }
            ClusterCa::generate(&a.cluster)?.save(&a.dir)?;
            say!("cluster CA written to {} (ca.pem, ca.key)", a.dir.display());
        }
        CertsCommand::Issue(a) => {
            let ca = ClusterCa::load(&a.ca_dir).map_err(|e| InputError(format!("--ca-dir: {e}")))?;
            let files = IdentityFiles::in_dir(&a.out, "node");
            if a.role == "service" {
                ca.issue_service(&a.name, &a.hosts)?.save(&files)?;
                let d = a.out.display();
                say!(
                    "service certificate for {} written to {d} (etcd: --cert-file {d}/node.pem --key-file \
                     {d}/node.key --trusted-ca-file {d}/ca.pem --client-cert-auth)",
                    a.name
                );
                return Ok(());
            }
            let role = Role::parse(&a.role).expect("clap checked the role");
            ca.issue(role, &a.name, &a.hosts)?.save(&files)?;
            say!(
                "{} certificate for {} written to {} (use --tls-dir {})",
                a.role,
                a.name,
                a.out.display(),
                a.out.display()
            );
        }
    }
    Ok(())
}
