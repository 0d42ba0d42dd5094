//! Aggregates with a real PostgreSQL: the state stays an ordinary struct
//! (literal, serde, `sqlx::FromRow`), the root records events, the Unit of
//! Work collects them, and uncollected events are reported when dropped.

use std::io::Write;
use std::sync::{Arc, Mutex};

use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[aggregate]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
struct Order {
    id: Uuid,
    amount_cents: i64,
    status: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[serde(tag = "type")]
#[event(topic = "orders", aggregate_type = "Order")]
enum OrderEvent {
    #[event(event_type = "OrderPlaced")]
    Placed {
        #[event(aggregate_id)]
        order_id: Uuid,
        amount_cents: i64,
    },
    #[event(event_type = "OrderPaid")]
    Paid {
        #[event(aggregate_id)]
        order_id: Uuid,
    },
}

impl OrderRoot {
    fn place(amount_cents: i64) -> Self {
        let id = Uuid::now_v7();
        let mut root = OrderRoot::new(Order {
            id,
            amount_cents,
            status: "placed".into(),
        });
        root.record(OrderEvent::Placed {
            order_id: id,
            amount_cents,
        });
        root
    }

    fn pay(&mut self) {
        self.status = "paid".into();
        let order_id = self.id;
        self.record(OrderEvent::Paid { order_id });
    }
}

async fn orders_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL, status text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

async fn save(uow: &mut UnitOfWork, order: &Order) {
    sqlx::query(
        "INSERT INTO orders (id, amount_cents, status) VALUES ($1, $2, $3)
         ON CONFLICT (id) DO UPDATE SET amount_cents = EXCLUDED.amount_cents, status = EXCLUDED.status",
    )
    .bind(order.id)
    .bind(order.amount_cents)
    .bind(&order.status)
    .execute(&mut **uow)
    .await
    .unwrap();
}

#[test]
fn state_keeps_struct_literal_and_serde_without_event_storage() {
    let order = Order {
        id: Uuid::nil(),
        amount_cents: 5,
        status: "placed".into(),
    };
    let json = serde_json::to_value(&order).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"id": "00000000-0000-0000-0000-000000000000", "amount_cents": 5, "status": "placed"})
    );
    let back: Order = serde_json::from_value(json).unwrap();
    assert_eq!(back, order);
    let root: OrderRoot = order.clone().into_root();
    assert_eq!(root.pending_events(), 0);
    assert_eq!(root.into_inner(), order);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn collected_events_are_committed_with_the_state(pool: PgPool) {
    orders_table(&pool).await;
    let mut order = OrderRoot::place(700);
    order.pay();
    assert_eq!(order.pending_events(), 2);

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    save(&mut uow, &order).await;
    uow.collect(&mut order);
    assert_eq!(order.pending_events(), 0, "collect takes the events");
    assert_eq!(uow.pending_events(), 2);
    uow.commit().await.unwrap();

    // FromRow on the state type.
    let loaded: Order = sqlx::query_as("SELECT id, amount_cents, status FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(&loaded, order.state());
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT event_type, aggregate_id FROM outbox_event ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let id = order.id.to_string();
    assert_eq!(
        rows,
        vec![("OrderPlaced".into(), id.clone()), ("OrderPaid".into(), id)]
    );

    // Load, change, save again: the loaded state becomes a root.
    let mut again = loaded.into_root();
    again.pay();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    save(&mut uow, &again).await;
    uow.collect(&mut again);
    uow.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_rolled_back_unit_of_work_loses_the_collected_events(pool: PgPool) {
    orders_table(&pool).await;
    let mut order = OrderRoot::place(10);
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    save(&mut uow, &order).await;
    uow.collect(&mut order);
    drop(uow);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logs_of(f: impl FnOnce()) -> String {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn dropping_a_root_with_uncollected_events_is_reported() {
    let logs = logs_of(|| {
        let mut order = OrderRoot::place(10);
        order.pay();
        drop(order);
    });
    assert!(logs.contains("WARN"), "{logs}");
    assert!(logs.contains("uncollected events"), "{logs}");
    assert!(logs.contains("OrderRoot"), "{logs}");
    assert!(
        logs.contains("OrderPlaced") && logs.contains("OrderPaid"),
        "{logs}"
    );
    assert!(logs.contains("count=2"), "{logs}");
}

#[test]
fn discarding_on_purpose_or_collecting_is_silent() {
    let logs = logs_of(|| {
        let mut order = OrderRoot::place(10);
        assert_eq!(order.discard_events(), 1);
        drop(order);
    });
    assert!(logs.is_empty(), "{logs}");
}
