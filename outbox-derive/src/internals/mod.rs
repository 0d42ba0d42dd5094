//! Parsing and validation shared by the macros: the input is read into a
//! typed form ([`ast`] for `#[derive(DomainEvent)]`, [`handler`] for the
//! handler attributes) whose attributes come from [`attr`], every mistake is
//! collected in a [`Ctxt`], and [`check`], [`signature`] and [`producer`]
//! validate what parsing cannot.

pub mod ast;
pub mod attr;
pub mod check;
mod ctxt;
pub mod handler;
pub mod producer;
pub mod saga;
pub mod signature;
pub mod symbol;

pub use self::ctxt::Ctxt;
