//! A SASL endpoint for the tests: it speaks the Kafka protocol's SASL
//! exchange (`SaslHandshake` and `SaslAuthenticate`, KIP-43 and KIP-152)
//! with PLAIN and SCRAM-SHA-256/512 (RFC 5802, RFC 7677) against one user
//! and password, then passes the connection through to a plain-text broker
//! — over TLS when given a server identity. The test broker (tansu 0.6)
//! cannot authenticate clients itself: it offers no PLAIN mechanism, and its
//! in-memory storage keeps no SCRAM credentials.
//!
//! Requests before the login (`ApiVersions`) go to the broker; anything
//! else before a successful login closes the connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use openssl::hash::{MessageDigest, hash};
use openssl::pkey::PKey;
use openssl::sign::Signer;
use outbox_runtime::settings::KafkaSettings;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const API_VERSIONS: i16 = 18;
const SASL_HANDSHAKE: i16 = 17;
const SASL_AUTHENTICATE: i16 = 36;
/// SASL_AUTHENTICATION_FAILED.
const AUTH_FAILED: i16 = 58;
/// UNSUPPORTED_SASL_MECHANISM.
const UNSUPPORTED_MECHANISM: i16 = 33;
const MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];
const ITERATIONS: u32 = 4096;

/// The proxy: accepted logins and refused ones are counted.
pub struct SaslProxy {
    pub port: u16,
    logins: Arc<AtomicUsize>,
    refusals: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

impl SaslProxy {
    /// Serves on `listener`, bound by the caller before it starts the
    /// upstream (a port only picked, not held, may be taken meanwhile).
    pub async fn start(
        listener: TcpListener,
        upstream: SocketAddr,
        tls: Option<native_tls::Identity>,
        user: &str,
        password: &str,
    ) -> Self {
        let port = listener.local_addr().expect("proxy address").port();
        let acceptor = tls.map(|identity| {
            tokio_native_tls::TlsAcceptor::from(
                native_tls::TlsAcceptor::new(identity).expect("TLS acceptor"),
            )
        });
        let (logins, refusals): (Arc<AtomicUsize>, Arc<AtomicUsize>) = Default::default();
        let counters = (Arc::clone(&logins), Arc::clone(&refusals));
        let account = Arc::new((user.to_owned(), password.to_owned()));
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, account) = (acceptor.clone(), account.clone());
                let counters = (counters.0.clone(), counters.1.clone());
                tokio::spawn(async move {
                    match acceptor {
                        Some(acceptor) => {
                            if let Ok(tls) = acceptor.accept(inbound).await {
                                serve(tls, upstream, &account, counters).await;
                            }
                        }
                        None => serve(inbound, upstream, &account, counters).await,
                    }
                });
            }
        });
        Self {
            port,
            logins,
            refusals,
            accept,
        }
    }

    /// Successful logins so far.
    pub fn logins(&self) -> usize {
        self.logins.load(Ordering::SeqCst)
    }

    /// Refused logins so far.
    pub fn refusals(&self) -> usize {
        self.refusals.load(Ordering::SeqCst)
    }
}

impl Drop for SaslProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> Option<Vec<u8>> {
    let size = s.read_i32().await.ok()?;
    let mut frame = vec![0; usize::try_from(size).ok()?];
    s.read_exact(&mut frame).await.ok()?;
    Some(frame)
}

async fn write_frame<S: AsyncWrite + Unpin>(s: &mut S, frame: &[u8]) -> Option<()> {
    s.write_i32(i32::try_from(frame.len()).ok()?).await.ok()?;
    s.write_all(frame).await.ok()?;
    s.flush().await.ok()
}

/// A request's API key, version, correlation id, and its body (after the
/// v1 header's client id).
fn parse(frame: &[u8]) -> Option<(i16, i16, i32, &[u8])> {
    let api_key = i16::from_be_bytes(frame.get(0..2)?.try_into().ok()?);
    let version = i16::from_be_bytes(frame.get(2..4)?.try_into().ok()?);
    let correlation = i32::from_be_bytes(frame.get(4..8)?.try_into().ok()?);
    let client_len = i16::from_be_bytes(frame.get(8..10)?.try_into().ok()?);
    let body_at = 10 + usize::try_from(client_len.max(0)).ok()?;
    Some((api_key, version, correlation, frame.get(body_at..)?))
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as i16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

enum Step {
    /// Waiting for the handshake's mechanism.
    Start,
    Plain,
    Scram(MessageDigest),
    /// SCRAM: the server-first message sent.
    ScramSent {
        digest: MessageDigest,
        client_first_bare: String,
        server_first: String,
        nonce: String,
        salted: Vec<u8>,
    },
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: S,
    upstream: SocketAddr,
    account: &(String, String),
    (logins, refusals): (Arc<AtomicUsize>, Arc<AtomicUsize>),
) {
    let Ok(mut broker) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut step = Step::Start;
    loop {
        let Some(frame) = read_frame(&mut client).await else {
            return;
        };
        let Some((api_key, version, correlation, body)) = parse(&frame) else {
            return;
        };
        let mut response = correlation.to_be_bytes().to_vec();
        match api_key {
            API_VERSIONS => {
                // Answered by the broker.
                if write_frame(&mut broker, &frame).await.is_none() {
                    return;
                }
                let Some(answer) = read_frame(&mut broker).await else {
                    return;
                };
                if write_frame(&mut client, &answer).await.is_none() {
                    return;
                }
                continue;
            }
            SASL_HANDSHAKE => {
                let len = i16::from_be_bytes([body[0], body[1]]) as usize;
                let mechanism = String::from_utf8_lossy(&body[2..2 + len]).into_owned();
                step = match mechanism.as_str() {
                    "PLAIN" => Step::Plain,
                    "SCRAM-SHA-256" => Step::Scram(MessageDigest::sha256()),
                    "SCRAM-SHA-512" => Step::Scram(MessageDigest::sha512()),
                    _ => Step::Start,
                };
                let code = if matches!(step, Step::Start) {
                    UNSUPPORTED_MECHANISM
                } else {
                    0
                };
                response.extend_from_slice(&code.to_be_bytes());
                response.extend_from_slice(&(MECHANISMS.len() as i32).to_be_bytes());
                for m in MECHANISMS {
                    string(&mut response, m);
                }
            }
            SASL_AUTHENTICATE => {
                let len = i32::from_be_bytes(body[0..4].try_into().unwrap()) as usize;
                let auth = &body[4..4 + len];
                let (outcome, reply) = authenticate(&mut step, auth, account);
                match outcome {
                    Outcome::Continue => {}
                    Outcome::Done => {
                        logins.fetch_add(1, Ordering::SeqCst);
                    }
                    Outcome::Refused => {
                        refusals.fetch_add(1, Ordering::SeqCst);
                    }
                }
                let refused = matches!(outcome, Outcome::Refused);
                response.extend_from_slice(&(if refused { AUTH_FAILED } else { 0 }).to_be_bytes());
                if refused {
                    string(&mut response, "invalid credentials");
                } else {
                    response.extend_from_slice(&(-1_i16).to_be_bytes());
                }
                response.extend_from_slice(&(reply.len() as i32).to_be_bytes());
                response.extend_from_slice(&reply);
                if version >= 1 {
                    response.extend_from_slice(&0_i64.to_be_bytes());
                }
                if write_frame(&mut client, &response).await.is_none() || refused {
                    return;
                }
                if matches!(outcome, Outcome::Done) {
                    // Logged in: the rest goes to the broker as it is.
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut broker).await;
                    return;
                }
                continue;
            }
            // Anything else before a login.
            _ => return,
        }
        if write_frame(&mut client, &response).await.is_none() {
            return;
        }
    }
}

enum Outcome {
    Continue,
    Done,
    Refused,
}

fn authenticate(
    step: &mut Step,
    auth: &[u8],
    (user, password): &(String, String),
) -> (Outcome, Vec<u8>) {
    match std::mem::replace(step, Step::Start) {
        Step::Plain => {
            // authzid NUL authcid NUL passwd
            let parts: Vec<&[u8]> = auth.split(|b| *b == 0).collect();
            let ok =
                parts.len() == 3 && parts[1] == user.as_bytes() && parts[2] == password.as_bytes();
            (
                if ok { Outcome::Done } else { Outcome::Refused },
                Vec::new(),
            )
        }
        Step::Scram(digest) => {
            // n,,n=user,r=cnonce
            let text = String::from_utf8_lossy(auth).into_owned();
            let Some(bare) = text.strip_prefix("n,,") else {
                return (Outcome::Refused, Vec::new());
            };
            let attr = |name: &str| {
                bare.split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                    .map(str::to_owned)
            };
            let (Some(name), Some(client_nonce)) = (attr("n"), attr("r")) else {
                return (Outcome::Refused, Vec::new());
            };
            if name != *user {
                return (Outcome::Refused, Vec::new());
            }
            let mut salt = [0_u8; 16];
            openssl::rand::rand_bytes(&mut salt).unwrap();
            let mut server_nonce = [0_u8; 18];
            openssl::rand::rand_bytes(&mut server_nonce).unwrap();
            let nonce = format!(
                "{client_nonce}{}",
                openssl::base64::encode_block(&server_nonce)
            );
            let server_first = format!(
                "r={nonce},s={},i={ITERATIONS}",
                openssl::base64::encode_block(&salt)
            );
            let mut salted = vec![0_u8; digest.size()];
            openssl::pkcs5::pbkdf2_hmac(
                password.as_bytes(),
                &salt,
                ITERATIONS as usize,
                digest,
                &mut salted,
            )
            .unwrap();
            *step = Step::ScramSent {
                digest,
                client_first_bare: bare.to_owned(),
                server_first: server_first.clone(),
                nonce,
                salted,
            };
            (Outcome::Continue, server_first.into_bytes())
        }
        Step::ScramSent {
            digest,
            client_first_bare,
            server_first,
            nonce,
            salted,
        } => {
            // c=biws,r=nonce,p=proof
            let text = String::from_utf8_lossy(auth).into_owned();
            let Some((without_proof, proof)) = text.rsplit_once(",p=") else {
                return (Outcome::Refused, Vec::new());
            };
            if !without_proof.contains(&format!("r={nonce}")) {
                return (Outcome::Refused, Vec::new());
            }
            let Ok(proof) = openssl::base64::decode_block(proof) else {
                return (Outcome::Refused, Vec::new());
            };
            let auth_message = format!("{client_first_bare},{server_first},{without_proof}");
            let client_key = hmac(digest, &salted, b"Client Key");
            let stored_key = hash(digest, &client_key).unwrap().to_vec();
            let signature = hmac(digest, &stored_key, auth_message.as_bytes());
            let recovered: Vec<u8> = proof.iter().zip(&signature).map(|(a, b)| a ^ b).collect();
            if proof.len() != signature.len()
                || hash(digest, &recovered).unwrap().to_vec() != stored_key
            {
                return (Outcome::Refused, Vec::new());
            }
            let server_key = hmac(digest, &salted, b"Server Key");
            let server_signature = hmac(digest, &server_key, auth_message.as_bytes());
            let reply = format!("v={}", openssl::base64::encode_block(&server_signature));
            (Outcome::Done, reply.into_bytes())
        }
        Step::Start => (Outcome::Refused, Vec::new()),
    }
}

fn hmac(digest: MessageDigest, key: &[u8], data: &[u8]) -> Vec<u8> {
    let key = PKey::hmac(key).unwrap();
    let mut signer = Signer::new(digest, &key).unwrap();
    signer.update(data).unwrap();
    signer.sign_to_vec().unwrap()
}

/// A private broker reachable only through a SASL endpoint over TLS for
/// `localhost`, with one user.
pub struct SaslBroker {
    pub pki: super::tls::Pki,
    pub proxy: SaslProxy,
    _broker: super::PrivateBroker,
}

impl SaslBroker {
    /// The user `outbox-relay` with the password `s3cret-pw`.
    pub async fn start() -> Self {
        let pki = super::tls::Pki::generate("client");
        // The proxy's port is held from the start: the broker advertises it.
        let (listener, sasl_port) = super::held_port().await;
        let broker_port = super::free_port();
        let broker = super::PrivateBroker::start_advertising(
            broker_port,
            &format!("tcp://localhost:{sasl_port}"),
        );
        let proxy = SaslProxy::start(
            listener,
            ([127, 0, 0, 1], broker_port).into(),
            Some(pki.server_identity()),
            "outbox-relay",
            "s3cret-pw",
        )
        .await;
        Self {
            pki,
            proxy,
            _broker: broker,
        }
    }

    /// Client settings: SASL over TLS with `mechanism` and `password`.
    pub fn settings(&self, mechanism: &str, password: &str) -> KafkaSettings {
        let mut s = KafkaSettings::default();
        s.set(
            "bootstrap.servers",
            format!("localhost:{}", self.proxy.port),
        );
        s.set("security.protocol", "SASL_SSL");
        s.set("ssl.ca.location", self.pki.path("ca.pem"));
        s.set("broker.address.family", "v4");
        s.set("sasl.mechanism", mechanism);
        s.set("sasl.username", "outbox-relay");
        s.set("sasl.password", password);
        s
    }
}
