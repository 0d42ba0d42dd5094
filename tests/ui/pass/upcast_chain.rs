use outbox::{DomainEvent, EventVersion};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderPlaced")]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: u64,
    amount: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderPlaced", version = 2, upcast_from(OrderPlacedV1))]
struct OrderPlacedV2 {
    #[event(aggregate_id)]
    order_id: u64,
    amount_cents: i64,
}

impl From<OrderPlacedV1> for OrderPlacedV2 {
    fn from(v1: OrderPlacedV1) -> Self {
        Self { order_id: v1.order_id, amount_cents: v1.amount * 100 }
    }
}

mod current {
    use super::*;

    #[derive(Serialize, Deserialize, DomainEvent)]
    #[event(topic = "orders", version = 3, upcast_from(super::OrderPlacedV2))]
    pub struct OrderPlaced {
        #[event(aggregate_id)]
        pub order_id: u64,
        pub amount_cents: i64,
        pub currency: String,
    }

    impl From<OrderPlacedV2> for OrderPlaced {
        fn from(v2: OrderPlacedV2) -> Self {
            Self { order_id: v2.order_id, amount_cents: v2.amount_cents, currency: "EUR".into() }
        }
    }
}

fn main() {
    use current::OrderPlaced;
    const _: () = assert!(OrderPlaced::VERSION == 3 && OrderPlaced::OLDEST_VERSION == 1);
    let v1 = OrderPlaced::from_versioned_payload("OrderPlaced", 1, br#"{"order_id":7,"amount":2}"#)
        .unwrap();
    assert_eq!((v1.order_id, v1.amount_cents, v1.currency.as_str()), (7, 200, "EUR"));
    let v3 = OrderPlaced::from_versioned_payload(
        "OrderPlaced",
        3,
        br#"{"order_id":7,"amount_cents":5,"currency":"USD"}"#,
    )
    .unwrap();
    assert_eq!(v3.currency, "USD");
    assert!(matches!(
        OrderPlaced::from_versioned_payload("OrderPlaced", 4, b"{}"),
        Err(outbox::Error::UnsupportedVersion { version: 4, oldest: 1, current: 3, .. })
    ));
}
