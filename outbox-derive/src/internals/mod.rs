//! Parsing and validation shared by both macros: the input is read into a
//! typed form ([`ast`]) whose attributes come from [`attr`], every mistake is
//! collected in a [`Ctxt`], and [`check`] validates what parsing cannot.

pub mod ast;
pub mod attr;
pub mod check;
mod ctxt;
pub mod symbol;

pub use self::ctxt::Ctxt;
