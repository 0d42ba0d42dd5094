//! What every request passes: a POST from another site is refused before
//! any handler runs, every response forbids framing, and the client's
//! address for the audit trail is the peer's unless the peer is a trusted
//! proxy.
//!
//! Another site: a browser says where a request comes from in
//! `Sec-Fetch-Site` (every current browser sends it); only `same-origin`
//! (and `none`, a request the user made directly) may POST — another port
//! of the same host or a sibling subdomain is `same-site` and refused.
//! Without that header, an `Origin` header must name the host the request
//! was sent to; without either (not a browser, or a very old one) the
//! request goes on, and the session's form token
//! ([`crate::auth`]) is what lets a write through.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::Response;

use crate::error::ConsoleError;
use crate::{ConsoleConfig, Shared};

/// Most `X-Forwarded-For` hops looked at (from the right).
const MAX_HOPS: usize = 32;

/// Why a request that changes something is refused as coming from another
/// site, if it is. `host`: the host the request was sent to (`Host`, or
/// the URI's authority over HTTP/2).
pub fn cross_site(method: &Method, headers: &HeaderMap, host: Option<&str>) -> Option<String> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.to_str() {
            Ok("same-origin" | "none") => None,
            Ok(other) => Some(format!(
                "a form of another site cannot write here (Sec-Fetch-Site: {})",
                other.chars().take(40).collect::<String>()
            )),
            Err(_) => Some("an unreadable Sec-Fetch-Site header".into()),
        };
    }
    let origin = headers.get(header::ORIGIN)?;
    let same = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .zip(host)
        .is_some_and(|((_, authority), host)| authority.eq_ignore_ascii_case(host));
    if same {
        None
    } else {
        Some(format!(
            "a form of another origin cannot write here (Origin: {})",
            origin
                .to_str()
                .unwrap_or("unreadable")
                .chars()
                .take(80)
                .collect::<String>()
        ))
    }
}

/// The middleware: the cross-site check, then the frame headers on every
/// response.
pub async fn protect(State(console): State<Shared>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    let mut response = match cross_site(request.method(), request.headers(), host) {
        Some(why) => {
            tracing::warn!(path = %request.uri().path(), %why, "console request refused");
            ConsoleError::Refused(why).render(&console)
        }
        None => next.run(request).await,
    };
    let headers = response.headers_mut();
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("frame-ancestors 'none'"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// The client's address for the audit trail: the peer's; when the peer is
/// a trusted proxy, the last address of `X-Forwarded-For` that is not one
/// (each proxy appends the address it got the request from, so addresses
/// left of the first untrusted one are the client's say). `None` when the
/// server gives no peer address (a router served without connect info).
pub fn client_address(
    config: &ConsoleConfig,
    peer: Option<ConnectInfo<SocketAddr>>,
    headers: &HeaderMap,
) -> Option<String> {
    let peer = peer?.0.ip().to_canonical();
    let trusted = |ip: &IpAddr| config.trusted_proxies.contains(ip);
    if !trusted(&peer) {
        return Some(peer.to_string());
    }
    let hops: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    let mut client = peer;
    for hop in hops.iter().rev().take(MAX_HOPS) {
        match hop.parse::<IpAddr>() {
            Ok(ip) => {
                client = ip.to_canonical();
                if !trusted(&client) {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    Some(client.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cross(method: &Method, h: &HeaderMap) -> Option<String> {
        cross_site(method, h, h.get("host").and_then(|v| v.to_str().ok()))
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    k.parse::<header::HeaderName>().unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn only_same_origin_posts_pass() {
        let post = Method::POST;
        for ok in [
            vec![],
            vec![("sec-fetch-site", "same-origin")],
            vec![("sec-fetch-site", "none")],
            vec![("origin", "http://console:8080"), ("host", "console:8080")],
            vec![
                ("origin", "https://Console.example"),
                ("host", "console.example"),
            ],
            // The browser's word wins over a proxy's Host.
            vec![
                ("sec-fetch-site", "same-origin"),
                ("origin", "https://console.example"),
                ("host", "10.0.0.5:8080"),
            ],
        ] {
            assert_eq!(cross(&post, &headers(&ok)), None, "{ok:?}");
        }
        for refused in [
            vec![("sec-fetch-site", "cross-site")],
            vec![("sec-fetch-site", "same-site")],
            vec![
                ("sec-fetch-site", "same-site"),
                ("origin", "http://console:8080"),
                ("host", "console:8080"),
            ],
            vec![("origin", "http://console:9090"), ("host", "console:8080")],
            vec![("origin", "http://evil.example"), ("host", "console:8080")],
            vec![("origin", "null"), ("host", "console:8080")],
            vec![("origin", "http://console:8080")],
        ] {
            assert!(cross(&post, &headers(&refused)).is_some(), "{refused:?}");
        }
        assert_eq!(
            cross(&Method::GET, &headers(&[("sec-fetch-site", "cross-site")])),
            None,
            "reading is not refused"
        );
    }

    #[test]
    fn forwarded_addresses_count_from_trusted_proxies_only() {
        let proxy: IpAddr = "10.0.0.2".parse().unwrap();
        let config = ConsoleConfig::new().trusted_proxies([proxy]);
        let peer = |ip: &str| Some(ConnectInfo(SocketAddr::new(ip.parse().unwrap(), 4000)));
        let xff = headers(&[("x-forwarded-for", "198.51.100.7, 203.0.113.9")]);
        assert_eq!(
            client_address(&config, peer("192.0.2.1"), &xff).as_deref(),
            Some("192.0.2.1"),
            "an untrusted peer's header is ignored"
        );
        assert_eq!(
            client_address(&config, peer("10.0.0.2"), &xff).as_deref(),
            Some("203.0.113.9"),
            "the address the trusted proxy saw, not what the client claims"
        );
        let chain = headers(&[("x-forwarded-for", "203.0.113.9, 10.0.0.2")]);
        assert_eq!(
            client_address(&config, peer("10.0.0.2"), &chain).as_deref(),
            Some("203.0.113.9"),
            "trusted hops are skipped"
        );
        assert_eq!(
            client_address(&config, peer("10.0.0.2"), &HeaderMap::new()).as_deref(),
            Some("10.0.0.2")
        );
        assert_eq!(
            client_address(
                &config,
                peer("10.0.0.2"),
                &headers(&[("x-forwarded-for", "junk")])
            )
            .as_deref(),
            Some("10.0.0.2")
        );
        assert_eq!(
            client_address(&config, peer("::ffff:10.0.0.2"), &xff).as_deref(),
            Some("203.0.113.9"),
            "an IPv4 peer on an IPv6 socket"
        );
        assert_eq!(client_address(&config, None, &xff), None);
    }
}
