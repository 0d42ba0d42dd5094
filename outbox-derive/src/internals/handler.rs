//! The typed form of a function under `#[inbox_handler]` or
//! `#[command_handler]`: which attribute, its arguments, and the function's
//! two parameters once the signature has been found to have them.

use proc_macro2::TokenStream;
use quote::quote;
use syn::ext::IdentExt;
use syn::{FnArg, Ident, ItemFn, Pat, PatType, ReturnType, Type};

use crate::internals::symbol::{COMMAND_HANDLER, INBOX_HANDLER, Symbol};
use crate::internals::{Ctxt, attr};

/// Which handler attribute is being expanded.
#[derive(Copy, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `#[inbox_handler]`: consumes one event type inside the consumer's
    /// transaction.
    Inbox,
    /// `#[command_handler]`: applies one command inside a Unit of Work.
    Command,
}

impl Kind {
    /// The attribute's name.
    pub fn symbol(self) -> Symbol {
        match self {
            Kind::Inbox => INBOX_HANDLER,
            Kind::Command => COMMAND_HANDLER,
        }
    }

    /// The attribute as written, for messages: `` `#[inbox_handler]` ``.
    pub fn attr(self) -> String {
        format!("`#[{}]`", self.symbol())
    }

    /// The attribute with its article, for messages:
    /// "an `#[inbox_handler]`".
    pub fn an_attr(self) -> String {
        match self {
            Kind::Inbox => format!("an {}", self.attr()),
            Kind::Command => format!("a {}", self.attr()),
        }
    }

    /// The expected parameter list, for messages.
    pub fn params(self) -> &'static str {
        match self {
            Kind::Inbox => "`(ctx: &mut HandlerContext<'_>, event: YourEvent)`",
            Kind::Command => "`(uow: &mut UnitOfWork, command: YourCommand)`",
        }
    }

    /// What the second parameter is.
    pub fn input(self) -> &'static str {
        match self {
            Kind::Inbox => "event",
            Kind::Command => "command",
        }
    }

    /// The expected return type, for messages.
    pub fn returns(self) -> &'static str {
        match self {
            Kind::Inbox => "`Result<(), E>`",
            Kind::Command => "`Result<T, E>`",
        }
    }

    /// What to do instead of reaching Kafka from a handler.
    pub fn instead(self) -> &'static str {
        match self {
            Kind::Inbox => {
                "record the event on the handler context (`ctx.record(event)`); the relay \
                 publishes it once the transaction commits"
            }
            Kind::Command => {
                "record the event on the Unit of Work (`uow.record(event)`); the relay \
                 publishes it once the transaction commits"
            }
        }
    }

    /// What the runner holds and lends to the handler's first argument.
    pub fn source(self) -> TokenStream {
        match self {
            Kind::Inbox => quote!(::outbox::__private::HandlerContext<'_>),
            Kind::Command => quote!(::outbox::__private::UnitOfWork),
        }
    }
}

/// A handler function.
pub struct Handler<'a> {
    /// Which attribute.
    pub kind: Kind,
    /// The attribute's arguments.
    pub attrs: attr::Handler,
    /// The function as written.
    pub item: &'a ItemFn,
}

/// One typed parameter of a handler function.
pub struct Param<'a> {
    /// The parameter as written.
    pub arg: &'a PatType,
    /// Its name, if the pattern is a plain identifier.
    pub ident: Option<&'a Ident>,
    /// Its type.
    pub ty: &'a Type,
}

impl<'a> Handler<'a> {
    /// Reads the attribute's arguments; the function is validated by
    /// [`signature::check`](super::signature::check).
    pub fn from_ast(cx: &Ctxt, kind: Kind, args: TokenStream, item: &'a ItemFn) -> Self {
        Handler {
            kind,
            attrs: attr::Handler::from_args(cx, kind.symbol(), args),
            item,
        }
    }

    /// The function's name, which the generated type takes.
    pub fn ident(&self) -> &'a Ident {
        &self.item.sig.ident
    }

    /// The handler's name: `name = "..."`, or else the function's name.
    pub fn name(&self) -> String {
        match &self.attrs.name {
            Some(lit) => lit.value(),
            None => self.ident().unraw().to_string(),
        }
    }

    /// The typed parameters (a `self` receiver is not one).
    pub fn params(&self) -> impl Iterator<Item = Param<'a>> + 'a {
        self.item.sig.inputs.iter().filter_map(|arg| match arg {
            FnArg::Typed(arg) => Some(Param {
                arg,
                ident: match &*arg.pat {
                    Pat::Ident(pat) if pat.by_ref.is_none() && pat.subpat.is_none() => {
                        Some(&pat.ident)
                    }
                    _ => None,
                },
                ty: &arg.ty,
            }),
            FnArg::Receiver(_) => None,
        })
    }

    /// The first two parameters: the context (or Unit of Work) and the event
    /// (or command). `None` when there are fewer.
    pub fn context_and_input(&self) -> Option<(Param<'a>, Param<'a>)> {
        let mut params = self.params();
        Some((params.next()?, params.next()?))
    }

    /// The declared return type (`None` for a function returning `()`
    /// implicitly).
    pub fn output(&self) -> Option<&'a Type> {
        match &self.item.sig.output {
            ReturnType::Default => None,
            ReturnType::Type(_, ty) => Some(ty),
        }
    }
}
