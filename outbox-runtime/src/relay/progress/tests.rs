//! The windows against writers that commit out of id order: transactions
//! that draw their transaction id before they wait for a key's lock, long
//! ones open across many windows, rolled-back ones; two readers on two
//! lanes, one of them resuming from its recorded progress as a relay that
//! stopped would.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgPool};
use uuid::Uuid;

use super::*;

const KEYS: usize = 12;

/// One row read: its key, id and event id.
type Read = (String, i64, Uuid);

/// Writes `txs` transactions per writer; returns the event ids committed.
async fn writer(pool: PgPool, w: usize, txs: usize) -> Vec<Uuid> {
    let mut committed = Vec::new();
    let mut conn = pool.acquire().await.unwrap();
    for t in 0..txs {
        // A cheap deterministic spread of shapes.
        let pick = (w * 7919 + t * 104_729) % 1000;
        let key = format!("k{}", pick % KEYS);
        let mut tx = conn.begin().await.unwrap();
        if pick.is_multiple_of(3) {
            // Draws its transaction id first, then waits for the key.
            sqlx::query("INSERT INTO progress_scratch VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis((pick % 20) as u64)).await;
        }
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(&key)
            .execute(&mut *tx)
            .await
            .unwrap();
        let mut ids = Vec::new();
        for i in 0..(1 + pick % 3) {
            let id = Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 VALUES ($1, 'A', $2, 'E', jsonb_build_object('w', $3::int, 't', $4::int, 'i', $5::int), 't', $2)",
            )
            .bind(id)
            .bind(&key)
            .bind(w as i32)
            .bind(t as i32)
            .bind(i as i32)
            .execute(&mut *tx)
            .await
            .unwrap();
            ids.push(id);
        }
        let hold = if pick.is_multiple_of(17) {
            150
        } else {
            (pick % 9) as u64
        };
        tokio::time::sleep(Duration::from_millis(hold)).await;
        if pick % 10 == 7 {
            tx.rollback().await.unwrap();
        } else {
            tx.commit().await.unwrap();
            committed.extend(ids);
        }
    }
    committed
}

/// Reads the slots `slots` window after window until `stop` is set and a
/// window taken after that is finished; records the progress after each
/// chunk, but with `crash_every` only every other chunk, and every that
/// many chunks forgets its state and loads the recorded progress again.
/// Returns the rows read and how many windows had transactions in flight
/// at their start.
async fn reader(
    pool: PgPool,
    slots: Vec<i16>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    crash_every: Option<usize>,
) -> (Vec<Read>, usize) {
    let mut conn = pool.acquire().await.unwrap();
    let mut reads = Vec::new();
    let mut with_xip = 0;
    let mut chunks: usize = 0;
    let mut window = load(&mut conn, &slots).await.unwrap();
    let mut last_pass = false;
    loop {
        let stopping = stop.load(std::sync::atomic::Ordering::SeqCst);
        let mut crashed = false;
        loop {
            match window.next(&mut conn, 7, 1 << 20).await.unwrap() {
                Chunk::Rows(rows) => {
                    chunks += 1;
                    reads.extend(
                        rows.into_iter()
                            .map(|r| (r.partition_key, r.id, r.event_id)),
                    );
                    if crash_every.is_none() || chunks.is_multiple_of(2) {
                        window.record(&mut conn).await.unwrap();
                    }
                    if crash_every.is_some_and(|n| chunks.is_multiple_of(n)) {
                        crashed = true;
                        break;
                    }
                }
                Chunk::Finished => {
                    if window
                        .done
                        .rsplit(':')
                        .next()
                        .is_some_and(|xip| !xip.is_empty())
                    {
                        with_xip += 1;
                    }
                    window.advance();
                    window.record(&mut conn).await.unwrap();
                    break;
                }
            }
        }
        if crashed {
            window = load(&mut conn, &slots).await.unwrap();
            continue;
        }
        if last_pass {
            return (reads, with_xip);
        }
        // The window just finished was taken before `stop` was read set:
        // one more takes a window after every writer ended.
        last_pass = stopping;
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

async fn run(pool: &PgPool, crash_every: Option<usize>) {
    sqlx::query("CREATE TABLE progress_scratch (x int)")
        .execute(pool)
        .await
        .unwrap();
    enable(pool).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lane = |l: i16| (0..64).filter(|s| s % 2 == l).collect::<Vec<i16>>();
    let readers = [
        tokio::spawn(reader(pool.clone(), lane(0), stop.clone(), crash_every)),
        tokio::spawn(reader(pool.clone(), lane(1), stop.clone(), None)),
    ];
    let writers: Vec<_> = (0..6)
        .map(|w| tokio::spawn(writer(pool.clone(), w, 60)))
        .collect();
    let mut committed = HashSet::new();
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut reads: Vec<Read> = Vec::new();
    let mut with_xip = 0;
    for r in readers {
        let (r, x) = r.await.unwrap();
        reads.extend(r);
        with_xip += x;
    }
    assert!(
        with_xip > 0,
        "no window started with a transaction in flight: the test did not exercise the xip part"
    );

    // Per key, the first time each event is read, in id order.
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut twice = 0;
    for (key, id, event_id) in &reads {
        if !seen.insert(*event_id) {
            twice += 1;
            continue;
        }
        let before = last.insert(key, *id);
        assert!(
            before.is_none_or(|b| b < *id),
            "key {key}: id {id} read after {before:?}"
        );
    }
    let missing: Vec<_> = committed.difference(&seen).collect();
    assert!(missing.is_empty(), "never read: {missing:?}");
    let phantom: Vec<_> = seen.difference(&committed).collect();
    assert!(phantom.is_empty(), "read but never committed: {phantom:?}");
    match crash_every {
        None => assert_eq!(twice, 0, "read twice without a restart"),
        Some(_) => assert!(
            twice > 0,
            "the restarts re-read nothing: they did not happen"
        ),
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn every_committed_event_is_read_once_in_key_order(pool: PgPool) {
    run(&pool, None).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_reader_that_restarts_resumes_from_its_recorded_position(pool: PgPool) {
    run(&pool, Some(5)).await;
}

/// Rows written before the column existed, rows published by marks, held
/// and parked rows, and a transaction in flight while the mode is enabled.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn enabling_leaves_out_only_what_is_published(pool: PgPool) {
    let insert = |key: &'static str, published: bool, legacy: bool| {
        let pool = pool.clone();
        async move {
            let id = Uuid::new_v4();
            sqlx::query(&format!(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key, published_at{})
                 VALUES ($1, 'A', $2, 'E', '{{}}', 't', $2, {}{})",
                if legacy { ", txid" } else { "" },
                if published { "now()" } else { "NULL" },
                if legacy { ", NULL" } else { "" },
            ))
            .bind(id)
            .bind(key)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let mut expected = vec![
        insert("a", false, true).await,
        insert("b", false, true).await,
        insert("a", false, false).await,
    ];
    insert("a", true, true).await;
    insert("c", true, false).await;
    // Held back (a key's failure, a missing topic): read with the rest.
    let held = insert("h", false, false).await;
    sqlx::query(
        "UPDATE outbox_event SET held_until = now() + interval '1 hour' WHERE event_id = $1",
    )
    .bind(held)
    .execute(&pool)
    .await
    .unwrap();
    expected.push(held);
    // Parked: stays parked.
    let parked = insert("p", false, false).await;
    sqlx::query("UPDATE outbox_event SET parked_at = now() WHERE event_id = $1")
        .bind(parked)
        .execute(&pool)
        .await
        .unwrap();

    // In flight while the mode is enabled (after the index is built: its
    // build waits for the writers' transactions).
    create_index(&pool).await.unwrap();
    let mut other = pool.acquire().await.unwrap();
    let mut tx = other.begin().await.unwrap();
    let late = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                   payload, topic, partition_key)
         VALUES ($1, 'A', 'd', 'E', '{}', 't', 'd')",
    )
    .bind(late)
    .execute(&mut *tx)
    .await
    .unwrap();
    // The switch, which returns at once (`enable`'s drop of the default
    // mode's indexes would wait for this transaction).
    switch_on(&pool).await.unwrap();
    // Switching twice changes nothing.
    switch_on(&pool).await.unwrap();
    tx.commit().await.unwrap();
    // Nor does enabling once the transaction has ended (it drops the
    // indexes).
    enable(&pool).await.unwrap();
    expected.push(late);
    expected.push(insert("e", false, false).await);

    let mut conn = pool.acquire().await.unwrap();
    let slots: Vec<i16> = (0..64).collect();
    let mut window = load(&mut conn, &slots).await.unwrap();
    let mut read = Vec::new();
    while let Chunk::Rows(rows) = window.next(&mut conn, 2, 1 << 20).await.unwrap() {
        read.extend(rows.into_iter().map(|r| r.event_id));
    }
    expected.sort();
    read.sort();
    assert_eq!(read, expected);
}

/// Inserts 400 events over 40 keys, in one transaction.
async fn insert_over_40_keys(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                   payload, topic, partition_key)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || (g % 40)
         FROM generate_series(1, 400) AS g",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Two lanes' windows listed in one statement with a cap small enough that
/// most slots reach it: each window's list stops at the lowest last row of
/// its capped slots, and taking, fetching and handing its rows (the lists
/// that follow made one window at a time) reads every row of its slots
/// once, in id order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn windows_listed_together_under_a_cap_read_each_row_once(pool: PgPool) {
    enable(&pool).await.unwrap();
    insert_over_40_keys(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let lanes: Vec<Vec<i16>> = vec![
        (0..64).filter(|s| s % 2 == 0).collect(),
        (0..64).filter(|s| s % 2 == 1).collect(),
    ];
    let mut windows = Vec::new();
    for slots in &lanes {
        windows.push(load(&mut conn, slots).await.unwrap());
    }
    let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let mut ready: Vec<&mut Window> = windows
        .iter_mut()
        .filter_map(|w| w.ready(&snapshot).then_some(w))
        .collect();
    assert_eq!(ready.len(), 2);
    // 32 slots a window, 2 rows a slot at most.
    list_windows_capped(&mut conn, &mut ready, &Skip::default(), 64)
        .await
        .unwrap();
    for (w, slots) in windows.iter().zip(&lanes) {
        let of_lane: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE lane_slot = ANY($1)")
                .bind(slots)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert!(
            !w.complete && w.capped && (w.listed.len() as i64) < of_lane,
            "cut by the cap"
        );
        assert!(w.listed.iter().map(|r| r.0).is_sorted());
    }
    for (w, slots) in windows.iter_mut().zip(&lanes) {
        let read = read_all(w, &mut conn).await;
        let expected: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM outbox_event WHERE lane_slot = ANY($1) ORDER BY id")
                .bind(slots)
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(!expected.is_empty());
        assert_eq!(read, expected);
    }
}

/// Reads a window through `take`, `fetch` and `hand` until it is done:
/// the ids handed over.
async fn read_all(w: &mut Window, conn: &mut sqlx::PgConnection) -> Vec<i64> {
    let mut read = Vec::new();
    while let Some(taken) = w
        .take(conn, 7, &Skip::default(), &mut Default::default())
        .await
        .unwrap()
    {
        let rows = fetch(conn, &taken, false, &[]).await.unwrap();
        let keep = rows.len();
        read.extend(w.hand(&taken, rows, keep).into_iter().map(|r| r.id));
    }
    read
}

/// Windows that stand at the same place are listed together, in one scan
/// (a group); a window at another place is a group of its own; a group
/// with more rows than its cap is listed again slot by slot, in parts.
/// Every window then reads each row of its slots after its position once,
/// in id order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn windows_at_one_place_are_listed_together_and_a_group_past_its_cap_slot_by_slot(
    pool: PgPool,
) {
    enable(&pool).await.unwrap();
    insert_over_40_keys(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let lanes: Vec<Vec<i16>> = (0..3)
        .map(|l| (0..64).filter(|s| s % 3 == l).collect())
        .collect();
    let expected = |slots: &Vec<i16>, after: i64| {
        let pool = pool.clone();
        let slots = slots.clone();
        async move {
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM outbox_event WHERE lane_slot = ANY($1) AND id > $2 ORDER BY id",
            )
            .bind(&slots)
            .bind(after)
            .fetch_all(&pool)
            .await
            .unwrap();
            ids
        }
    };
    // The third lane stands further into the window (as after a rewind):
    // five rows left.
    let of_third = expected(&lanes[2], 0).await;
    let third_after = of_third[of_third.len() - 6];
    for (list_cap, grouped) in [(1_000, true), (5, false)] {
        let mut windows = Vec::new();
        for slots in &lanes {
            windows.push(load(&mut conn, slots).await.unwrap());
        }
        windows[2].after_id = third_after;
        let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let mut ready: Vec<&mut Window> = windows
            .iter_mut()
            .filter_map(|w| w.ready(&snapshot).then_some(w))
            .collect();
        list_windows_capped(&mut conn, &mut ready, &Skip::default(), list_cap)
            .await
            .unwrap();
        // The first two: one group of 2 × `list_cap` rows at most.
        for w in &windows[..2] {
            assert_eq!(w.capped, !grouped, "cap {list_cap}");
            assert_eq!(w.complete, grouped, "cap {list_cap}");
        }
        // The third: a group of its own, of five rows.
        assert!(!windows[2].capped && windows[2].complete);
        assert_eq!(windows[2].listed.len(), 5);
        for (w, slots) in windows.iter_mut().zip(&lanes) {
            let after = w.after_id;
            let want = expected(slots, after).await;
            assert!(!want.is_empty());
            if grouped {
                let listed: Vec<i64> = w.listed.iter().map(|r| r.0).collect();
                assert_eq!(listed, want, "listed whole, in id order");
            }
            assert_eq!(read_all(w, &mut conn).await, want, "cap {list_cap}");
        }
    }
}

/// The windows of a claim listed with their rows' columns when they fit in
/// its room (the list and the fetch in one statement): every row's columns
/// as the fetch gives them. A group with more rows than the room is listed
/// without them (and its rows fetched). Either way each window reads each
/// row of its slots once, in id order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn windows_that_fit_in_a_claim_are_listed_with_their_rows(pool: PgPool) {
    enable(&pool).await.unwrap();
    insert_over_40_keys(&pool).await;
    // A held row of one key: the probe is in the columns.
    sqlx::query(
        "UPDATE outbox_event SET held_until = now() + interval '1 hour'
         WHERE id = (SELECT min(id) FROM outbox_event WHERE partition_key = 'k7')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let lanes: Vec<Vec<i16>> = (0..2)
        .map(|l| (0..64).filter(|s| s % 2 == l).collect())
        .collect();
    for (room, with_rows) in [(1_000, true), (50, false)] {
        let mut behind = 0;
        let mut windows = Vec::new();
        for slots in &lanes {
            windows.push(load(&mut conn, slots).await.unwrap());
        }
        let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let mut ready: Vec<&mut Window> = windows
            .iter_mut()
            .filter_map(|w| w.ready(&snapshot).then_some(w))
            .collect();
        list_windows_rows(&mut conn, &mut ready, &Skip::default(), room, &[])
            .await
            .unwrap();
        for (w, slots) in windows.iter_mut().zip(&lanes) {
            assert!(w.complete && !w.capped, "room {room}");
            assert_eq!(w.rows.len(), if with_rows { w.listed.len() } else { 0 });
            let listed: Vec<Listed> = w
                .listed
                .iter()
                .map(|(id, event, tid, _)| (*id, *event, tid.clone()))
                .collect();
            let fetched = fetch(&mut conn, &listed, false, &[]).await.unwrap();
            assert_eq!(fetched.len(), listed.len());
            if with_rows {
                for f in &fetched {
                    let mut r = w.listed_row(&f.event_id).expect("listed with its columns");
                    // Seconds until the hold ends: from each statement's time.
                    assert_eq!(r.behind_held_secs.is_some(), f.behind_held_secs.is_some());
                    behind += usize::from(r.behind_held_secs.is_some());
                    r.behind_held_secs = f.behind_held_secs;
                    // Its place, as listed (the fetch does not return it).
                    assert!(listed.iter().any(|l| l.1 == r.event_id && l.2 == r.tid));
                    r.tid.clone_from(&f.tid);
                    assert_eq!(format!("{r:?}"), format!("{f:?}"));
                }
            }
            let want: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM outbox_event WHERE lane_slot = ANY($1) AND held_until IS NULL
                 ORDER BY id",
            )
            .bind(slots)
            .fetch_all(&pool)
            .await
            .unwrap();
            let read: Vec<i64> = listed.iter().map(|l| l.0).collect();
            assert_eq!(read, want, "room {room}");
        }
        // The held row's key's later rows: 9 of its 10.
        assert_eq!(behind, if with_rows { 9 } else { 0 });
    }
}

/// A chunk stops at the byte budget (the first row comes alone when it is
/// larger) and the rest of the window follows.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_chunk_stops_at_the_byte_budget(pool: PgPool) {
    enable(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                   payload, topic, partition_key)
         SELECT gen_random_uuid(), 'A', 'a', 'E', jsonb_build_object('p', repeat('x', 1000)), 't', 'k'
         FROM generate_series(1, 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let slots: Vec<i16> = (0..64).collect();
    let mut window = load(&mut conn, &slots).await.unwrap();
    let mut sizes = Vec::new();
    let mut ids = Vec::new();
    while let Chunk::Rows(rows) = window.next(&mut conn, 100, 2500).await.unwrap() {
        sizes.push(rows.len());
        ids.extend(rows.iter().map(|r| r.id));
    }
    assert_eq!(sizes, vec![3, 3, 3, 1]);
    assert!(ids.windows(2).all(|p| p[0] < p[1]));
    assert_eq!(ids.len(), 10);
    // A row larger than the budget comes alone.
    let mut window = load(&mut conn, &slots).await.unwrap();
    match window.next(&mut conn, 100, 10).await.unwrap() {
        Chunk::Rows(rows) => assert_eq!(rows.len(), 1),
        Chunk::Finished => panic!("the window is not empty"),
    }
}

/// Inserts `n` events, each of a key of its own.
async fn insert_keys(pool: &PgPool, n: i32) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                   payload, topic, partition_key)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || g
         FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// Reads the window to its end, records the next position; the rows read.
async fn drain(window: &mut Window, conn: &mut sqlx::PgConnection) -> Vec<Uuid> {
    let mut read = Vec::new();
    loop {
        match window.next(conn, 50, 1 << 20).await.unwrap() {
            Chunk::Rows(rows) => read.extend(rows.into_iter().map(|r| r.event_id)),
            Chunk::Finished => {
                window.advance();
                window.record(conn).await.unwrap();
                return read;
            }
        }
    }
}

/// After a change of the lane count, a lane made of slots recorded at
/// different positions starts from the earliest of them: the rows one lane
/// had read are read again, none of the other's is lost; where they stand
/// alike, nothing is read again.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_lane_of_slots_at_different_positions_starts_from_the_earliest(pool: PgPool) {
    enable(&pool).await.unwrap();
    let insert = |n: i32| insert_keys(&pool, n);
    let mut conn = pool.acquire().await.unwrap();
    let all: Vec<i16> = (0..64).collect();
    let even: Vec<i16> = (0..64).filter(|s| s % 2 == 0).collect();
    let odd: Vec<i16> = (0..64).filter(|s| s % 2 == 1).collect();
    insert(100).await;
    let mut one = load(&mut conn, &all).await.unwrap();
    assert_eq!(drain(&mut one, &mut conn).await.len(), 100);

    // Two lanes: the even one reads its rows; the odd one reads none.
    insert(100).await;
    let mut lane0 = load(&mut conn, &even).await.unwrap();
    let read0 = drain(&mut lane0, &mut conn).await.len();
    assert!(
        read0 > 0 && read0 < 100,
        "{read0} of 100 rows in half the slots"
    );

    // One lane again: from the odd lane's position, the even lane's rows
    // read again; not from the position recorded for all the slots before.
    insert(10).await;
    let mut one = load(&mut conn, &all).await.unwrap();
    assert_eq!(drain(&mut one, &mut conn).await.len(), 110);

    // Two lanes that both read everything, then one: only what is new.
    insert(100).await;
    for slots in [&even, &odd] {
        let mut lane = load(&mut conn, slots).await.unwrap();
        drain(&mut lane, &mut conn).await;
    }
    insert(10).await;
    let mut one = load(&mut conn, &all).await.unwrap();
    assert_eq!(drain(&mut one, &mut conn).await.len(), 10);
}

#[test]
fn snapshots_parse_print_and_intersect() {
    let a = Snapshot::parse("100:200:120,150").unwrap();
    assert_eq!(a.to_string(), "100:200:120,150");
    assert!(a.visible(99) && a.visible(110) && !a.visible(120) && !a.visible(200));
    let b = Snapshot::parse("130:180:").unwrap();
    assert!(Snapshot::parse("1:2").is_none() && Snapshot::parse("1:2:x").is_none());
    let both = a.intersect(&b);
    assert_eq!(both.to_string(), "100:180:120,150");
    for t in 90..210 {
        assert_eq!(both.visible(t), a.visible(t) && b.visible(t), "txid {t}");
    }
    let c = Snapshot::parse("160:170:").unwrap();
    let d = Snapshot::parse("140:175:140,172").unwrap();
    for t in 130..180 {
        assert_eq!(
            c.intersect(&d).visible(t),
            c.visible(t) && d.visible(t),
            "txid {t}"
        );
    }
}

/// Rows written again after their window was listed (a rare path's write,
/// a table rewritten) are at another place: found by their event id.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn rows_that_moved_since_they_were_listed_are_still_read(pool: PgPool) {
    enable(&pool).await.unwrap();
    insert_keys(&pool, 30).await;
    let mut conn = pool.acquire().await.unwrap();
    let slots: Vec<i16> = (0..64).collect();
    let mut window = load(&mut conn, &slots).await.unwrap();
    let mut read = Vec::new();
    // The first chunk lists the whole window.
    match window.next(&mut conn, 5, 1 << 20).await.unwrap() {
        Chunk::Rows(rows) => read.extend(rows.into_iter().map(|r| r.id)),
        Chunk::Finished => panic!("the window is not empty"),
    }
    let moved = sqlx::query("UPDATE outbox_event SET attempts = attempts WHERE id % 2 = 0")
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(moved, 15);
    while let Chunk::Rows(rows) = window.next(&mut conn, 5, 1 << 20).await.unwrap() {
        read.extend(rows.into_iter().map(|r| r.id));
    }
    let all: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_event ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(read, all);
}

/// The partitioned layout: the column default comes along with the
/// conversion, and a chunk's places (`ctid`s, which repeat from partition
/// to partition) find each row in its own partition.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_partitioned_layout_reads_the_same(pool: PgPool) {
    let insert = |n: i32| {
        let pool = pool.clone();
        async move {
            sqlx::query(&format!(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 SELECT {}, 'A', 'a', 'E', '{{}}', 't', 'k' || g
                 FROM generate_series(1, $1) AS g",
                // Ids of now (the current partition) and random ones (the
                // legacy partition and the default one).
                "CASE WHEN g % 2 = 0 THEN gen_random_uuid() ELSE \
                 encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) placing \
                 substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) \
                 FROM 3) FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid END"
            ))
            .bind(n)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert(40).await;
    crate::partition::enable(&pool, &crate::partition::PartitionPlan::default())
        .await
        .unwrap();
    enable(&pool).await.unwrap();
    insert(60).await;
    let partitions: i64 = sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(partitions >= 2, "the rows are in {partitions} partition(s)");
    let unset: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE txid IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(unset, 0, "rows without a transaction id");
    let mut conn = pool.acquire().await.unwrap();
    let slots: Vec<i16> = (0..64).collect();
    let mut window = load(&mut conn, &slots).await.unwrap();
    let mut read = drain(&mut window, &mut conn).await;
    let mut all: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event")
        .fetch_all(&pool)
        .await
        .unwrap();
    read.sort();
    all.sort();
    assert_eq!(read, all);
}

/// A claim's list over every slot (one window from `done`), slot by slot
/// and as one group, and a fetch of the first 20 rows' places, as
/// `EXECUTE` arguments.
async fn claim_args(conn: &mut sqlx::PgConnection, done: &str) -> (String, String, String) {
    let upto: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let tids: Vec<String> =
        sqlx::query_scalar("SELECT ctid::text FROM outbox_event ORDER BY id LIMIT 20")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    let slots: Vec<String> = (0..64).map(|s| s.to_string()).collect();
    // Quoted: a snapshot taken while other transactions run lists them
    // with commas (`xmin:xmax:xip,xip`).
    let each = |v: &str| vec![format!("\"{v}\""); 64].join(",");
    let list = format!(
        "'{{{}}}', '{{{}}}', '{{{}}}', '{{{}}}', '{{{}}}', '{{{}}}', '{{}}', '{{}}', NULL",
        slots.join(","),
        each("0"),
        each(done),
        each(&upto),
        each("0"),
        each("100000"),
    );
    let group = format!(
        "'{{\"{{{}}}\"}}', '{{\"{done}\"}}', '{{\"{upto}\"}}', '{{0}}', '{{100001}}', '{{}}', '{{}}', NULL",
        slots.join(",")
    );
    let quoted: Vec<String> = tids.iter().map(|t| format!("\"{t}\"")).collect();
    (list, group, format!("'{{{}}}', '{{}}'", quoted.join(",")))
}

/// The plan of `sql` (an `EXPLAIN`), as text.
async fn plan_of(conn: &mut sqlx::PgConnection, sql: &str) -> String {
    let plan: Vec<String> = sqlx::query_scalar(sql)
        .persistent(false)
        .fetch_all(conn)
        .await
        .unwrap();
    plan.join("\n")
}

/// A claim keeps the generic plans of its first execution on a connection
/// (see `LIST_MANY`): planned while the outbox was nearly empty, and run
/// once it has grown a thousandfold since its last `ANALYZE`, the list
/// still reads the windows through the progress index (not the primary
/// key: every row of the table at each list) and the fetch reads its rows
/// by their places (a TID scan, not a range of the events' unique index).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_claims_kept_plans_do_not_depend_on_the_tables_statistics(pool: PgPool) {
    enable(&pool).await.unwrap();
    let insert = |n: i64| {
        format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{{}}', 't', 'k' || g
             FROM generate_series(1, {n}) AS g"
        )
    };
    sqlx::raw_sql(&format!(
        "ALTER TABLE outbox_event SET (autovacuum_enabled = false);
         {}; ANALYZE outbox_event",
        insert(3)
    ))
    .execute(&pool)
    .await
    .unwrap();
    let done: String = sqlx::query_scalar("SELECT done::text FROM outbox_progress LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let begin = "BEGIN; SET LOCAL enable_seqscan = off; \
                 SET LOCAL plan_cache_mode = force_generic_plan";
    sqlx::raw_sql(begin).execute(&mut *conn).await.unwrap();
    sqlx::raw_sql(&format!(
        "PREPARE claim_list AS {}; PREPARE claim_groups AS {}; PREPARE claim_fetch AS {};
         PREPARE claim_rows AS {}",
        *LIST_MANY, *LIST_GROUPS, *FETCH_AT, *LIST_GROUPS_ROWS
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    let (list, group, fetch) = claim_args(&mut conn, &done).await;
    let listed = sqlx::raw_sql(&format!("EXECUTE claim_list({list})"))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert_eq!(listed.len(), 3);
    // The rows' list also takes the claim's held rows (none here).
    for groups in [
        format!("claim_groups({group})"),
        format!("claim_rows({group}, '{{}}')"),
    ] {
        let listed = sqlx::raw_sql(&format!("EXECUTE {groups}"))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        assert_eq!(listed.len(), 3);
    }
    let fetched = sqlx::raw_sql(&format!("EXECUTE claim_fetch({fetch})"))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert_eq!(fetched.len(), 3);
    sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();

    // Two transactions in flight across the next writes: the window's
    // snapshot lists them (`xmin:xmax:xip,xip`), as when writers run.
    let mut in_flight = Vec::new();
    for _ in 0..2 {
        let mut other = pool.acquire().await.unwrap();
        sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id()")
            .execute(&mut *other)
            .await
            .unwrap();
        in_flight.push(other);
    }
    sqlx::raw_sql(&insert(5000)).execute(&pool).await.unwrap();
    let xip: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_snapshot_xip(pg_current_snapshot())")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert!(xip >= 2, "{xip} transactions in flight");
    let (list, group, fetch) = claim_args(&mut conn, &done).await;
    sqlx::raw_sql(begin).execute(&mut *conn).await.unwrap();
    for list in [
        format!("claim_list({list})"),
        format!("claim_groups({group})"),
        format!("claim_rows({group}, '{{}}')"),
    ] {
        let plan = plan_of(&mut conn, &format!("EXPLAIN EXECUTE {list}")).await;
        assert!(plan.contains(INDEX), "{plan}");
        assert!(!plan.contains("outbox_event_pkey"), "{plan}");
    }
    let plan = plan_of(&mut conn, &format!("EXPLAIN EXECUTE claim_fetch({fetch})")).await;
    assert!(plan.contains("Tid Scan on outbox_event"), "{plan}");
    assert!(!plan.contains("outbox_event_event_id_key"), "{plan}");
    for list in [
        format!("claim_list({list})"),
        format!("claim_groups({group})"),
        format!("claim_rows({group}, '{{}}')"),
    ] {
        let listed = sqlx::raw_sql(&format!("EXECUTE {list}"))
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        assert_eq!(listed.len(), 5003, "the whole window");
    }
    sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
    for mut other in in_flight {
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut *other)
            .await
            .unwrap();
    }
}
