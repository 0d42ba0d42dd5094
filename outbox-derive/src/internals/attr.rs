//! Parsing of `#[event(...)]` (on a container, a variant, a field) and of the
//! arguments of `#[aggregate(...)]`, `#[inbox_handler(...)]` and
//! `#[command_handler(...)]`.
//!
//! Nothing here returns an error: unknown keys, duplicate keys and values of
//! the wrong kind are recorded in the [`Ctxt`] and the key is skipped, so every
//! mistake in the input is reported in one compilation.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

use crate::internals::Ctxt;
use crate::internals::check;
use crate::internals::symbol::{
    AGGREGATE, AGGREGATE_ID, AGGREGATE_TYPE, EVENT, EVENT_ID, EVENT_TYPE, NAME, PARTITION_KEY,
    ROOT, Symbol, TOPIC, UPCAST_FROM, VERSION,
};

/// One key of an attribute, written at most once.
struct Attr<'c, T> {
    cx: &'c Ctxt,
    attr: Symbol,
    name: Symbol,
    written: bool,
    value: Option<T>,
}

impl<'c, T> Attr<'c, T> {
    fn none(cx: &'c Ctxt, attr: Symbol, name: Symbol) -> Self {
        Attr {
            cx,
            attr,
            name,
            written: false,
            value: None,
        }
    }

    /// Records the key, written at `obj`, with its value (`None` when the
    /// value was invalid and already reported). A second occurrence is
    /// reported as a duplicate on `obj`.
    fn set<A: ToTokens>(&mut self, obj: A, value: Option<T>) {
        if self.written {
            let msg = format!("duplicate {} attribute `{}`", self.attr, self.name);
            self.cx.error_spanned_by(obj, msg);
        } else {
            self.written = true;
            self.value = value;
        }
    }

    /// Whether the key was written, valid or not.
    fn written(&self) -> bool {
        self.written
    }

    fn get(self) -> Option<T> {
        self.value
    }
}

/// `#[event(...)]` on the struct or enum.
pub struct Container {
    /// `topic = "..."`.
    pub topic: Option<LitStr>,
    /// Whether `topic` was written, valid or not: only a topic left out is
    /// reported as missing.
    pub topic_written: bool,
    /// `aggregate_type = "..."`.
    pub aggregate_type: Option<LitStr>,
    /// `event_type = "..."`, with its key (an enum rejects it there).
    pub event_type: Option<(Path, LitStr)>,
    /// `version = N`, checked to be in `1..=i32::MAX`.
    pub version: Option<u32>,
    /// `upcast_from(Type)`, with its key (for spans).
    pub upcast_from: Option<(Path, syn::Type)>,
}

const CONTAINER_KEYS: &[Symbol] = &[TOPIC, AGGREGATE_TYPE, EVENT_TYPE, VERSION, UPCAST_FROM];

impl Container {
    /// Reads every `#[event(...)]` among `attrs`.
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut topic = Attr::none(cx, EVENT, TOPIC);
        let mut aggregate_type = Attr::none(cx, EVENT, AGGREGATE_TYPE);
        let mut event_type = Attr::none(cx, EVENT, EVENT_TYPE);
        let mut version = Attr::none(cx, EVENT, VERSION);
        let mut upcast_from = Attr::none(cx, EVENT, UPCAST_FROM);

        for_each_key(cx, attrs, |meta| {
            if meta.path == TOPIC {
                let value = get_lit_str(cx, TOPIC, meta)?;
                topic.set(&meta.path, value);
            } else if meta.path == AGGREGATE_TYPE {
                let value = get_lit_str(cx, AGGREGATE_TYPE, meta)?;
                aggregate_type.set(&meta.path, value);
            } else if meta.path == EVENT_TYPE {
                let value = get_lit_str(cx, EVENT_TYPE, meta)?;
                event_type.set(&meta.path, value.map(|lit| (meta.path.clone(), lit)));
            } else if meta.path == VERSION {
                let value = get_version(cx, meta)?;
                version.set(&meta.path, value);
            } else if meta.path == UPCAST_FROM {
                let value = get_type(cx, UPCAST_FROM, meta)?;
                upcast_from.set(&meta.path, value.map(|ty| (meta.path.clone(), ty)));
            } else {
                unknown_key(cx, EVENT, meta, CONTAINER_KEYS)?;
            }
            Ok(())
        });

        Container {
            topic_written: topic.written(),
            topic: topic.get(),
            aggregate_type: aggregate_type.get(),
            event_type: event_type.get(),
            version: version.get(),
            upcast_from: upcast_from.get(),
        }
    }
}

/// `#[event(...)]` on an enum variant.
pub struct Variant {
    /// `event_type = "..."`.
    pub event_type: Option<LitStr>,
    /// `version = N`, checked to be in `1..=i32::MAX`.
    pub version: Option<u32>,
}

const VARIANT_KEYS: &[Symbol] = &[EVENT_TYPE, VERSION];

impl Variant {
    /// Reads every `#[event(...)]` among `attrs`.
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut event_type = Attr::none(cx, EVENT, EVENT_TYPE);
        let mut version = Attr::none(cx, EVENT, VERSION);

        for_each_key(cx, attrs, |meta| {
            if meta.path == EVENT_TYPE {
                let value = get_lit_str(cx, EVENT_TYPE, meta)?;
                event_type.set(&meta.path, value);
            } else if meta.path == VERSION {
                let value = get_version(cx, meta)?;
                version.set(&meta.path, value);
            } else {
                unknown_key(cx, EVENT, meta, VARIANT_KEYS)?;
            }
            Ok(())
        });

        Variant {
            event_type: event_type.get(),
            version: version.get(),
        }
    }
}

/// `#[event(...)]` on a field: the roles it plays, each with the key that
/// declared it (for spans).
pub struct Field {
    /// `aggregate_id`.
    pub aggregate_id: Option<Path>,
    /// `partition_key`.
    pub partition_key: Option<Path>,
    /// `event_id`.
    pub event_id: Option<Path>,
}

const FIELD_KEYS: &[Symbol] = &[AGGREGATE_ID, PARTITION_KEY, EVENT_ID];

impl Field {
    /// Reads every `#[event(...)]` among `attrs`.
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut aggregate_id = Attr::none(cx, EVENT, AGGREGATE_ID);
        let mut partition_key = Attr::none(cx, EVENT, PARTITION_KEY);
        let mut event_id = Attr::none(cx, EVENT, EVENT_ID);

        for_each_key(cx, attrs, |meta| {
            let flag = if meta.path == AGGREGATE_ID {
                &mut aggregate_id
            } else if meta.path == PARTITION_KEY {
                &mut partition_key
            } else if meta.path == EVENT_ID {
                &mut event_id
            } else {
                return unknown_key(cx, EVENT, meta, FIELD_KEYS);
            };
            // A flag written with a value is reported, and still plays its
            // role: the intent is clear.
            no_value(cx, flag.name, meta)?;
            flag.set(&meta.path, Some(meta.path.clone()));
            Ok(())
        });

        Field {
            aggregate_id: aggregate_id.get(),
            partition_key: partition_key.get(),
            event_id: event_id.get(),
        }
    }
}

/// The arguments of `#[aggregate(...)]`.
pub struct Aggregate {
    /// `root = Name`.
    pub root: Option<Ident>,
}

const AGGREGATE_KEYS: &[Symbol] = &[ROOT];

impl Aggregate {
    /// Parses the attribute's arguments (empty for a bare `#[aggregate]`).
    pub fn from_args(cx: &Ctxt, args: TokenStream) -> Self {
        let mut root = Attr::none(cx, AGGREGATE, ROOT);

        let parser = syn::meta::parser(|meta| {
            if meta.path == ROOT {
                let value = get_root(cx, &meta)?;
                root.set(&meta.path, value);
                Ok(())
            } else {
                unknown_key(cx, AGGREGATE, &meta, AGGREGATE_KEYS)
            }
        });
        if let Err(err) = parser.parse2(args) {
            cx.syn_error(err);
        }

        Aggregate { root: root.get() }
    }
}

/// The arguments of `#[inbox_handler(...)]` or `#[command_handler(...)]`.
pub struct Handler {
    /// `name = "..."`: the handler's name in logs and dead letters.
    pub name: Option<LitStr>,
}

const HANDLER_KEYS: &[Symbol] = &[NAME];

impl Handler {
    /// Parses the arguments of the attribute `attr` (empty for a bare
    /// `#[inbox_handler]`).
    pub fn from_args(cx: &Ctxt, attr: Symbol, args: TokenStream) -> Self {
        let mut name = Attr::none(cx, attr, NAME);

        let parser = syn::meta::parser(|meta| {
            if meta.path == NAME {
                let value = get_handler_name(cx, attr, &meta)?;
                name.set(&meta.path, value);
                Ok(())
            } else {
                unknown_key(cx, attr, &meta, HANDLER_KEYS)
            }
        });
        if let Err(err) = parser.parse2(args) {
            cx.syn_error(err);
        }

        Handler { name: name.get() }
    }
}

/// `name = "..."`, not empty.
fn get_handler_name(
    cx: &Ctxt,
    attr: Symbol,
    meta: &ParseNestedMeta,
) -> syn::Result<Option<LitStr>> {
    let syntax = || format!("#[{attr}({NAME} = \"...\")]");
    match get_value(cx, meta, syntax)? {
        Some(Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        })) if lit.value().trim().is_empty() => {
            cx.error_spanned_by(&lit, format!("`{NAME}` must not be empty"));
            Ok(None)
        }
        Some(Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        })) => Ok(Some(lit)),
        Some(other) => {
            let msg = format!("`{NAME}` must be a string literal: `{}`", syntax());
            cx.error_spanned_by(other, msg);
            Ok(None)
        }
        None => Ok(None),
    }
}

/// Runs `f` on each key of each `#[event(...)]` attribute. `f` reports what
/// it can to `cx` and returns `Err` only when the tokens cannot be parsed any
/// further.
fn for_each_key(
    cx: &Ctxt,
    attrs: &[syn::Attribute],
    mut f: impl FnMut(&ParseNestedMeta) -> syn::Result<()>,
) {
    for attr in attrs {
        if attr.path() != EVENT {
            continue;
        }
        if let Err(err) = attr.parse_nested_meta(|meta| f(&meta)) {
            cx.syn_error(err);
        }
    }
}

/// Reports an unknown key and skips its value, if any.
pub(crate) fn unknown_key(
    cx: &Ctxt,
    attr: Symbol,
    meta: &ParseNestedMeta,
    expected: &[Symbol],
) -> syn::Result<()> {
    let key = meta.path.to_token_stream().to_string().replace(' ', "");
    let expected = match expected {
        [only] => format!("`{only}`"),
        _ => {
            let names: Vec<String> = expected.iter().map(|name| format!("`{name}`")).collect();
            format!("one of {}", names.join(", "))
        }
    };
    cx.error_spanned_by(
        &meta.path,
        format!("unknown {attr} attribute `{key}`; expected {expected}"),
    );
    skip_value(meta)
}

/// Consumes `= value` or `(...)` after a key, if present.
fn skip_value(meta: &ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(Token![=]) {
        meta.value()?.parse::<Expr>()?;
    } else if meta.input.peek(syn::token::Paren) {
        meta.input.parse::<proc_macro2::Group>()?;
    }
    Ok(())
}

/// The value of `key = value`, or `None` (reported) when the key has no `=`.
pub(crate) fn get_value(
    cx: &Ctxt,
    meta: &ParseNestedMeta,
    syntax: impl FnOnce() -> String,
) -> syn::Result<Option<Expr>> {
    if meta.input.peek(Token![=]) {
        let expr: Expr = meta.value()?.parse()?;
        Ok(Some(ungroup(expr)))
    } else {
        cx.error_spanned_by(&meta.path, format!("expected `{}`", syntax()));
        skip_value(meta)?;
        Ok(None)
    }
}

/// `key = "..."`.
fn get_lit_str(cx: &Ctxt, key: Symbol, meta: &ParseNestedMeta) -> syn::Result<Option<LitStr>> {
    let syntax = || format!("#[event({key} = \"...\")]");
    match get_value(cx, meta, syntax)? {
        Some(Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        })) => Ok(Some(lit)),
        Some(other) => {
            let msg = format!("`{key}` must be a string literal: `{}`", syntax());
            cx.error_spanned_by(other, msg);
            Ok(None)
        }
        None => Ok(None),
    }
}

/// `key(Type)`.
fn get_type(cx: &Ctxt, key: Symbol, meta: &ParseNestedMeta) -> syn::Result<Option<syn::Type>> {
    if meta.input.peek(syn::token::Paren) {
        let content;
        syn::parenthesized!(content in meta.input);
        let ty: syn::Type = content.parse()?;
        if !content.is_empty() {
            let msg = format!("`{key}` takes one type: `#[event({key}(OrderPlacedV1))]`");
            cx.error_spanned_by(content.parse::<TokenStream>()?, msg);
        }
        Ok(Some(ty))
    } else {
        let msg = format!(
            "expected `#[event({key}(OrderPlacedV1))]`: the struct of the previous version"
        );
        cx.error_spanned_by(&meta.path, msg);
        skip_value(meta)?;
        Ok(None)
    }
}

/// `version = N`, `N` in `1..=i32::MAX`.
fn get_version(cx: &Ctxt, meta: &ParseNestedMeta) -> syn::Result<Option<u32>> {
    let syntax = || format!("#[event({VERSION} = 2)]");
    match get_value(cx, meta, syntax)? {
        Some(Expr::Lit(ExprLit {
            lit: Lit::Int(lit), ..
        })) => match check::event_version(&lit) {
            Ok(value) => Ok(Some(value)),
            Err(msg) => {
                cx.error_spanned_by(&lit, msg);
                Ok(None)
            }
        },
        Some(other) => {
            let msg = format!(
                "`{VERSION}` must be an integer literal of at least 1: `{}`",
                syntax()
            );
            cx.error_spanned_by(other, msg);
            Ok(None)
        }
        None => Ok(None),
    }
}

/// A flag: reports and skips a value following the key.
fn no_value(cx: &Ctxt, key: Symbol, meta: &ParseNestedMeta) -> syn::Result<()> {
    let value = if meta.input.peek(Token![=]) {
        meta.value()?.parse::<Expr>()?.into_token_stream()
    } else if meta.input.peek(syn::token::Paren) {
        meta.input
            .parse::<proc_macro2::Group>()?
            .into_token_stream()
    } else {
        return Ok(());
    };
    let msg = format!("`{key}` takes no value: write `#[event({key})]`");
    cx.error_spanned_by(value, msg);
    Ok(())
}

/// `root = Name`. A string literal is reported but still read as the name, so
/// the root type is generated under the intended name.
fn get_root(cx: &Ctxt, meta: &ParseNestedMeta) -> syn::Result<Option<Ident>> {
    let syntax = || format!("#[aggregate({ROOT} = Name)]");
    match get_value(cx, meta, syntax)? {
        Some(Expr::Path(expr)) if expr.qself.is_none() && expr.attrs.is_empty() => {
            if let Some(ident) = expr.path.get_ident() {
                Ok(Some(ident.clone()))
            } else {
                let msg = format!(
                    "`{ROOT}` names the generated type, declared next to the struct: \
                     write a plain identifier, e.g. `{}`",
                    syntax()
                );
                cx.error_spanned_by(expr, msg);
                Ok(None)
            }
        }
        Some(Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        })) => {
            let msg = format!("`{ROOT}` takes an identifier, not a string: `{}`", syntax());
            cx.error_spanned_by(&lit, msg);
            Ok(lit.parse::<Ident>().ok())
        }
        Some(other) => {
            let msg = format!("`{ROOT}` must be an identifier: `{}`", syntax());
            cx.error_spanned_by(other, msg);
            Ok(None)
        }
        None => Ok(None),
    }
}

/// Strips the invisible groups macro_rules! wraps around interpolated values.
fn ungroup(mut expr: Expr) -> Expr {
    while let Expr::Group(group) = expr {
        expr = *group.expr;
    }
    expr
}
