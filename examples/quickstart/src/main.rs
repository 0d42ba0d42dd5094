//! Quickstart: place an order through an aggregate root and a Unit of Work,
//! then print the order row and the outbox rows written in the same commit.

use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;

/// The order aggregate's state: an ordinary struct (literal, serde, FromRow).
#[aggregate]
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct Order {
    id: Uuid,
    customer: String,
    amount_cents: i64,
    status: String,
}

/// Everything that can happen to an order, one variant per event type.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[serde(tag = "type")]
#[event(topic = "orders", aggregate_type = "Order")]
pub enum OrderEvent {
    /// An order was placed.
    #[event(event_type = "OrderPlaced")]
    Placed {
        /// The order.
        #[event(aggregate_id)]
        order_id: Uuid,
        /// Who ordered.
        customer: String,
        /// Amount in cents.
        amount_cents: i64,
    },
    /// The order was confirmed.
    #[event(event_type = "OrderConfirmed")]
    Confirmed {
        /// The order.
        #[event(aggregate_id)]
        order_id: Uuid,
    },
}

impl OrderRoot {
    /// Places a new order: creates the state and records `OrderPlaced`.
    pub fn place(customer: &str, amount_cents: i64) -> Self {
        let id = Uuid::now_v7();
        let mut order = OrderRoot::new(Order {
            id,
            customer: customer.to_owned(),
            amount_cents,
            status: "placed".into(),
        });
        order.record(OrderEvent::Placed {
            order_id: id,
            customer: customer.to_owned(),
            amount_cents,
        });
        order
    }

    /// Confirms the order and records `OrderConfirmed`.
    pub fn confirm(&mut self) {
        self.status = "confirmed".into();
        let order_id = self.id;
        self.record(OrderEvent::Confirmed { order_id });
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    outbox::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS quickstart_orders (
            id uuid PRIMARY KEY, customer text NOT NULL,
            amount_cents bigint NOT NULL, status text NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let mut order = OrderRoot::place("alice", 4_200);
    order.confirm();

    let mut uow = UnitOfWork::begin(&pool).await?;
    sqlx::query("INSERT INTO quickstart_orders (id, customer, amount_cents, status) VALUES ($1, $2, $3, $4)")
        .bind(order.id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .bind(&order.status)
        .execute(&mut *uow)
        .await?;
    uow.collect(&mut order);
    let committed = uow.commit().await?;

    let saved: Order = sqlx::query_as("SELECT * FROM quickstart_orders WHERE id = $1")
        .bind(order.id)
        .fetch_one(&pool)
        .await?;
    println!("order row: {saved:?}");
    println!("outbox rows written in the same transaction:");
    let rows: Vec<(i64, Uuid, String, String, String, String, String)> = sqlx::query_as(
        "SELECT id, event_id, event_type, topic, partition_key, payload::text, headers::text
         FROM outbox_event WHERE event_id = ANY($1) ORDER BY id",
    )
    .bind(&committed.event_ids)
    .fetch_all(&pool)
    .await?;
    for (id, event_id, event_type, topic, key, payload, headers) in rows {
        println!("  #{id} {event_type} topic={topic} key={key} event_id={event_id}");
        println!("      payload={payload}");
        println!("      headers={headers}");
    }
    Ok(())
}
