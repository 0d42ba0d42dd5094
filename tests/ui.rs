//! Compile-time behaviour of `#[derive(DomainEvent)]`, `#[aggregate]`,
//! `#[inbox_handler]` and `#[command_handler]`: inputs that must compile, and
//! the error each mistake produces, among them the ways of reaching a Kafka
//! producer from a handler that the handler macros reject.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
