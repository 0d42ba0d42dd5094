//! Compile-time behaviour of `#[derive(DomainEvent)]` and `#[aggregate]`:
//! inputs that must compile, and the error each mistake produces.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
