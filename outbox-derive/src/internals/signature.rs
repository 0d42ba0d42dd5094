//! The rules on a handler function's signature that the macro can see in the
//! syntax: an `async fn`, free (no `self`), not generic, two parameters with
//! plain names, the event or command taken by value, and a declared return
//! type.
//!
//! The rules on types are left to the compiler, through traits with
//! `#[diagnostic::on_unimplemented]` messages: the first argument must be a
//! `HandlerArg` (`&mut HandlerContext<'_>` or `&mut UnitOfWork`), an event a
//! `DomainEvent`, the return type an `InboxOutput` or `CommandOutput`. Those
//! see through imports and type aliases, which the syntax cannot.

use syn::visit::{self, Visit};
use syn::{FnArg, Type, TypeImplTrait};

use crate::internals::Ctxt;
use crate::internals::handler::{Handler, Kind, Param};

/// Checks the signature of `handler`. `producer_params` tells, per typed
/// parameter, whether it was already reported for reaching a producer: an
/// extra parameter reported that way is not reported again as extra.
pub fn check(cx: &Ctxt, handler: &Handler, producer_params: &[bool]) {
    let kind = handler.kind;
    let sig = &handler.item.sig;

    if let Some(constness) = &sig.constness {
        cx.error_spanned_by(constness, format!("{} cannot be `const`", kind.an_attr()));
    }
    if let Some(unsafety) = &sig.unsafety {
        cx.error_spanned_by(unsafety, format!("{} cannot be `unsafe`", kind.an_attr()));
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(abi, format!("{} cannot be `extern`", kind.an_attr()));
    }
    if sig.asyncness.is_none() {
        cx.error_spanned_by(
            sig.fn_token,
            format!(
                "{} must be an `async fn`: `async fn {}{} -> {}`",
                kind.an_attr(),
                sig.ident,
                unticked(kind.params()),
                unticked(kind.returns()),
            ),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error_spanned_by(
            &sig.generics,
            format!(
                "{} cannot be generic: it handles one {} type; leave lifetimes elided \
                 (`&mut {}`)",
                kind.an_attr(),
                kind.input(),
                match kind {
                    Kind::Inbox => "HandlerContext<'_>",
                    Kind::Command => "UnitOfWork",
                },
            ),
        );
    }

    for arg in &sig.inputs {
        if let FnArg::Receiver(receiver) = arg {
            cx.error_spanned_by(
                receiver,
                format!(
                    "{} is a free function, not a method: remove `self`; it takes {}",
                    kind.an_attr(),
                    kind.params(),
                ),
            );
        }
    }

    let params: Vec<Param> = handler.params().collect();
    check_arity(cx, handler, &params, producer_params);
    for param in &params {
        check_param(cx, kind, param);
    }
    if let Some(input) = params.get(1)
        && let Type::Reference(reference) = input.ty
    {
        cx.error_spanned_by(
            reference.and_token,
            format!(
                "{} takes the {} by value: remove the `&`",
                kind.an_attr(),
                kind.input(),
            ),
        );
    }

    check_output(cx, handler);
}

fn check_arity(cx: &Ctxt, handler: &Handler, params: &[Param], producer_params: &[bool]) {
    let kind = handler.kind;
    let sig = &handler.item.sig;
    let expected = format!("{} takes two arguments, {}", kind.an_attr(), kind.params());
    match params.len() {
        0 | 1 => cx.error_at(
            sig.paren_token.span.join(),
            format!("{expected}; found {}", params.len()),
        ),
        2 => {}
        _ => {
            let already_reported = producer_params.get(2..).unwrap_or_default();
            if already_reported.iter().all(|reported| *reported) {
                return;
            }
            let extra: Vec<_> = params[2..].iter().map(|param| param.arg).collect();
            cx.error_spanned_by(
                quote::quote!(#(#extra),*),
                format!("{expected}; remove the others"),
            );
        }
    }
}

/// Names, not patterns; no `impl Trait`.
fn check_param(cx: &Ctxt, kind: Kind, param: &Param) {
    if param.ident.is_none() {
        cx.error_spanned_by(
            &param.arg.pat,
            format!(
                "{} takes plain argument names (`{}`, `_ctx`): destructure inside the body",
                kind.an_attr(),
                kind.input(),
            ),
        );
    }

    struct ImplTraits<'a>(Vec<&'a TypeImplTrait>);
    impl<'a> Visit<'a> for ImplTraits<'a> {
        fn visit_type_impl_trait(&mut self, ty: &'a TypeImplTrait) {
            self.0.push(ty);
            visit::visit_type_impl_trait(self, ty);
        }
    }
    let mut found = ImplTraits(Vec::new());
    found.visit_type(param.ty);
    for ty in found.0 {
        cx.error_spanned_by(
            ty,
            format!(
                "`impl Trait` makes {} generic: name the type (it handles one {} type)",
                kind.an_attr(),
                kind.input(),
            ),
        );
    }
}

/// A return type must be written; whether it is the right `Result` is left
/// to the compiler (`InboxOutput` / `CommandOutput`), which sees aliases.
fn check_output(cx: &Ctxt, handler: &Handler) {
    let kind = handler.kind;
    match handler.output() {
        None => cx.error_at(
            handler.item.sig.paren_token.span.close(),
            format!(
                "{} must return {}: add `-> {}`",
                kind.an_attr(),
                kind.returns(),
                unticked(kind.returns()),
            ),
        ),
        Some(Type::Path(_) | Type::Group(_) | Type::Paren(_) | Type::Macro(_)) => {}
        Some(ty) => cx.error_spanned_by(
            ty,
            format!("{} must return {}", kind.an_attr(), kind.returns()),
        ),
    }
}

fn unticked(s: &str) -> &str {
    s.trim_matches('`')
}
