use outbox::prelude::*;

#[aggregate(root = Ledger)]
pub(crate) struct Account {
    balance: i64,
}

#[aggregate(root = r#Wallet)]
struct Purse(u32);

fn root_of<A: Aggregate>(state: A) -> A::Root {
    state.into_root()
}

fn main() {
    let mut ledger: Ledger = root_of(Account { balance: 1 });
    ledger.balance += 1;
    assert_eq!(ledger.state().balance, 2);
    let wallet = Wallet::new(Purse(3));
    assert_eq!(wallet.0, 3);
}
