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
//!   The last two are common words: they count when written bare (imported)
//!   or through `outbox`/`outbox_runtime` and `rdkafka` respectively, not
//!   through another crate or module (`rustls::ClientConfig`).
//! - **Body** (closures, async blocks, nested items and the arguments of
//!   macros written as comma-separated expressions included):
//!   - a path or `use` naming `FutureProducer`, `BaseProducer`,
//!     `ThreadedProducer`, `FutureRecord`, `BaseRecord`, or going through
//!     `rdkafka::producer`;
//!   - rdkafka's `ClientConfig` constructed: `ClientConfig::new()` or
//!     `ClientConfig::default()`, or any associated function through
//!     `rdkafka::` (another crate's `ClientConfig`, such as
//!     `rustls::ClientConfig::builder()`, is not reported);
//!   - `.create()` or `.create_with_context(..)` on a `ClientConfig`
//!     expression: such a constructor call, a method chain starting from one,
//!     or a local variable bound to one (or annotated `ClientConfig`);
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

/// Whether a path naming a common word (`Relay`, `ClientConfig`) means the
/// crate's item: written bare (imported), or through one of `crates`. Another
/// crate's item of the same name (`rustls::ClientConfig`,
/// `domain::Relay`) is left alone.
fn is_ours(path: &Path, crates: &[&str]) -> bool {
    path.segments.len() == 1
        || path
            .segments
            .iter()
            .any(|segment| is_one_of(&segment.ident, crates))
}

/// The producer item a path names, if any: the first segment among `names`
/// (`FutureProducer` in `FutureProducer::from_config`), or else, for a path
/// through `rdkafka::producer`, the item after it (`Producer` in
/// `rdkafka::producer::Producer::flush`).
fn producer_name(path: &Path, names: &[&str]) -> Option<String> {
    let idents: Vec<&Ident> = path.segments.iter().map(|segment| &segment.ident).collect();
    if let Some(ident) = idents.iter().find(|ident| is_one_of(ident, names)) {
        return Some(ident.to_string());
    }
    let at = idents
        .windows(2)
        .position(|pair| pair[0] == "rdkafka" && pair[1] == "producer")?;
    Some(match idents.get(at + 2) {
        Some(item) => item.to_string(),
        None => "rdkafka::producer".to_owned(),
    })
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
            if let Some(last) = path.segments.last().map(|segment| &segment.ident) {
                if producer_name(path, PRODUCERS).is_some() {
                    self.found = Some(Reach::Producer(path));
                } else if is_one_of(last, RELAY) && is_ours(path, &["outbox", "outbox_runtime"]) {
                    self.found = Some(Reach::Relay(path));
                } else if last == CLIENT_CONFIG && is_ours(path, &["rdkafka"]) {
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
    let name = producer_name(path, PRODUCERS).unwrap_or_else(|| {
        path.segments
            .last()
            .map(|segment| segment.ident.to_string())
            .unwrap_or_default()
    });
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
                "{} must not use the Kafka producer API (`{name}`): {}",
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

/// The item named after rdkafka's `ClientConfig` in `path`: any item through
/// `rdkafka` (`rdkafka::ClientConfig::new`, `rdkafka::config::ClientConfig::
/// default`), or `new` / `default` on a bare `ClientConfig` (imported).
/// Another crate's `ClientConfig` (`rustls::ClientConfig::builder()`) is left
/// alone.
fn client_config_item(path: &Path) -> Option<&Ident> {
    let idents: Vec<&Ident> = path.segments.iter().map(|segment| &segment.ident).collect();
    let at = idents.iter().position(|ident| *ident == CLIENT_CONFIG)?;
    let item = *idents.get(at + 1)?;
    let through_rdkafka = idents[..at].iter().any(|ident| *ident == "rdkafka");
    let bare_constructor = at == 0 && (item == "new" || item == "default");
    (through_rdkafka || bare_constructor).then_some(item)
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
        Type::Path(path) => {
            path.path
                .segments
                .last()
                .is_some_and(|segment| segment.ident == CLIENT_CONFIG)
                && is_ours(&path.path, &["rdkafka"])
        }
        Type::Reference(reference) => is_client_config_type(&reference.elem),
        Type::Paren(inner) => is_client_config_type(&inner.elem),
        Type::Group(inner) => is_client_config_type(&inner.elem),
        _ => false,
    }
}

impl<'a> Visit<'a> for Body<'_> {
    fn visit_path(&mut self, path: &'a Path) {
        if let Some(name) = producer_name(path, &[PRODUCERS, RECORDS].concat()) {
            self.producer(path, &name);
            return;
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
        if let Expr::Path(func) = &*call.func
            && func
                .path
                .segments
                .last()
                .is_some_and(|segment| is_one_of(&segment.ident, SPAWN))
        {
            self.visit_expr(&call.func);
            self.visit_spawned(&call.args);
            return;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(cx: Ctxt) -> Vec<String> {
        match cx.check() {
            Ok(()) => Vec::new(),
            Err(err) => err.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    fn body(src: &str) -> Vec<String> {
        let block: Block = syn::parse_str(src).unwrap();
        let cx = Ctxt::new();
        check_body(&cx, Kind::Command, &block);
        errors(cx)
    }

    fn param(src: &str) -> Vec<String> {
        let ty: Type = syn::parse_str(src).unwrap();
        let cx = Ctxt::new();
        let reported = check_param(&cx, Kind::Inbox, &ty);
        let errors = errors(cx);
        assert_eq!(reported, !errors.is_empty(), "{src}");
        errors
    }

    #[track_caller]
    fn assert_count(errors: Vec<String>, n: usize) {
        assert_eq!(errors.len(), n, "{errors:#?}");
    }

    #[test]
    fn channel_sends_pass() {
        assert_count(
            body(
                "{ tx.send(v).await?; sender.send(1); self.events.send(e); \
                 tokio::spawn(async move { tx.send(v).await }); \
                 std::thread::spawn(move || done.send(())); }",
            ),
            0,
        );
        // Arguments and indices along the receiver are not its name.
        assert_count(
            body("{ map.get(&producer_id).send(x); senders[kafka_index].send(x); }"),
            0,
        );
    }

    #[test]
    fn producer_sends_fail() {
        for src in [
            "{ anything.send(record, timeout) }",
            "{ anything.send_result(record) }",
            "{ producer.send(record) }",
            "{ state.kafka.send(record) }",
            "{ PRODUCER.get().unwrap().send(record) }",
            "{ kafka_producer().send(record) }",
            "{ (&*self.producer).send(record) }",
        ] {
            let errors = body(src);
            assert_count(errors.clone(), 1);
            assert!(errors[0].contains("must not send to Kafka"), "{src}");
        }
    }

    #[test]
    fn sends_in_spawned_tasks_are_publish_after_commit() {
        for src in [
            "{ tokio::spawn(async move { producer.send(r).await }); }",
            "{ tokio::task::spawn_blocking(move || kafka().send(r, t)); }",
            "{ std::thread::spawn(|| p.send_result(r)); }",
            "{ set.spawn(async { x.send(r, t).await }); }",
            "{ spawn_local(async { producer.send(r) }); }",
        ] {
            let errors = body(src);
            assert_count(errors.clone(), 1);
            assert!(errors[0].starts_with("publish after commit"), "{src}");
        }
    }

    #[test]
    fn client_configs() {
        assert_count(body("{ let c = ClientConfig::new(); }"), 1);
        assert_count(body("{ let c = rdkafka::ClientConfig::default(); }"), 1);
        assert_count(
            body("{ let c = rdkafka::config::ClientConfig::from_iter(v); }"),
            1,
        );
        // Another crate's.
        assert_count(body("{ let c = rustls::ClientConfig::builder(); }"), 0);
        assert_count(body("{ let c = ClientConfig::builder(); }"), 0);
        // One mistake, one error: the constructor is part of the `.create()`.
        let chained = body("{ let p: P = ClientConfig::new().set(\"a\", \"b\").create()?; }");
        assert_count(chained.clone(), 1);
        assert!(chained[0].contains("`.create()`"));
        // Through a variable: the constructor and the creation.
        assert_count(
            body("{ let mut c = ClientConfig::new(); c.set(\"a\", \"b\"); c.create() }"),
            2,
        );
        assert_count(
            body("{ let c: &ClientConfig = settings(); c.create_with_context(x) }"),
            1,
        );
        // Shadowed by something else.
        assert_count(
            body("{ let c: &ClientConfig = settings(); let c = other(); c.create() }"),
            0,
        );
        // `create` on anything else.
        assert_count(
            body("{ let c = make(); c.create(); Config::new().create() }"),
            0,
        );
    }

    #[test]
    fn producer_names_and_imports() {
        assert_count(body("{ let p: Option<FutureProducer> = None; }"), 1);
        assert_count(body("{ let r = BaseRecord::to(\"t\"); }"), 1);
        assert_count(body("{ rdkafka::producer::Producer::flush(&p, t); }"), 1);
        assert_count(body("{ use rdkafka::producer::*; }"), 1);
        assert_count(
            body("{ use rdkafka::{producer::{FutureRecord, Producer}, ClientConfig}; }"),
            1,
        );
        assert_count(body("{ use other::FutureRecord as Record; }"), 1);
        assert_count(
            body("{ use rdkafka::ClientConfig; use rdkafka::message::Message; }"),
            0,
        );
        // A nested function of the body is the handler's code too.
        assert_count(body("{ fn helper(p: &FutureProducer) {} }"), 1);
    }

    #[test]
    fn macros_of_expressions_are_inspected() {
        assert_count(body("{ println!(\"{:?}\", producer.send(r, t)); }"), 1);
        assert_count(body("{ tokio::join!(kafka.send(r), other); }"), 1);
        // Not a list of expressions: opaque.
        assert_count(
            body("{ tokio::select! { _ = producer.send(r, t) => {} } }"),
            0,
        );
    }

    #[test]
    fn parameters() {
        for src in [
            "&FutureProducer",
            "Arc<Mutex<Option<rdkafka::producer::BaseProducer>>>",
            "ThreadedProducer<DefaultProducerContext>",
            "rdkafka::producer::future_producer::FutureProducer",
            "Box<dyn Producer>",
            "&RelayHandle",
            "outbox::runtime::Relay",
            "outbox_runtime::RelayBuilder",
            "ClientConfig",
            "&rdkafka::config::ClientConfig",
        ] {
            assert_count(param(src), 1);
        }
        // The first offending path only.
        assert_count(param("(FutureProducer, BaseProducer)"), 1);
        for src in [
            "&mut HandlerContext<'_>",
            "&mut UnitOfWork",
            "OrderCreated",
            "domain::Relay",
            "rustls::ClientConfig",
            "Arc<rustls::ClientConfig>",
            "ProducerRegistered",
        ] {
            assert_count(param(src), 0);
        }
    }
}
