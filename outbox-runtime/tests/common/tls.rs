//! TLS for the tests: certificates made at test time (a CA, a server
//! certificate for `localhost`, a client certificate, and an unrelated CA),
//! and a TLS-terminating proxy that puts a real TLS endpoint in front of a
//! plain-text server (the test broker cannot serve TLS itself).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use openssl::x509::{X509, X509NameBuilder};
use outbox_runtime::settings::KafkaSettings;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A certificate and its private key (PEM).
pub struct Pair {
    pub cert: X509,
    pub key: PKey<Private>,
}

impl Pair {
    pub fn cert_pem(&self) -> Vec<u8> {
        self.cert.to_pem().expect("certificate PEM")
    }
    pub fn key_pem(&self) -> Vec<u8> {
        self.key.private_key_to_pem_pkcs8().expect("key PEM")
    }
}

/// Certificates in a directory of their own (removed on drop): `ca.pem`
/// (the CA), `server.pem`/`server.key` (signed by it, for `localhost`
/// only), `client.pem`/`client.key` (signed by it, for `client_cn`),
/// `other-ca.pem` (a CA that signed nothing here).
pub struct Pki {
    pub dir: PathBuf,
    pub ca: Pair,
    pub server: Pair,
    pub client: Pair,
}

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).expect("P-256");
    PKey::from_ec_key(EcKey::generate(&group).expect("EC key")).expect("key")
}

fn certificate(
    cn: &str,
    key: &PKey<Private>,
    issuer: Option<&Pair>,
    ca: bool,
    dns: &[&str],
) -> X509 {
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_nid(Nid::COMMONNAME, cn).unwrap();
    let name = name.build();
    let mut b = X509::builder().unwrap();
    b.set_version(2).unwrap();
    let mut serial = BigNum::new().unwrap();
    serial.rand(64, MsbOption::MAYBE_ZERO, false).unwrap();
    b.set_serial_number(&serial.to_asn1_integer().unwrap())
        .unwrap();
    b.set_subject_name(&name).unwrap();
    b.set_issuer_name(issuer.map_or(&name, |i| i.cert.subject_name()))
        .unwrap();
    b.set_pubkey(key).unwrap();
    b.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::days_from_now(2).unwrap())
        .unwrap();
    if ca {
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
        b.append_extension(
            KeyUsage::new()
                .critical()
                .key_cert_sign()
                .crl_sign()
                .build()
                .unwrap(),
        )
        .unwrap();
    } else {
        b.append_extension(BasicConstraints::new().build().unwrap())
            .unwrap();
        b.append_extension(
            KeyUsage::new()
                .critical()
                .digital_signature()
                .key_agreement()
                .build()
                .unwrap(),
        )
        .unwrap();
        b.append_extension(
            ExtendedKeyUsage::new()
                .server_auth()
                .client_auth()
                .build()
                .unwrap(),
        )
        .unwrap();
        if !dns.is_empty() {
            let mut san = SubjectAlternativeName::new();
            for d in dns {
                san.dns(d);
            }
            let san = san.build(&b.x509v3_context(issuer.map(|i| &*i.cert), None));
            b.append_extension(san.unwrap()).unwrap();
        }
    }
    let signer = issuer.map_or(key, |i| &i.key);
    b.sign(signer, MessageDigest::sha256()).unwrap();
    b.build()
}

impl Pki {
    /// Makes the certificates; the client certificate names `client_cn`
    /// (a PostgreSQL user for certificate authentication).
    pub fn generate(client_cn: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("outbox-pki-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("pki directory");
        let ca_key = key();
        let ca = Pair {
            cert: certificate("outbox test CA", &ca_key, None, true, &[]),
            key: ca_key,
        };
        let server_key = key();
        let server = Pair {
            cert: certificate("localhost", &server_key, Some(&ca), false, &["localhost"]),
            key: server_key,
        };
        let client_key = key();
        let client = Pair {
            cert: certificate(client_cn, &client_key, Some(&ca), false, &[]),
            key: client_key,
        };
        let other_key = key();
        let other = certificate("another CA", &other_key, None, true, &[]);
        let write = |name: &str, data: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, data).expect("write pem");
            set_mode(&path, 0o600);
        };
        write("ca.pem", &ca.cert_pem());
        write("server.pem", &server.cert_pem());
        write("server.key", &server.key_pem());
        write("client.pem", &client.cert_pem());
        write("client.key", &client.key_pem());
        write("other-ca.pem", &other.to_pem().unwrap());
        Self {
            dir,
            ca,
            server,
            client,
        }
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The server's identity for a TLS acceptor.
    pub fn server_identity(&self) -> native_tls::Identity {
        native_tls::Identity::from_pkcs8(&self.server.cert_pem(), &self.server.key_pem())
            .expect("server identity")
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A TLS endpoint in front of a plain-text server: accepts TLS with the
/// server certificate, forwards the decrypted bytes to `upstream`.
pub struct TlsProxy {
    pub port: u16,
    handshakes: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

impl TlsProxy {
    /// Serves on `listener` (bound by the caller before it starts the
    /// upstream: a port only picked, not held, may be taken meanwhile).
    pub fn start(
        listener: TcpListener,
        upstream: SocketAddr,
        identity: native_tls::Identity,
    ) -> Self {
        let port = listener.local_addr().expect("proxy address").port();
        let acceptor = tokio_native_tls::TlsAcceptor::from(
            native_tls::TlsAcceptor::new(identity).expect("TLS acceptor"),
        );
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = handshakes.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, counted) = (acceptor.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(inbound).await else {
                        return;
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut outbound).await;
                    }
                });
            }
        });
        Self {
            port,
            handshakes,
            accept,
        }
    }

    /// TLS handshakes completed so far.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A private broker reachable only through a TLS endpoint for `localhost`.
pub struct TlsBroker {
    pub pki: Pki,
    pub proxy: TlsProxy,
    _broker: super::PrivateBroker,
}

impl TlsBroker {
    pub async fn start() -> Self {
        let pki = Pki::generate("client");
        // The proxy's port is held from the start: the broker advertises it.
        let (listener, tls_port) = super::held_port().await;
        let broker_port = super::free_port();
        let broker = super::PrivateBroker::start_advertising(
            broker_port,
            &format!("tcp://localhost:{tls_port}"),
        );
        let proxy = TlsProxy::start(
            listener,
            ([127, 0, 0, 1], broker_port).into(),
            pki.server_identity(),
        );
        Self {
            pki,
            proxy,
            _broker: broker,
        }
    }

    /// Client settings: TLS, the CA file `ca` of the PKI, `host` as the
    /// bootstrap host.
    pub fn settings(&self, host: &str, ca: &str) -> KafkaSettings {
        let mut s = KafkaSettings::default();
        s.set("bootstrap.servers", format!("{host}:{}", self.proxy.port));
        s.set("security.protocol", "SSL");
        s.set("ssl.ca.location", self.pki.path(ca));
        // `localhost` may also resolve to ::1, where nothing listens.
        s.set("broker.address.family", "v4");
        s
    }

    pub fn verified(&self) -> KafkaSettings {
        self.settings("localhost", "ca.pem")
    }
}
