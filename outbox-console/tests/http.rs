//! The console over HTTP (the router, no browser) on a real database:
//! hostile values escaped, secrets hidden, filters and pages, writes
//! refused without the token and nothing changed, writes with it audited,
//! bad input rejected, and the plans of the list queries.

mod common;

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

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn pages_escape_hostile_values_and_hide_secrets(pool: PgPool) {
    let id = parked_row(
        &pool,
        "orders<script>alert('t')</script>",
        "key\"><img src=x onerror=alert(1)>",
        json!({ "note": "</pre><script>alert('payload')</script>" }),
        json!({ "authorization": "Bearer sekrit-bearer", "x-api-key": "sekrit-key",
                "x-note": "<b>bold</b>", "traceparent": "00-abc-01" }),
        "delivery failed: <iframe src=javascript:alert(1)> via postgres://app:sekrit-pw@db/x",
    )
    .await;
    let dl = dead_letter(
        &pool,
        "billing<svg onload=alert(1)>",
        7,
        b"{\"a\":\"<script>alert('dl')</script>\"}",
        json!({ "sasl.password": "sekrit-sasl", "event_type": "<i>x</i>" }),
        "handler: <script>alert('err')</script>",
    )
    .await;
    let app = writable(&pool);
    let pages = [
        "/".to_owned(),
        "/parked".to_owned(),
        format!("/parked/{id}"),
        "/dead-letters".to_owned(),
        format!("/dead-letters/{dl}"),
        "/consumers".to_owned(),
        "/relays".to_owned(),
        "/audit".to_owned(),
        "/login".to_owned(),
    ];
    for path in &pages {
        let page = get(&app, path, None).await;
        assert_eq!(page.status, StatusCode::OK, "{path}: {}", page.body);
        for raw in [
            "<script>alert",
            "<img src=x",
            "<iframe",
            "<svg onload",
            "<b>bold",
            "<i>x",
        ] {
            assert!(!page.body.contains(raw), "{path} shows {raw} unescaped");
        }
        assert!(!page.body.contains("sekrit"), "{path} shows a secret");
    }
    let detail = get(&app, &format!("/parked/{id}"), None).await.body;
    assert!(
        detail.contains("&lt;/pre&gt;&lt;script&gt;alert('payload')"),
        "{detail}"
    );
    assert!(detail.contains("&lt;b&gt;bold&lt;/b&gt;"));
    assert!(detail.contains("00-abc-01"), "ordinary headers are shown");
    assert!(detail.contains("postgres://app:***@db/x"));
    assert!(detail.contains(">parked<"), "the state is shown");
    let letter = get(&app, &format!("/dead-letters/{dl}"), None).await.body;
    assert!(letter.contains("&lt;script&gt;alert('dl')"), "{letter}");
    assert!(letter.contains("handler: &lt;script&gt;"));
    let groups = get(&app, "/consumers", None).await.body;
    assert!(
        groups.contains("billing&lt;svg onload=alert(1)&gt;"),
        "{groups}"
    );
    assert!(groups.contains("No broker is configured"));
}

/// A dead letter whose error quotes a hostile header of a megabyte (as
/// stored before errors were capped): its page renders in well under a
/// second (the bound only catches a quadratic blow-up), secrets scrubbed,
/// the error cut with a note.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_megabyte_hostile_error_renders_fast_and_scrubbed(pool: PgPool) {
    let unit = "password=sekrit postgres://u:sekrit@db/x PASSWORD=sekrit;";
    let hostile = unit.repeat((1 << 20) / unit.len());
    let error = format!("the `event_id` header `{hostile}` is not a UUID");
    let dl = dead_letter(&pool, "hostile", 1, b"{}", json!({}), &error).await;
    let app = writable(&pool);
    for path in [format!("/dead-letters/{dl}"), "/dead-letters".to_owned()] {
        let started = std::time::Instant::now();
        let page = get(&app, &path, None).await;
        let took = started.elapsed();
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert!(
            took < std::time::Duration::from_secs(5),
            "{path} took {took:?}"
        );
        assert!(!page.body.contains("sekrit"), "{path} shows a secret");
        assert!(page.body.contains("password=***"), "{path}");
    }
    let page = get(&app, &format!("/dead-letters/{dl}"), None).await.body;
    assert!(
        page.len() < 256 * 1024,
        "the error is cut: {} bytes",
        page.len()
    );
    assert!(
        page.contains(&format!("of {} characters", error.chars().count())),
        "the cut is said"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn parked_rows_filter_and_page_by_id(pool: PgPool) {
    let mut ids = Vec::new();
    for i in 0..7 {
        let topic = if i % 2 == 0 { "orders" } else { "payments" };
        let error = if i == 3 {
            "Broker: Unknown topic"
        } else {
            "message too large"
        };
        ids.push(parked_row(&pool, topic, &format!("k{i}"), json!({}), json!({}), error).await);
    }
    // Neither a dropped nor a published row is listed.
    let dropped = parked_row(&pool, "orders", "kd", json!({}), json!({}), "x").await;
    outbox_runtime::ops::discard_parked(&pool, Some(&[dropped]), "test")
        .await
        .unwrap();
    let app = writable(&pool);
    let listed = |body: &str| -> Vec<i64> {
        body.split("<tr data-id=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(listed(&get(&app, "/parked", None).await.body), ids);
    let orders = get(&app, "/parked?topic=orders", None).await.body;
    assert_eq!(listed(&orders), vec![ids[0], ids[2], ids[4], ids[6]]);
    assert_eq!(
        listed(&get(&app, "/parked?key=k5", None).await.body),
        vec![ids[5]]
    );
    let by_error = get(&app, "/parked?error=unknown%20TOPIC", None).await.body;
    assert_eq!(listed(&by_error), vec![ids[3]]);
    // Pages of 3: the next link carries the last id and the filters.
    let first = get(&app, "/parked?limit=3", None).await.body;
    assert_eq!(listed(&first), ids[..3]);
    let next = format!("/parked?after={}&amp;limit=3", ids[2]);
    assert!(first.contains(&next), "{first}");
    let second = get(&app, &format!("/parked?after={}&limit=3", ids[2]), None)
        .await
        .body;
    assert_eq!(listed(&second), ids[3..6]);
    let last = get(&app, &format!("/parked?after={}&limit=3", ids[5]), None)
        .await
        .body;
    assert_eq!(listed(&last), ids[6..]);
    assert!(!last.contains("id=\"next\""), "no next page after the last");
    let filtered = get(&app, "/parked?topic=orders&limit=2", None).await.body;
    assert!(
        filtered.contains("topic=orders"),
        "the next link keeps the filter"
    );
    // Bad input: a clear error, 400.
    for (path, says) in [
        ("/parked?limit=0", "invalid limit"),
        ("/parked?limit=100000", "invalid limit"),
        ("/parked?after=-4", "positive whole number"),
        ("/parked?after=abc", "positive whole number"),
        ("/parked/abc", "positive whole number"),
        ("/dead-letters?status=gone", "unknown status"),
        ("/dead-letters?reason=nope", "unknown dead-letter reason"),
    ] {
        let page = get(&app, path, None).await;
        assert_eq!(page.status, StatusCode::BAD_REQUEST, "{path}");
        assert!(page.body.contains(says), "{path}: {}", page.body);
    }
    let long = "x".repeat(300);
    let page = get(&app, &format!("/parked?topic={long}"), None).await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST);
    assert!(page.body.contains("too long"));
    assert_eq!(
        get(&app, "/parked/999999", None).await.status,
        StatusCode::NOT_FOUND
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dead_letters_filter_by_group_and_status(pool: PgPool) {
    let a = dead_letter(&pool, "billing", 1, b"{}", json!({}), "boom").await;
    let b = dead_letter(&pool, "shipping", 2, b"{}", json!({}), "boom").await;
    let c = dead_letter(&pool, "billing", 3, b"{}", json!({}), "boom").await;
    sqlx::query("UPDATE dead_letter SET status = 'resolved' WHERE id = $1")
        .bind(c)
        .execute(&pool)
        .await
        .unwrap();
    let app = writable(&pool);
    let listed = |body: &str| -> Vec<i64> {
        body.split("<tr data-id=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(
        listed(&get(&app, "/dead-letters", None).await.body),
        vec![a, b]
    );
    assert_eq!(
        listed(&get(&app, "/dead-letters?consumer=billing", None).await.body),
        vec![a]
    );
    assert_eq!(
        listed(
            &get(&app, "/dead-letters?consumer=billing&status=all", None)
                .await
                .body
        ),
        vec![a, c]
    );
    assert_eq!(
        listed(&get(&app, "/dead-letters?status=resolved", None).await.body),
        vec![c]
    );
    let page = get(&app, "/dead-letters?limit=1", None).await.body;
    assert_eq!(listed(&page), vec![a]);
    assert_eq!(
        listed(
            &get(&app, &format!("/dead-letters?after={a}&limit=1"), None)
                .await
                .body
        ),
        vec![b]
    );
    let groups = get(&app, "/consumers", None).await.body;
    assert!(
        groups.contains(">billing<") && groups.contains(">shipping<"),
        "{groups}"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writes_without_the_token_are_refused_and_change_nothing(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let dl = dead_letter(&pool, "billing", 1, b"{}", json!({}), "boom").await;
    let ids = id.to_string();
    let dl_id = dl.to_string();
    let requeue = [
        ("action", "requeue"),
        ("id", ids.as_str()),
        ("confirm", "yes"),
        ("reason", "because"),
    ];
    // A read-only console: no token at all.
    let read_only = router(pool.clone(), ConsoleConfig::new());
    let answer = post(&read_only, "/parked/action", &requeue, None).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.body.contains("read-only"), "{}", answer.body);
    let answer = post(
        &read_only,
        "/login",
        &[("operator", "eve"), ("token", TOKEN)],
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.cookie.is_none());
    // A writable console: no session, a forged one, a wrong token.
    let app = writable(&pool);
    for cookie in [
        None,
        Some("outbox_console=657665.99999999999.00ff"),
        Some("outbox_console=garbage"),
    ] {
        let answer = post(&app, "/parked/action", &requeue, cookie).await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN, "{cookie:?}");
        assert!(answer.body.contains("log in first"), "{}", answer.body);
        let answer = post(
            &app,
            "/dead-letters/action",
            &[
                ("action", "drop"),
                ("id", &dl_id),
                ("confirm", "yes"),
                ("reason", "x"),
            ],
            cookie,
        )
        .await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN);
    }
    let answer = post(
        &app,
        "/login",
        &[("operator", "eve"), ("token", "not-the-token-at-all")],
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert!(answer.cookie.is_none());
    assert!(answer.body.contains("wrong write token"));
    // A cookie signed with another token (a console restarted with a new one).
    let other = router(
        pool.clone(),
        ConsoleConfig::new()
            .write_token("another-token-0123456789")
            .unwrap(),
    );
    let answer = post(
        &other,
        "/login",
        &[("operator", "eve"), ("token", "another-token-0123456789")],
        None,
    )
    .await;
    let stale = answer.cookie.unwrap().split(';').next().unwrap().to_owned();
    assert_eq!(
        post(&app, "/parked/action", &requeue, Some(&stale))
            .await
            .status,
        StatusCode::FORBIDDEN
    );
    // No write through GET.
    let answer = get(
        &app,
        &format!("/parked/action?action=requeue&id={id}&confirm=yes&reason=x"),
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(still_parked(&pool, id).await);
    let status: String = sqlx::query_scalar("SELECT status FROM dead_letter WHERE id = $1")
        .bind(dl)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "dead");
    assert_eq!(audit_count(&pool).await, 0);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writes_with_the_token_are_confirmed_reasoned_and_audited(pool: PgPool) {
    let id = parked_row(&pool, "orders", "k", json!({}), json!({}), "boom").await;
    let other = parked_row(&pool, "orders", "k2", json!({}), json!({}), "boom").await;
    let dl = dead_letter(&pool, "billing", 1, b"{}", json!({}), "boom").await;
    let dl2 = dead_letter(&pool, "billing", 2, b"{}", json!({}), "boom").await;
    let app = writable(&pool);
    let (cookie, token) = session(&app, "ann <ops>").await;
    let csrf = ("csrf", token.as_str());
    let overview = get(&app, "/", Some(&cookie)).await.body;
    assert!(
        overview.contains("writing as ann &lt;ops&gt;"),
        "{overview}"
    );
    let ids = id.to_string();
    // Step one: the confirmation, nothing changed yet.
    let answer = post(
        &app,
        "/parked/action",
        &[("action", "requeue"), ("id", &ids), csrf],
        Some(&cookie),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.body.contains("name=\"reason\""), "{}", answer.body);
    assert!(answer.body.contains("name=\"confirm\" value=\"yes\""));
    assert!(still_parked(&pool, id).await);
    // No reason, or one too long: refused, the confirmation again.
    for reason in ["", "   ", &"r".repeat(1001)] {
        let answer = post(
            &app,
            "/parked/action",
            &[
                ("action", "requeue"),
                ("id", &ids),
                ("confirm", "yes"),
                ("reason", reason),
                csrf,
            ],
            Some(&cookie),
        )
        .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert!(answer.body.contains("id=\"problem\""), "{}", answer.body);
    }
    // Bad ids and actions.
    for form in [
        vec![
            ("action", "requeue"),
            ("confirm", "yes"),
            ("reason", "r"),
            csrf,
        ],
        vec![
            ("action", "requeue"),
            ("id", "0"),
            ("confirm", "yes"),
            ("reason", "r"),
            csrf,
        ],
        vec![
            ("action", "requeue"),
            ("id", "1;DROP TABLE x"),
            ("confirm", "yes"),
            ("reason", "r"),
            csrf,
        ],
        vec![
            ("action", "explode"),
            ("id", "1"),
            ("confirm", "yes"),
            ("reason", "r"),
            csrf,
        ],
    ] {
        let answer = post(&app, "/parked/action", &form, Some(&cookie)).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{form:?}");
    }
    assert!(still_parked(&pool, id).await);
    assert_eq!(audit_count(&pool).await, 0);
    // Step two: done and recorded.
    let answer = post(
        &app,
        "/parked/action",
        &[
            ("action", "requeue"),
            ("id", &ids),
            ("confirm", "yes"),
            ("reason", "topic created"),
            csrf,
        ],
        Some(&cookie),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert!(answer.body.contains("Requeued 1 of 1"), "{}", answer.body);
    let (parked, attempts): (bool, i32) =
        sqlx::query_as("SELECT parked_at IS NOT NULL, attempts FROM outbox_event WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((parked, attempts), (false, 0));
    assert!(still_parked(&pool, other).await, "only the named row");
    // Drop the other parked row, retry and drop dead letters.
    let other_id = other.to_string();
    let (dl_id, dl2_id) = (dl.to_string(), dl2.to_string());
    for (path, action, id) in [
        ("/parked/action", "drop", other_id.as_str()),
        ("/dead-letters/action", "retry", dl_id.as_str()),
        ("/dead-letters/action", "drop", dl2_id.as_str()),
    ] {
        let answer = post(
            &app,
            path,
            &[
                ("action", action),
                ("id", id),
                ("confirm", "yes"),
                ("reason", "cleanup"),
                csrf,
            ],
            Some(&cookie),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    }
    let discarded: Option<String> =
        sqlx::query_scalar("SELECT discard_reason FROM outbox_event WHERE id = $1")
            .bind(other)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(discarded.as_deref(), Some("cleanup"));
    let status: String = sqlx::query_scalar("SELECT status FROM dead_letter WHERE id = $1")
        .bind(dl)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "retry");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letter WHERE id = $1")
        .bind(dl2)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let log = outbox_console::audit_log(&pool, None, 10).await.unwrap();
    let seen: Vec<(&str, &str, Vec<i64>, i64, &str)> = log
        .iter()
        .map(|r| {
            (
                r.operator.as_str(),
                r.action.as_str(),
                r.ids.clone(),
                r.affected,
                r.reason.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("ann <ops>", "dead_letter_drop", vec![dl2], 1, "cleanup"),
            ("ann <ops>", "dead_letter_retry", vec![dl], 1, "cleanup"),
            ("ann <ops>", "parked_drop", vec![other], 1, "cleanup"),
            ("ann <ops>", "parked_requeue", vec![id], 1, "topic created"),
        ]
    );
    let audit = get(&app, "/audit", None).await.body;
    assert!(audit.contains("ann &lt;ops&gt;") && audit.contains("topic created"));
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_overview_reports_backlog_and_throughput(pool: PgPool) {
    let app = writable(&pool);
    let first: serde_json::Value =
        serde_json::from_str(&get(&app, "/api/overview", None).await.body).unwrap();
    assert_eq!(first["unpublished"], 0);
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, published_at)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 'rates', 'k' || g,
                CASE WHEN g <= 30 THEN now() END
         FROM generate_series(1, 40) AS g",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The next sample is at least a second after the first: wait for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let o = loop {
        let o: serde_json::Value =
            serde_json::from_str(&get(&app, "/api/overview", None).await.body).unwrap();
        if !o["points"].as_array().unwrap().is_empty() {
            break o;
        }
        assert!(std::time::Instant::now() < deadline, "no second sample");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(o["unpublished"], 10);
    let topic = &o["topics"][0];
    assert_eq!(topic["topic"], "rates");
    assert_eq!(topic["unpublished"], 10);
    // 40 written, the backlog grew by 10: 30 published in the interval.
    let point = &o["points"][0];
    let (written, published) = (
        point["written"].as_f64().unwrap(),
        point["published"].as_f64().unwrap(),
    );
    assert!(written > 0.0 && published > 0.0);
    assert!((written / published - 4.0 / 3.0).abs() < 1e-6, "{point}");
    let page = get(&app, "/", None).await.body;
    assert!(page.contains("id=\"chart\"") && page.contains("data-topic=\"rates\""));
}

/// The list and detail queries read indexes, never the whole outbox: the
/// plans on 30,000 published rows and a few parked ones, fresh statistics,
/// for the generic plan (every filter a parameter) and with filters set.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn list_queries_never_scan_the_outbox(pool: PgPool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, published_at, parked_at, last_error)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't' || (g % 3), 'k' || g,
                CASE WHEN g > 20 THEN now() END, CASE WHEN g <= 20 THEN now() END, 'boom'
         FROM generate_series(1, 30000) AS g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(&format!(
        "PREPARE parked_page(text, text, text, int8, int8) AS {}",
        outbox_runtime::ops::PARKED_PAGE
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    for mode in ["force_generic_plan", "force_custom_plan"] {
        sqlx::query(&format!("SET plan_cache_mode = {mode}"))
            .execute(&mut *conn)
            .await
            .unwrap();
        for args in [
            "NULL, NULL, NULL, 0, 51",
            "'t1', NULL, NULL, 0, 51",
            "NULL, 'k7', NULL, 5, 51",
            "NULL, NULL, 'boom', 0, 1001",
        ] {
            let plan: Vec<String> =
                sqlx::query_scalar(&format!("EXPLAIN EXECUTE parked_page({args})"))
                    .fetch_all(&mut *conn)
                    .await
                    .unwrap();
            let plan = plan.join("\n");
            assert!(!plan.contains("Seq Scan"), "{mode} {args}:\n{plan}");
        }
    }
    for sql in [
        "SELECT * FROM outbox_event WHERE id = 5",
        "SELECT coalesce(max(id), 0)::int8 FROM outbox_event",
        "SELECT topic, count(*) FROM outbox_event WHERE id > 29000 AND id <= 29100 GROUP BY topic",
    ] {
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}"))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan"), "{sql}:\n{plan}");
    }
    let app = writable(&pool);
    assert_eq!(get(&app, "/parked", None).await.status, StatusCode::OK);
}

/// The saga pages: the summary per type and stage (stuck instances linked
/// to their list), the list's filters, one instance with its state and
/// pending timeout, a missing instance (404) and bad input (400); values
/// from the table are escaped.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn saga_pages_show_stages_stuck_instances_and_one_instance(pool: PgPool) {
    sqlx::query(
        "INSERT INTO outbox_saga (saga_type, saga_id, state, stage, version, timeouts, updated_at,
                                  completed_at)
         VALUES ('order', 'o-1', '{\"note\":\"<script>alert(1)</script>\"}', 'AwaitingPayment', 1,
                 '{\"payment\":\"018f0000-0000-7000-8000-000000000001\"}',
                 now() - interval '3 hours', NULL),
                ('order', 'o-2<img src=x>', '{}', 'AwaitingPayment', 2, '{}', now(), NULL),
                ('order', 'o-3', '{}', 'Shipped', 3, '{}', now(), now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let app = writable(&pool);
    let page = get(&app, "/sagas", None).await;
    assert_eq!(page.status, StatusCode::OK);
    let body = page.body;
    let row = body
        .split("<tr data-saga=\"order\" data-stage=\"AwaitingPayment\">")
        .nth(1)
        .expect("a summary row")
        .split("</tr>")
        .next()
        .unwrap()
        .to_owned();
    assert!(row.contains("data-field=\"running\">2<"), "{row}");
    assert!(row.contains("data-field=\"completed\">0<"), "{row}");
    assert!(row.contains("idle=1h"), "stuck count linked: {row}");
    assert!(!body.contains("<img src=x>"), "escaped");
    assert!(body.contains("o-2&lt;img src=x&gt;"));
    let listed = |body: &str| -> Vec<String> {
        body.split("<tr data-id=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(listed(&body), ["o-1", "o-2&lt;img src=x&gt;"]);
    let stuck = get(
        &app,
        "/sagas?type=order&stage=AwaitingPayment&idle=1h",
        None,
    )
    .await;
    assert_eq!(listed(&stuck.body), ["o-1"]);
    let done = get(&app, "/sagas?state=completed", None).await;
    assert_eq!(listed(&done.body), ["o-3"]);

    let one = get(&app, "/sagas/show?type=order&id=o-1", None).await;
    assert_eq!(one.status, StatusCode::OK);
    assert!(one.body.contains("AwaitingPayment"));
    assert!(one.body.contains("018f0000-0000-7000-8000-000000000001"));
    assert!(!one.body.contains("<script>alert(1)"), "state escaped");
    let missing = get(&app, "/sagas/show?type=order&id=nope", None).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(missing.body.contains("no saga instance order/nope"));
    let bad = get(&app, "/sagas?state=sideways", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let bad = get(&app, "/sagas?idle=soon", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

/// In the progress mode an event is published without a time of its own:
/// its page says when it had gone out at the latest, the time of the first
/// position recorded past it (here recorded as a relay records one).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_event_page_in_the_progress_mode_dates_the_event_by_its_position(pool: PgPool) {
    outbox_runtime::relay::progress::enable(&pool)
        .await
        .unwrap();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, headers)
         VALUES (gen_random_uuid(), 'Order', 'o-1', 'OrderPlaced', '{}', 'orders', 'o-1', '{}')
         RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let app = writable(&pool);
    let page = get(&app, &format!("/parked/{id}"), None).await.body;
    assert!(page.contains(">unpublished<"), "{page}");
    assert!(!page.contains("id=\"passed\""), "{page}");

    let recorded: String = sqlx::query_scalar(
        r#"INSERT INTO outbox_progress (slots, done)
           SELECT ARRAY[lane_slot], pg_current_snapshot() FROM outbox_event WHERE id = $1
           RETURNING to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')"#,
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    let page = get(&app, &format!("/parked/{id}"), None).await.body;
    assert!(page.contains(">published<"), "{page}");
    assert!(page.contains(&format!("by {recorded}")), "{page}");
}

/// In the progress mode the overview shows each lane's lag and the
/// transaction holding the lanes' windows back (its pid and age), in the
/// page and in `/api/overview`; once it commits, its event is lag and
/// nothing is reported holding. The position is recorded as a relay
/// records one, while the transaction is open.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_overview_shows_the_lanes_lag_and_the_transaction_holding_them(pool: PgPool) {
    outbox_runtime::relay::progress::enable(&pool)
        .await
        .unwrap();
    let insert = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                            payload, topic, partition_key)
                  SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 'lanes', 'k' || g
                  FROM generate_series(1, $1) AS g";
    let mut holder = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query(insert)
        .bind(1)
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query(insert).bind(5).execute(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT generate_series(0, 63))::int2[], pg_current_snapshot()",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(insert).bind(3).execute(&pool).await.unwrap();

    let app = writable(&pool);
    let o: serde_json::Value =
        serde_json::from_str(&get(&app, "/api/overview", None).await.body).unwrap();
    let lag = |o: &serde_json::Value| -> i64 {
        let lanes = o["progress"]["lanes"].as_array().expect("lanes");
        lanes.iter().map(|l| l["events"].as_i64().unwrap()).sum()
    };
    assert_eq!(lag(&o), 3, "{o}");
    assert_eq!(o["progress"]["holding"]["pid"], pid, "{o}");
    let page = get(&app, "/", None).await.body;
    assert!(page.contains("Lanes (progress mode)"), "{page}");
    assert!(page.contains("Held back by transaction"), "{page}");
    assert!(page.contains(&format!("pid {pid}, open for ")), "{page}");
    assert!(page.contains("data-field=\"events\">3<"), "{page}");

    holder.commit().await.unwrap();
    // The next sample is at least a second after the last.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let o: serde_json::Value =
            serde_json::from_str(&get(&app, "/api/overview", None).await.body).unwrap();
        if lag(&o) == 4 && o["progress"]["holding"].is_null() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{o}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let page = get(&app, "/", None).await.body;
    assert!(
        page.contains("No transaction holds the lanes' windows back."),
        "{page}"
    );
}
