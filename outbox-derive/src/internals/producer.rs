//! The rules that keep a handler away from Kafka: what the macro rejects in a
//! handler's parameter types and body.
//!
//! The first line of defence is the types (the framework's producer is
//! private to the relay, the handler's first argument is a sealed trait);
//! this is the second: the syntax of the handler, read before the compiler
//! resolves any name. It therefore matches names, as written:
//!
//! - **Parameters**: a type that is or contains (in any generic argument,
//!   reference, tuple or trait object) `FutureProducer`, `BaseProducer`,
//!   `ThreadedProducer`, a path through `rdkafka::producer`, `dyn Producer`,
//!   the relay (`Relay`, `RelayHandle`, `RelayBuilder`) or a `ClientConfig`.
//! - **Body** (closures, async blocks, nested items and the arguments of
//!   macros written as comma-separated expressions included):
//!   - a path or `use` naming `FutureProducer`, `BaseProducer`,
//!     `ThreadedProducer`, `FutureRecord`, `BaseRecord`, or going through
//!     `rdkafka::producer`;
//!   - an associated function of `ClientConfig` (`ClientConfig::new()`);
//!   - `.create()` or `.create_with_context(..)` on a `ClientConfig`
//!     expression: a `ClientConfig::…(..)` call, a method chain starting from
//!     one, or a local variable bound to one (or annotated `ClientConfig`);
//!   - a producer send: `.send_result(..)`; `.send(a, b)` with two arguments
//!     (the shape of `FutureProducer::send`); `.send(..)` whose receiver names,
//!     along its chain of fields, method calls and paths (not their
//!     arguments), an identifier containing `producer` or `kafka` (any
//!     case). Inside the argument of a `spawn`, `spawn_blocking` or
//!     `spawn_local` call (function or method: `tokio::spawn`,
//!     `std::thread::spawn`, `JoinSet::spawn`) the same sends are reported as
//!     publish-after-commit.
//!
//! A one-argument `.send(..)` on any other receiver — `tx.send(v)`,
//! `sender.send(v).await` on a channel — is not reported.

use std::collections::HashSet;

use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{
    Block, Expr, ExprCall, ExprMethodCall, Ident, Local, Macro, Member, Pat, Path, Token, Type,
    TypeImplTrait, TypeParamBound, TypeTraitObject, UseTree,
};

use crate::internals::Ctxt;
use crate::internals::handler::Kind;

/// rdkafka's producers.
const PRODUCERS: &[&str] = &["FutureProducer", "BaseProducer", "ThreadedProducer"];
/// rdkafka's records, which only a producer consumes.
const RECORDS: &[&str] = &["FutureRecord", "BaseRecord"];
/// The relay and its handle and builder.
const RELAY: &[&str] = &["Relay", "RelayHandle", "RelayBuilder"];
/// rdkafka's client configuration, from which any client is created.
const CLIENT_CONFIG: &str = "ClientConfig";
/// The methods that turn a `ClientConfig` into a client.
const CREATE: &[&str] = &["create", "create_with_context"];
/// Functions and methods whose argument runs as a separate task.
const SPAWN: &[&str] = &["spawn", "spawn_blocking", "spawn_local"];

/// Whether the identifiers contain `rdkafka` directly followed by `producer`.
fn through_rdkafka_producer<'a>(idents: impl IntoIterator<Item = &'a Ident>) -> bool {
    let mut previous_is_rdkafka = false;
    for ident in idents {
        if previous_is_rdkafka && ident == "producer" {
            return true;
        }
        previous_is_rdkafka = ident == "rdkafka";
    }
    false
}

fn is_one_of(ident: &Ident, names: &[&str]) -> bool {
    names.iter().any(|name| ident == name)
}

/// What a parameter type reaches.
enum Reach<'a> {
    Producer(&'a Path),
    Relay(&'a Path),
    ClientConfig(&'a Path),
}

/// Reports a parameter whose type reaches a producer; returns whether it did.
/// Only the first offending path of the type is reported.
pub fn check_param(cx: &Ctxt, kind: Kind, ty: &Type) -> bool {
    #[derive(Default)]
    struct Finder<'a> {
        found: Option<Reach<'a>>,
    }

    impl<'a> Finder<'a> {
        fn bounds(&mut self, bounds: &'a Punctuated<TypeParamBound, Token![+]>) {
            for bound in bounds {
                if let TypeParamBound::Trait(bound) = bound {
                    let last = bound.path.segments.last().map(|segment| &segment.ident);
                    if self.found.is_none() && last.is_some_and(|ident| ident == "Producer") {
                        self.found = Some(Reach::Producer(&bound.path));
                    }
                }
            }
        }
    }

    impl<'a> Visit<'a> for Finder<'a> {
        fn visit_path(&mut self, path: &'a Path) {
            if self.found.is_some() {
                return;
            }
            let idents = path.segments.iter().map(|segment| &segment.ident);
            if let Some(last) = path.segments.last().map(|segment| &segment.ident) {
                if through_rdkafka_producer(idents) || is_one_of(last, PRODUCERS) {
                    self.found = Some(Reach::Producer(path));
                } else if is_one_of(last, RELAY) {
                    self.found = Some(Reach::Relay(path));
                } else if last == CLIENT_CONFIG {
                    self.found = Some(Reach::ClientConfig(path));
                }
            }
            if self.found.is_none() {
                visit::visit_path(self, path);
            }
        }

        fn visit_type_trait_object(&mut self, ty: &'a TypeTraitObject) {
            self.bounds(&ty.bounds);
            visit::visit_type_trait_object(self, ty);
        }

        fn visit_type_impl_trait(&mut self, ty: &'a TypeImplTrait) {
            self.bounds(&ty.bounds);
            visit::visit_type_impl_trait(self, ty);
        }
    }

    let mut finder = Finder::default();
    finder.visit_type(ty);
    let (path, what) = match finder.found {
        None => return false,
        Some(Reach::Producer(path)) => (path, "a Kafka producer"),
        Some(Reach::Relay(path)) => (path, "the relay"),
        Some(Reach::ClientConfig(path)) => (path, "a Kafka client configuration"),
    };
    let name = path
        .segments
        .last()
        .map(|segment| segment.ident.to_string())
        .unwrap_or_default();
    cx.error_spanned_by(
        path,
        format!(
            "{} cannot take {what} (`{name}`): {}",
            kind.an_attr(),
            kind.instead(),
        ),
    );
    true
}

/// Reports every way `body` reaches Kafka (see the module docs).
pub fn check_body(cx: &Ctxt, kind: Kind, body: &Block) {
    let mut visitor = Body {
        cx,
        kind,
        spawned: 0,
        configs: HashSet::new(),
        in_create: false,
    };
    visitor.visit_block(body);
}

struct Body<'c> {
    cx: &'c Ctxt,
    kind: Kind,
    /// How many spawned tasks enclose the code being visited.
    spawned: usize,
    /// Local variables holding a `ClientConfig`.
    configs: HashSet<String>,
    /// Whether the receiver of a reported `.create()` is being visited: its
    /// `ClientConfig::new()` is part of the same mistake.
    in_create: bool,
}

impl Body<'_> {
    fn producer(&self, at: impl quote::ToTokens, name: &dyn std::fmt::Display) {
        self.cx.error_spanned_by(
            at,
            format!(
                "{} must not use a Kafka producer (`{name}`): {}",
                self.kind.an_attr(),
                self.kind.instead(),
            ),
        );
    }

    /// Whether `expr` is a `ClientConfig`, as far as the syntax tells.
    fn is_client_config(&self, expr: &Expr) -> bool {
        match expr {
            Expr::Call(call) => match &*call.func {
                Expr::Path(func) => client_config_item(&func.path).is_some(),
                _ => false,
            },
            Expr::MethodCall(call) => self.is_client_config(&call.receiver),
            Expr::Path(path) => path
                .path
                .get_ident()
                .is_some_and(|ident| self.configs.contains(&ident.to_string())),
            Expr::Paren(inner) => self.is_client_config(&inner.expr),
            Expr::Group(inner) => self.is_client_config(&inner.expr),
            Expr::Reference(inner) => self.is_client_config(&inner.expr),
            Expr::Try(inner) => self.is_client_config(&inner.expr),
            _ => false,
        }
    }

    fn send(&self, call: &ExprMethodCall) {
        let method = &call.method;
        let msg = if self.spawned > 0 {
            format!(
                "publish after commit: a task spawned by {} must not send to Kafka \
                 (`.{method}(..)`): it runs outside the transaction, which may still roll back; \
                 {}",
                self.kind.an_attr(),
                self.kind.instead(),
            )
        } else {
            format!(
                "{} must not send to Kafka (`.{method}(..)`): {}",
                self.kind.an_attr(),
                self.kind.instead(),
            )
        };
        self.cx.error_spanned_by(method, msg);
    }

    fn visit_spawned<'a>(&mut self, args: impl IntoIterator<Item = &'a Expr>) {
        self.spawned += 1;
        for arg in args {
            self.visit_expr(arg);
        }
        self.spawned -= 1;
    }
}

/// The item named after `ClientConfig` in `path` (`new` in
/// `rdkafka::ClientConfig::new`), if any.
fn client_config_item(path: &Path) -> Option<&Ident> {
    let mut segments = path.segments.iter();
    segments.find(|segment| segment.ident == CLIENT_CONFIG)?;
    segments.next().map(|segment| &segment.ident)
}

/// Whether a producer send: `.send_result(..)`, `.send(a, b)`, or `.send(..)`
/// on a receiver named like a producer.
fn is_producer_send(call: &ExprMethodCall) -> bool {
    if call.method == "send_result" {
        return true;
    }
    if call.method != "send" {
        return false;
    }
    if call.args.len() == 2 {
        return true;
    }
    let mut names = Vec::new();
    receiver_names(&call.receiver, &mut names);
    names.iter().any(|name| {
        let name = name.to_string().to_ascii_lowercase();
        name.contains("producer") || name.contains("kafka")
    })
}

/// The identifiers along a receiver's chain: paths, fields, method names —
/// not the arguments of calls, nor indices.
fn receiver_names<'a>(expr: &'a Expr, names: &mut Vec<&'a Ident>) {
    match expr {
        Expr::Path(path) => names.extend(path.path.segments.iter().map(|s| &s.ident)),
        Expr::Field(field) => {
            if let Member::Named(ident) = &field.member {
                names.push(ident);
            }
            receiver_names(&field.base, names);
        }
        Expr::MethodCall(call) => {
            names.push(&call.method);
            receiver_names(&call.receiver, names);
        }
        Expr::Call(call) => receiver_names(&call.func, names),
        Expr::Await(inner) => receiver_names(&inner.base, names),
        Expr::Try(inner) => receiver_names(&inner.expr, names),
        Expr::Paren(inner) => receiver_names(&inner.expr, names),
        Expr::Group(inner) => receiver_names(&inner.expr, names),
        Expr::Reference(inner) => receiver_names(&inner.expr, names),
        Expr::Unary(inner) => receiver_names(&inner.expr, names),
        Expr::Index(inner) => receiver_names(&inner.expr, names),
        Expr::Cast(inner) => receiver_names(&inner.expr, names),
        _ => {}
    }
}

/// The identifiers bound by a `let` pattern that is a plain name (possibly
/// annotated), with the annotation.
fn let_binding(pat: &Pat) -> Option<(&Ident, Option<&Type>)> {
    match pat {
        Pat::Ident(pat) => Some((&pat.ident, None)),
        Pat::Type(typed) => match &*typed.pat {
            Pat::Ident(pat) => Some((&pat.ident, Some(&*typed.ty))),
            _ => None,
        },
        _ => None,
    }
}

fn is_client_config_type(ty: &Type) -> bool {
    match ty {
        Type::Path(path) => path
            .path
            .segments
            .last()
            .is_some_and(|segment| segment.ident == CLIENT_CONFIG),
        Type::Reference(reference) => is_client_config_type(&reference.elem),
        Type::Paren(inner) => is_client_config_type(&inner.elem),
        Type::Group(inner) => is_client_config_type(&inner.elem),
        _ => false,
    }
}

impl<'a> Visit<'a> for Body<'_> {
    fn visit_path(&mut self, path: &'a Path) {
        let last = path.segments.last().map(|segment| &segment.ident);
        let idents = path.segments.iter().map(|segment| &segment.ident);
        if let Some(last) = last {
            if through_rdkafka_producer(idents)
                || is_one_of(last, PRODUCERS)
                || is_one_of(last, RECORDS)
            {
                self.producer(path, last);
                return;
            }
        }
        if let Some(item) = client_config_item(path) {
            if self.in_create {
                return;
            }
            self.cx.error_spanned_by(
                path,
                format!(
                    "{} must not build a Kafka client (`ClientConfig::{item}`): {}",
                    self.kind.an_attr(),
                    self.kind.instead(),
                ),
            );
            return;
        }
        visit::visit_path(self, path);
    }

    fn visit_use_tree(&mut self, tree: &'a UseTree) {
        fn walk<'a>(visitor: &Body, tree: &'a UseTree, prefix: &mut Vec<&'a Ident>) {
            match tree {
                UseTree::Path(path) => {
                    prefix.push(&path.ident);
                    if through_rdkafka_producer(prefix.iter().copied()) {
                        visitor.producer(&path.ident, &"rdkafka::producer");
                    } else {
                        walk(visitor, &path.tree, prefix);
                    }
                    prefix.pop();
                }
                UseTree::Name(name) => {
                    if is_one_of(&name.ident, PRODUCERS) || is_one_of(&name.ident, RECORDS) {
                        visitor.producer(&name.ident, &name.ident);
                    }
                }
                UseTree::Rename(rename) => {
                    if is_one_of(&rename.ident, PRODUCERS) || is_one_of(&rename.ident, RECORDS) {
                        visitor.producer(&rename.ident, &rename.ident);
                    }
                }
                UseTree::Glob(_) => {}
                UseTree::Group(group) => {
                    for tree in &group.items {
                        walk(visitor, tree, prefix);
                    }
                }
            }
        }
        walk(self, tree, &mut Vec::new());
    }

    fn visit_local(&mut self, local: &'a Local) {
        if let Some((ident, annotation)) = let_binding(&local.pat) {
            let is_config = annotation.is_some_and(is_client_config_type)
                || local
                    .init
                    .as_ref()
                    .is_some_and(|init| self.is_client_config(&init.expr));
            // Shadowing with anything else forgets the name.
            if is_config {
                self.configs.insert(ident.to_string());
            } else {
                self.configs.remove(&ident.to_string());
            }
        }
        visit::visit_local(self, local);
    }

    fn visit_expr_method_call(&mut self, call: &'a ExprMethodCall) {
        if is_one_of(&call.method, CREATE) && self.is_client_config(&call.receiver) {
            self.cx.error_spanned_by(
                &call.method,
                format!(
                    "{} must not create a Kafka client from a `ClientConfig` (`.{}()`): {}",
                    self.kind.an_attr(),
                    call.method,
                    self.kind.instead(),
                ),
            );
            // The receiver's `ClientConfig::new()` and the turbofish
            // (`create::<FutureProducer>()`) are part of this mistake: not
            // reported again.
            let in_create = std::mem::replace(&mut self.in_create, true);
            self.visit_expr(&call.receiver);
            self.in_create = in_create;
            for arg in &call.args {
                self.visit_expr(arg);
            }
            return;
        }
        if is_one_of(&call.method, SPAWN) {
            self.visit_expr(&call.receiver);
            self.visit_spawned(&call.args);
            return;
        }
        if is_producer_send(call) {
            self.send(call);
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_call(&mut self, call: &'a ExprCall) {
        if let Expr::Path(func) = &*call.func {
            if func
                .path
                .segments
                .last()
                .is_some_and(|segment| is_one_of(&segment.ident, SPAWN))
            {
                self.visit_expr(&call.func);
                self.visit_spawned(&call.args);
                return;
            }
        }
        visit::visit_expr_call(self, call);
    }

    fn visit_macro(&mut self, mac: &'a Macro) {
        self.visit_path(&mac.path);
        // Macros whose input is a list of expressions (`format!`, `vec!`,
        // `tokio::join!`, `sqlx::query!`) are inspected; others are opaque.
        if let Ok(exprs) = mac.parse_body_with(Punctuated::<Expr, Token![,]>::parse_terminated) {
            for expr in &exprs {
                self.visit_expr(expr);
            }
        }
    }
}
