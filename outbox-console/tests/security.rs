//! The console against a hostile neighbour, over HTTP on a real database:
//! posts from another site refused (another port, a sibling subdomain, a
//! foreign origin), every write and the logout refused without the
//! session's form token (the confirmation cannot be skipped by a forged
//! post), no page framed, the `Secure` cookie option, sessions capped at
//! check time, and the audit's client address believed from trusted
//! proxies only.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use outbox_console::{ConsoleConfig, router};
use serde_json::json;
use sqlx::PgPool;

fn writable(pool: &PgPool) -> axum::Router {
    router(
        pool.clone(),
        ConsoleConfig::new().write_token(TOKEN).unwrap(),
    )
}

fn peer(addr: &str) -> Option<SocketAddr> {
    Some(addr.parse().unwrap())
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn posts_from_another_site_are_refused(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let ids = id.to_string();
    let app = writable(&pool);
    let (cookie, token) = session(&app, "ann").await;
    let write = [
        ("action", "requeue"),
        ("id", ids.as_str()),
        ("confirm", "yes"),
        ("reason", "forged"),
        ("csrf", token.as_str()),
    ];
    // Even with the cookie and the right token (a page of the same site
    // that read it could send both), another site's form is refused.
    for headers in [
        vec![("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "same-site")],
        vec![
            ("origin", "http://console.example:9999"),
            ("host", "console.example:8080"),
        ],
        vec![
            ("origin", "http://evil.example"),
            ("host", "console.example:8080"),
        ],
        vec![("origin", "null"), ("host", "console.example:8080")],
    ] {
        let answer = post_with(
            &app,
            "/parked/action",
            &write,
            Some(&cookie),
            &headers,
            None,
        )
        .await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN, "{headers:?}");
        assert!(answer.body.contains("another"), "{}", answer.body);
        // A login from another site is refused too: no cookie set.
        let login = post_with(
            &app,
            "/login",
            &[("operator", "eve"), ("token", TOKEN)],
            None,
            &headers,
            None,
        )
        .await;
        assert_eq!(login.status, StatusCode::FORBIDDEN, "{headers:?}");
        assert!(login.cookie.is_none());
    }
    assert!(still_parked(&pool, id).await);
    assert_eq!(audit_count(&pool).await, 0);
    // The same origin, as a browser says it, passes.
    let answer = post_with(
        &app,
        "/parked/action",
        &write,
        Some(&cookie),
        &[
            ("sec-fetch-site", "same-origin"),
            ("origin", "http://console.example:8080"),
            ("host", "console.example:8080"),
        ],
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert!(answer.body.contains("Requeued 1 of 1"), "{}", answer.body);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writes_need_the_sessions_form_token(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let dl = dead_letter(&pool, "billing", 1, b"{}", json!({}), "boom").await;
    let (ids, dl_id) = (id.to_string(), dl.to_string());
    let app = writable(&pool);
    let (cookie, token) = session(&app, "ann").await;
    // Another session of the same console has another token.
    let (_, other_token) = session(&app, "bob").await;
    assert_ne!(token, other_token);
    assert_eq!(token.len(), 64, "{token}");
    for bad in [None, Some(""), Some("00"), Some(other_token.as_str())] {
        let mut form = vec![
            ("action", "requeue"),
            ("id", ids.as_str()),
            ("confirm", "yes"),
            ("reason", "forged"),
        ];
        if let Some(t) = bad {
            form.push(("csrf", t));
        }
        // The one-post write (confirmation skipped) and the first step.
        for form in [form.clone(), form[..2].to_vec()] {
            let answer = post(&app, "/parked/action", &form, Some(&cookie)).await;
            assert_eq!(answer.status, StatusCode::FORBIDDEN, "{form:?}");
            assert!(answer.body.contains("token"), "{}", answer.body);
            assert!(!answer.body.contains("name=\"reason\""), "no confirmation");
        }
        let answer = post(
            &app,
            "/dead-letters/action",
            &[
                ("action", "drop"),
                ("id", &dl_id),
                ("confirm", "yes"),
                ("reason", "x"),
            ]
            .into_iter()
            .chain(bad.map(|t| ("csrf", t)))
            .collect::<Vec<_>>(),
            Some(&cookie),
        )
        .await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN);
        // The logout too: the cookie stays.
        let out = post(
            &app,
            "/logout",
            &bad.map(|t| vec![("csrf", t)]).unwrap_or_default(),
            Some(&cookie),
        )
        .await;
        assert_eq!(out.status, StatusCode::FORBIDDEN);
        assert!(out.cookie.is_none());
    }
    assert!(still_parked(&pool, id).await);
    assert_eq!(audit_count(&pool).await, 0);
    // With the token: the confirmation carries it, and the write is done.
    let confirm = post(
        &app,
        "/parked/action",
        &[("action", "requeue"), ("id", &ids), ("csrf", &token)],
        Some(&cookie),
    )
    .await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert_eq!(
        form_tokens(&confirm.body),
        vec![token.clone(); 2],
        "the form and the logout"
    );
    let done = post(
        &app,
        "/parked/action",
        &[
            ("action", "requeue"),
            ("id", &ids),
            ("confirm", "yes"),
            ("reason", "topic created"),
            ("csrf", &token),
        ],
        Some(&cookie),
    )
    .await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    assert!(!still_parked(&pool, id).await);
    let out = post(&app, "/logout", &[("csrf", &token)], Some(&cookie)).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(out.cookie.unwrap().contains("outbox_console=;"));
}

/// Every form that posts carries the token; pages for someone not logged
/// in carry none.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn every_posting_form_carries_the_token(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let dl = dead_letter(&pool, "billing", 1, b"{}", json!({}), "boom").await;
    let app = writable(&pool);
    let (cookie, token) = session(&app, "ann").await;
    for path in [
        "/".to_owned(),
        "/parked".to_owned(),
        format!("/parked/{id}"),
        "/dead-letters".to_owned(),
        format!("/dead-letters/{dl}"),
        "/consumers".to_owned(),
        "/relays".to_owned(),
        "/audit".to_owned(),
    ] {
        let page = get(&app, &path, Some(&cookie)).await.body;
        let forms = page.matches("method=\"post\"").count();
        assert!(forms >= 1, "{path}: the logout form at least");
        assert_eq!(form_tokens(&page), vec![token.clone(); forms], "{path}");
        let anonymous = get(&app, &path, None).await.body;
        assert!(form_tokens(&anonymous).is_empty(), "{path}");
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn no_page_can_be_framed(pool: PgPool) {
    let app = writable(&pool);
    let answers = [
        get(&app, "/", None).await,
        get(&app, "/login", None).await,
        get(&app, "/no-such-page", None).await,
        get(&app, "/console.css", None).await,
        post(&app, "/parked/action", &[("action", "requeue")], None).await,
        post_with(
            &app,
            "/logout",
            &[],
            None,
            &[("sec-fetch-site", "cross-site")],
            None,
        )
        .await,
    ];
    for answer in answers {
        let h = &answer.headers;
        assert_eq!(h["x-frame-options"], "DENY", "{}", answer.status);
        assert_eq!(h["content-security-policy"], "frame-ancestors 'none'");
        assert_eq!(h["x-content-type-options"], "nosniff");
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_cookie_is_secure_when_asked(pool: PgPool) {
    let plain = writable(&pool);
    let answer = post(
        &plain,
        "/login",
        &[("operator", "ann"), ("token", TOKEN)],
        None,
    )
    .await;
    assert!(!answer.cookie.unwrap().contains("Secure"));
    let secure = router(
        pool.clone(),
        ConsoleConfig::new()
            .write_token(TOKEN)
            .unwrap()
            .secure_cookie(true),
    );
    let answer = post(
        &secure,
        "/login",
        &[("operator", "ann"), ("token", TOKEN)],
        None,
    )
    .await;
    let set = answer.cookie.unwrap();
    assert!(
        set.contains("Secure") && set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let cookie = set.split(';').next().unwrap().to_owned();
    let token = csrf(&secure, &cookie).await;
    let out = post(&secure, "/logout", &[("csrf", &token)], Some(&cookie)).await;
    assert!(out.cookie.unwrap().contains("Secure"), "the removal too");
}

/// A session ends at its lifetime counted from the login, checked on every
/// request: a cookie kept longer is refused though its signature is good.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn sessions_past_their_lifetime_are_refused(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let ids = id.to_string();
    let long = writable(&pool);
    let (cookie, token) = session(&long, "ann").await;
    // The same token (the same key): a console whose sessions last 1 s.
    let short = router(
        pool.clone(),
        ConsoleConfig::new()
            .write_token(TOKEN)
            .unwrap()
            .session_lifetime(Duration::from_secs(1))
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let form = [
        ("action", "requeue"),
        ("id", ids.as_str()),
        ("csrf", token.as_str()),
    ];
    let answer = post(&short, "/parked/action", &form, Some(&cookie)).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.body.contains("log in first"), "{}", answer.body);
    assert!(
        get(&short, "/", Some(&cookie))
            .await
            .body
            .contains("not logged in")
    );
    // Still valid where sessions last longer.
    let answer = post(&long, "/parked/action", &form, Some(&cookie)).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert!(
        ConsoleConfig::new()
            .session_lifetime(Duration::from_millis(10))
            .is_err()
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_audit_believes_forwarded_addresses_from_trusted_proxies_only(pool: PgPool) {
    let mut rows = Vec::new();
    for i in 0..3 {
        rows.push(
            parked_row(
                &pool,
                "orders",
                &format!("k{i}"),
                json!({}),
                json!({}),
                "boom",
            )
            .await,
        );
    }
    let untrusted = writable(&pool);
    let trusted = router(
        pool.clone(),
        ConsoleConfig::new()
            .write_token(TOKEN)
            .unwrap()
            .trusted_proxies(["127.0.0.1".parse().unwrap()]),
    );
    let forwarded = [("x-forwarded-for", "198.51.100.7, 203.0.113.9")];
    for (app, row, peer_addr, headers) in [
        (&untrusted, rows[0], peer("127.0.0.1:40000"), &forwarded[..]),
        (&trusted, rows[1], peer("127.0.0.1:40001"), &forwarded[..]),
        (&trusted, rows[2], peer("192.0.2.44:40002"), &forwarded[..]),
    ] {
        let (cookie, token) = session(app, "ann").await;
        let id = row.to_string();
        let answer = post_with(
            app,
            "/parked/action",
            &[
                ("action", "drop"),
                ("id", &id),
                ("confirm", "yes"),
                ("reason", "audit"),
                ("csrf", &token),
            ],
            Some(&cookie),
            headers,
            peer_addr,
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    }
    let log = outbox_console::audit_log(&pool, None, 10).await.unwrap();
    let clients: Vec<(Vec<i64>, Option<&str>)> = log
        .iter()
        .rev()
        .map(|r| (r.ids.clone(), r.client.as_deref()))
        .collect();
    assert_eq!(
        clients,
        vec![
            (vec![rows[0]], Some("127.0.0.1")),
            (vec![rows[1]], Some("203.0.113.9")),
            (vec![rows[2]], Some("192.0.2.44")),
        ]
    );
    let audit = get(&trusted, "/audit", None).await.body;
    assert!(audit.contains("203.0.113.9"), "{audit}");
}
