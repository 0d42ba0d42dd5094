//! The typed form of an `impl` block under `#[saga]`: the attribute's
//! arguments, and its functions marked `#[init]`, `#[step]` or `#[timeout]`,
//! grouped by message type; and the checks on them that the syntax allows.
//!
//! What the checks see is the syntax of the block: they cannot resolve the
//! stage enum (declared elsewhere) nor the message types. Whether a stage is
//! reached, or the saga completes, is read from the tokens of the function
//! bodies: a stage counts as reached when an `#[init]` or step body names it
//! (`Stage::Shipped`, or `Shipped`), the saga as completing when a step body
//! calls `.complete()`.

use std::collections::BTreeMap;

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{
    Attribute, Expr, ExprLit, FnArg, Ident, ImplItem, ImplItemFn, ItemImpl, Lit, LitStr, Pat, Path,
    ReturnType, Type,
};

use crate::internals::attr::{get_value, unknown_key};
use crate::internals::symbol::{
    CORRELATE, FROM, INIT, NAME, OTHER_STAGE, SAGA, STAGE, STAGE_FIELD, START, STEP, Symbol,
    TIMEOUT, TIMEOUTS,
};
use crate::internals::{Ctxt, check};

/// What a message in another stage does (`other_stage = ...`).
#[derive(Clone, Copy)]
pub enum OtherStage {
    /// `ignore`.
    Ignore,
    /// `dead_letter`.
    DeadLetter,
}

/// The arguments of `#[saga(...)]`.
#[derive(Default)]
pub struct Args {
    /// `name = "..."`.
    pub name: Option<LitStr>,
    /// `timeouts = "..."`: the topic of the saga's timeouts.
    pub timeouts: Option<LitStr>,
    /// Whether `timeouts` was written, valid or not.
    pub timeouts_written: bool,
    /// `stage = Type`.
    pub stage: Option<Type>,
    /// Whether `stage` was written, valid or not.
    pub stage_written: bool,
    /// `stage_field = field`.
    pub stage_field: Option<Ident>,
    /// `other_stage = ignore | dead_letter`.
    pub other_stage: Option<OtherStage>,
    /// `correlate = field`: the default correlation of every message type.
    pub correlate: Option<Ident>,
}

const SAGA_KEYS: &[Symbol] = &[NAME, TIMEOUTS, STAGE, STAGE_FIELD, OTHER_STAGE, CORRELATE];

impl Args {
    /// Parses the attribute's arguments.
    pub fn from_args(cx: &Ctxt, args: TokenStream) -> Self {
        let mut out = Args::default();
        let mut seen: Vec<Symbol> = Vec::new();
        let parser = syn::meta::parser(|meta| {
            let Some(key) = SAGA_KEYS.iter().copied().find(|k| meta.path == *k) else {
                return unknown_key(cx, SAGA, &meta, SAGA_KEYS);
            };
            if seen.contains(&key) {
                cx.error_spanned_by(&meta.path, format!("duplicate saga attribute `{key}`"));
            }
            seen.push(key);
            let syntax = || syntax_of(key);
            let Some(value) = get_value(cx, &meta, syntax)? else {
                return Ok(());
            };
            if key == NAME || key == TIMEOUTS {
                let lit = match value {
                    Expr::Lit(ExprLit {
                        lit: Lit::Str(lit), ..
                    }) => lit,
                    other => {
                        let msg = format!("`{key}` must be a string literal: `{}`", syntax());
                        cx.error_spanned_by(other, msg);
                        return Ok(());
                    }
                };
                if key == NAME {
                    if lit.value().trim().is_empty() {
                        cx.error_spanned_by(&lit, "`name` must not be empty");
                    } else {
                        out.name = Some(lit);
                    }
                } else {
                    out.timeouts_written = true;
                    match check::kafka_topic(&lit.value()) {
                        Ok(()) => out.timeouts = Some(lit),
                        Err(msg) => cx.error_spanned_by(&lit, msg),
                    }
                }
            } else if key == STAGE {
                out.stage_written = true;
                match syn::parse2::<Type>(value.to_token_stream()) {
                    Ok(ty) => out.stage = Some(ty),
                    Err(_) => cx.error_spanned_by(
                        value,
                        format!("`stage` names the stage enum: `{}`", syntax()),
                    ),
                }
            } else if key == OTHER_STAGE {
                match ident_of(&value).map(|i| (i.to_string(), i)) {
                    Some((s, _)) if s == "ignore" => out.other_stage = Some(OtherStage::Ignore),
                    Some((s, _)) if s == "dead_letter" => {
                        out.other_stage = Some(OtherStage::DeadLetter);
                    }
                    _ => cx.error_spanned_by(
                        value,
                        "`other_stage` is `ignore` (the default) or `dead_letter`",
                    ),
                }
            } else {
                // `stage_field`, `correlate`: a field name.
                match ident_of(&value) {
                    Some(ident) if key == STAGE_FIELD => out.stage_field = Some(ident),
                    Some(ident) => out.correlate = Some(ident),
                    None => {
                        cx.error_spanned_by(value, format!("`{key}` names a field: `{}`", syntax()))
                    }
                }
            }
            Ok(())
        });
        if let Err(err) = parser.parse2(args) {
            cx.syn_error(err);
        }
        out
    }
}

fn syntax_of(key: Symbol) -> String {
    let example = match key.as_str() {
        "name" => "\"order\"",
        "timeouts" => "\"order-timeouts\"",
        "stage" => "Stage",
        "stage_field" => "stage",
        "other_stage" => "dead_letter",
        _ => "order_id",
    };
    format!("#[saga({key} = {example})]")
}

/// A plain identifier written as a value.
fn ident_of(expr: &Expr) -> Option<Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => p.path.get_ident().cloned(),
        _ => None,
    }
}

/// A stage named in `from = ...`: a variant of the stage enum (`Shipped`),
/// or a path to one (`Stage::Shipped`).
pub struct StageRef {
    /// As written.
    pub path: Path,
}

impl StageRef {
    /// The variant's name.
    pub fn variant(&self) -> &Ident {
        &self
            .path
            .segments
            .last()
            .expect("a path has a segment")
            .ident
    }

    /// The key two stages are compared by.
    pub fn key(&self) -> String {
        self.variant().to_string()
    }
}

/// Which attribute marks a function.
pub enum Role {
    /// `#[init]`: builds a new instance from its start message.
    Init,
    /// `#[step(...)]`: a step of a message type.
    Step {
        /// `start`, with its key (for spans).
        start: Option<Path>,
        /// `correlate = field`.
        correlate: Option<Ident>,
    },
    /// `#[timeout(name = "...", ...)]`: a step of one of the saga's timeouts.
    Timeout {
        /// The timeout's name.
        name: Option<LitStr>,
    },
}

/// A function of the block marked `#[init]`, `#[step]` or `#[timeout]`.
pub struct Marked<'a> {
    /// The function as written.
    pub item: &'a ImplItemFn,
    /// What it is.
    pub role: Role,
    /// `from = X` or `from = [X, Y]`: the stages it runs in (none: a
    /// fallback, any stage).
    pub from: Vec<StageRef>,
    /// The message type: the second parameter's type (`#[init]`: the
    /// first's, without its `&`), when the signature has it.
    pub message: Option<&'a Type>,
}

impl Marked<'_> {
    /// The function's name.
    pub fn ident(&self) -> &Ident {
        &self.item.sig.ident
    }

    fn what(&self) -> &'static str {
        match self.role {
            Role::Init => "an `#[init]`",
            Role::Step { .. } => "a `#[step]`",
            Role::Timeout { .. } => "a `#[timeout]`",
        }
    }
}

/// The `impl` block under `#[saga]`.
pub struct Saga<'a> {
    /// The block as written.
    pub item: &'a ItemImpl,
    /// The attribute's arguments.
    pub args: Args,
    /// The functions marked `#[init]`, `#[step]` or `#[timeout]`, in order.
    pub marked: Vec<Marked<'a>>,
}

/// The steps of one message type, as the macro registers them.
pub struct Group<'a> {
    /// The type, as first written.
    pub ty: &'a Type,
    /// Its correlation field.
    pub correlate: Option<Ident>,
    /// The `#[init]` building a new instance.
    pub init: Option<&'a Ident>,
    /// The start step.
    pub start: Option<&'a Ident>,
    /// `(stage, step)`: `None` for a fallback.
    pub handles: Vec<(Option<&'a StageRef>, &'a Ident)>,
}

/// The timeout steps: `(timeout name, stage, step)`.
pub type TimeoutSteps<'a> = Vec<(&'a LitStr, Option<&'a StageRef>, &'a Ident)>;

/// Whether `attr` is one of the markers.
pub fn is_marker(attr: &Attribute) -> bool {
    attr.path() == INIT || attr.path() == STEP || attr.path() == TIMEOUT
}

/// The type's tokens as text, without spaces: the key message types are
/// grouped by.
pub fn type_key(ty: &Type) -> String {
    ty.to_token_stream().to_string().replace(' ', "")
}

impl<'a> Saga<'a> {
    /// Reads the block and its markers, reporting malformed ones.
    pub fn from_ast(cx: &Ctxt, args: TokenStream, item: &'a ItemImpl) -> Self {
        let args = Args::from_args(cx, args);
        let mut marked = Vec::new();
        for impl_item in &item.items {
            let ImplItem::Fn(f) = impl_item else { continue };
            let markers: Vec<&Attribute> = f.attrs.iter().filter(|a| is_marker(a)).collect();
            let Some((first, rest)) = markers.split_first() else {
                continue;
            };
            for extra in rest {
                cx.error_spanned_by(
                    extra,
                    "a function is one of `#[init]`, `#[step]` or `#[timeout]`, not several",
                );
            }
            marked.push(Marked::from_attr(cx, f, first));
        }
        Saga { item, args, marked }
    }

    /// The type the block implements.
    pub fn self_ty(&self) -> &Type {
        &self.item.self_ty
    }

    /// The message steps, grouped by message type in order of appearance.
    pub fn groups(&self) -> Vec<Group<'_>> {
        let mut groups: Vec<Group> = Vec::new();
        let mut index: BTreeMap<String, usize> = BTreeMap::new();
        for m in &self.marked {
            let Some(ty) = m.message else { continue };
            if matches!(m.role, Role::Timeout { .. }) {
                continue;
            }
            let i = *index.entry(type_key(ty)).or_insert_with(|| {
                groups.push(Group {
                    ty,
                    correlate: None,
                    init: None,
                    start: None,
                    handles: Vec::new(),
                });
                groups.len() - 1
            });
            let g = &mut groups[i];
            match &m.role {
                Role::Init => {
                    g.init.get_or_insert(m.ident());
                }
                Role::Step { start, correlate } => {
                    if let (None, Some(c)) = (&g.correlate, correlate) {
                        g.correlate = Some(c.clone());
                    }
                    if start.is_some() {
                        g.start.get_or_insert(m.ident());
                    }
                    if m.from.is_empty() && start.is_none() {
                        g.handles.push((None, m.ident()));
                    }
                    for from in &m.from {
                        g.handles.push((Some(from), m.ident()));
                    }
                }
                Role::Timeout { .. } => {}
            }
        }
        for g in &mut groups {
            if g.correlate.is_none() {
                g.correlate.clone_from(&self.args.correlate);
            }
        }
        groups
    }

    /// The timeout steps.
    pub fn timeout_steps(&self) -> TimeoutSteps<'_> {
        let mut steps = Vec::new();
        for m in &self.marked {
            let Role::Timeout { name: Some(name) } = &m.role else {
                continue;
            };
            if m.from.is_empty() {
                steps.push((name, None, m.ident()));
            }
            for from in &m.from {
                steps.push((name, Some(from), m.ident()));
            }
        }
        steps
    }
}

const STEP_KEYS: &[Symbol] = &[START, FROM, CORRELATE];
const TIMEOUT_KEYS: &[Symbol] = &[NAME, FROM];

impl<'a> Marked<'a> {
    fn from_attr(cx: &Ctxt, item: &'a ImplItemFn, attr: &Attribute) -> Self {
        let is_init = attr.path() == INIT;
        let is_step = attr.path() == STEP;
        let mut start = None;
        let mut correlate = None;
        let mut name = None;
        let mut from = Vec::new();
        let mut seen: Vec<Symbol> = Vec::new();
        if is_init {
            if !matches!(attr.meta, syn::Meta::Path(_)) {
                cx.error_spanned_by(
                    attr,
                    "`#[init]` takes no arguments: the message type is its parameter's",
                );
            }
        } else if !matches!(attr.meta, syn::Meta::Path(_)) {
            let marker = if is_step { STEP } else { TIMEOUT };
            let keys = if is_step { STEP_KEYS } else { TIMEOUT_KEYS };
            let result = attr.parse_nested_meta(|meta| {
                let Some(key) = keys.iter().copied().find(|k| meta.path == *k) else {
                    return unknown_key(cx, marker, &meta, keys);
                };
                if seen.contains(&key) {
                    cx.error_spanned_by(
                        &meta.path,
                        format!("duplicate {marker} attribute `{key}`"),
                    );
                }
                seen.push(key);
                if key == START {
                    start = Some(meta.path.clone());
                    Ok(())
                } else if key == FROM {
                    from = get_stages(cx, &meta)?;
                    Ok(())
                } else if key == CORRELATE {
                    let syntax = || format!("#[step({CORRELATE} = order_id)]");
                    if let Some(value) = get_value(cx, &meta, syntax)? {
                        match ident_of(&value) {
                            Some(ident) => correlate = Some(ident),
                            None => cx.error_spanned_by(
                                value,
                                "`correlate` names a field of the message: \
                                 `#[step(correlate = order_id)]`",
                            ),
                        }
                    }
                    Ok(())
                } else {
                    let syntax = || format!("#[timeout({NAME} = \"payment\")]");
                    if let Some(value) = get_value(cx, &meta, syntax)? {
                        match value {
                            Expr::Lit(ExprLit {
                                lit: Lit::Str(lit), ..
                            }) if !lit.value().is_empty() => name = Some(lit),
                            other => cx.error_spanned_by(
                                other,
                                "`name` is the timeout's name, a non-empty string literal: \
                                 `#[timeout(name = \"payment\")]`, as given to \
                                 `ctx.schedule_timeout`",
                            ),
                        }
                    }
                    Ok(())
                }
            });
            if let Err(err) = result {
                cx.syn_error(err);
            }
        }
        let role = if is_init {
            Role::Init
        } else if is_step {
            Role::Step { start, correlate }
        } else {
            if name.is_none() && !seen.contains(&NAME) {
                cx.error_spanned_by(
                    attr,
                    "a `#[timeout]` names the timeout it answers: \
                     `#[timeout(name = \"payment\")]`, as given to `ctx.schedule_timeout`",
                );
            }
            Role::Timeout { name }
        };
        let mut marked = Marked {
            item,
            role,
            from,
            message: None,
        };
        marked.message = check_signature(cx, &marked);
        marked
    }
}

/// `from = X`, `from = Stage::X` or `from = [X, Y]`.
fn get_stages(cx: &Ctxt, meta: &ParseNestedMeta) -> syn::Result<Vec<StageRef>> {
    let syntax = || format!("#[step({FROM} = AwaitingPayment)]");
    let Some(value) = get_value(cx, meta, syntax)? else {
        return Ok(Vec::new());
    };
    let values: Vec<Expr> = match value {
        Expr::Array(array) => array.elems.into_iter().collect(),
        other => vec![other],
    };
    let mut stages = Vec::new();
    for value in values {
        match value {
            Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
                stages.push(StageRef { path: p.path });
            }
            other => cx.error_spanned_by(
                other,
                "`from` names a stage, a unit variant of the stage enum: \
                 `from = AwaitingPayment` or `from = [AwaitingPayment, OnHold]`",
            ),
        }
    }
    if stages.is_empty() {
        cx.error_spanned_by(
            &meta.path,
            "`from` names at least one stage; leave it out for a step of any stage",
        );
    }
    Ok(stages)
}

/// Checks a marked function's signature; returns its message type when it
/// can be found.
fn check_signature<'a>(cx: &Ctxt, m: &Marked<'a>) -> Option<&'a Type> {
    let sig = &m.item.sig;
    let what = m.what();
    let expected = match m.role {
        Role::Init => "`fn begin(message: &YourMessage) -> Self`".to_owned(),
        Role::Step { .. } => format!(
            "`async fn {}(ctx: &mut SagaContext<Self>, message: YourMessage) -> Result<Stage, E>`",
            sig.ident
        ),
        Role::Timeout { .. } => format!(
            "`async fn {}(ctx: &mut SagaContext<Self>, timeout: SagaTimeout<Self>) -> \
             Result<Stage, E>`",
            sig.ident
        ),
    };
    let is_init = matches!(m.role, Role::Init);
    if let Some(constness) = &sig.constness {
        cx.error_spanned_by(constness, format!("{what} cannot be `const`"));
    }
    if let Some(unsafety) = &sig.unsafety {
        cx.error_spanned_by(unsafety, format!("{what} cannot be `unsafe`"));
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(abi, format!("{what} cannot be `extern`"));
    }
    match (&sig.asyncness, is_init) {
        (Some(asyncness), true) => cx.error_spanned_by(
            asyncness,
            format!("{what} is a plain `fn` building the new instance: {expected}"),
        ),
        (None, false) => cx.error_spanned_by(
            sig.fn_token,
            format!("{what} must be an `async fn`: {expected}"),
        ),
        _ => {}
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        cx.error_spanned_by(
            &sig.generics,
            format!("{what} cannot be generic: it takes one message type; leave lifetimes elided"),
        );
    }
    let mut typed = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(receiver) => cx.error_spanned_by(
                receiver,
                format!(
                    "{what} is an associated function, not a method: remove `self`; {expected}"
                ),
            ),
            FnArg::Typed(arg) => {
                if !matches!(&*arg.pat, Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none())
                    && !matches!(&*arg.pat, Pat::Wild(_))
                {
                    cx.error_spanned_by(
                        &arg.pat,
                        format!("{what} takes plain argument names: destructure inside the body"),
                    );
                }
                typed.push(arg);
            }
        }
    }
    let arity = if is_init { 1 } else { 2 };
    let message = if typed.len() == arity {
        let ty = &*typed[arity - 1].ty;
        match (ty, is_init) {
            (Type::Reference(r), true) => Some(&*r.elem),
            (_, true) => {
                cx.error_spanned_by(
                    ty,
                    format!("{what} takes the start message by reference: {expected}"),
                );
                None
            }
            (Type::Reference(r), false) => {
                cx.error_spanned_by(
                    r.and_token,
                    format!("{what} takes the message by value: remove the `&`"),
                );
                None
            }
            (ty, false) => Some(ty),
        }
    } else {
        let count = if arity == 1 {
            "one argument"
        } else {
            "two arguments"
        };
        cx.error_at(
            sig.paren_token.span.join(),
            format!("{what} takes {count}: {expected}; found {}", typed.len()),
        );
        None
    };
    if let ReturnType::Default = sig.output {
        cx.error_at(
            sig.paren_token.span.close(),
            format!("{what} must declare its return type: {expected}"),
        );
    }
    message
}

/// Whether the tokens contain `.complete()`.
fn calls_complete(tokens: TokenStream) -> bool {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    tokens.iter().enumerate().any(|(i, t)| match t {
        TokenTree::Group(g) => calls_complete(g.stream()),
        TokenTree::Punct(p) if p.as_char() == '.' => {
            matches!(tokens.get(i + 1), Some(TokenTree::Ident(id)) if id == "complete")
                && matches!(tokens.get(i + 2), Some(TokenTree::Group(g))
                    if g.delimiter() == proc_macro2::Delimiter::Parenthesis && g.stream().is_empty())
        }
        _ => false,
    })
}

/// Collects every identifier in the tokens.
fn idents(tokens: TokenStream, out: &mut Vec<String>) {
    for t in tokens {
        match t {
            TokenTree::Group(g) => idents(g.stream(), out),
            TokenTree::Ident(id) => out.push(id.to_string()),
            _ => {}
        }
    }
}

/// Checks what the syntax of the whole block tells: every message type is
/// correlated, once; something starts the saga and something completes it;
/// every stage a step runs in is named by some body; no two steps of one
/// message type (or timeout) share a stage; each start has its `#[init]`.
pub fn check(cx: &Ctxt, saga: &Saga) {
    let self_ty = saga.self_ty();
    if !saga.item.generics.params.is_empty() || saga.item.generics.where_clause.is_some() {
        cx.error_spanned_by(
            &saga.item.generics,
            "a `#[saga]` cannot be generic: its state is stored under one name",
        );
    }
    if let Some((_, path, _)) = &saga.item.trait_ {
        cx.error_spanned_by(
            path,
            "`#[saga]` goes on an inherent `impl` block of the saga's state (`impl Order { .. }`), \
             not a trait impl",
        );
    }
    if saga.args.stage.is_none() && !saga.args.stage_written {
        cx.error_spanned_by(
            self_ty,
            "a `#[saga]` names its stage enum: `#[saga(stage = Stage, ...)]`",
        );
    }
    if saga.args.timeouts.is_none() && !saga.args.timeouts_written {
        cx.error_spanned_by(
            self_ty,
            "a `#[saga]` names the topic of its timeouts: \
             `#[saga(timeouts = \"order-timeouts\", ...)]`",
        );
    }

    // Correlation: one field per message type.
    let mut correlations: BTreeMap<String, (&Ident, &Ident)> = BTreeMap::new();
    for m in &saga.marked {
        let (
            Role::Step {
                correlate: Some(field),
                ..
            },
            Some(ty),
        ) = (&m.role, m.message)
        else {
            continue;
        };
        let key = type_key(ty);
        match correlations.get(&key) {
            Some((first, step)) if *first != field => cx.error_spanned_by(
                field,
                format!(
                    "`{key}` is correlated by `{first}` in step `{step}`: a message type has \
                     one correlation field (write it once, or the same on each step)"
                ),
            ),
            Some(_) => {}
            None => {
                correlations.insert(key, (field, m.ident()));
            }
        }
    }
    let groups = saga.groups();
    for g in &groups {
        // A type with only an `#[init]` is reported below, as an `#[init]`
        // without its start step.
        let has_steps = g.start.is_some() || !g.handles.is_empty();
        if g.correlate.is_none() && has_steps {
            let key = type_key(g.ty);
            cx.error_spanned_by(
                g.ty,
                format!(
                    "no correlation for `{key}`: say which of its fields holds the instance id, \
                     `#[step(correlate = order_id)]` on one of its steps, or \
                     `#[saga(correlate = order_id)]` for every message type"
                ),
            );
        }
    }

    // Starts and their `#[init]`s.
    let mut inits: BTreeMap<String, &Ident> = BTreeMap::new();
    let mut starts: BTreeMap<String, &Ident> = BTreeMap::new();
    for m in &saga.marked {
        let Some(ty) = m.message else { continue };
        let key = type_key(ty);
        match &m.role {
            Role::Init => {
                if let Some(first) = inits.get(&key) {
                    cx.error_spanned_by(
                        m.ident(),
                        format!("`{key}` already has its `#[init]`, `{first}`"),
                    );
                } else {
                    inits.insert(key, m.ident());
                }
            }
            Role::Step {
                start: Some(start), ..
            } => {
                if let Some(first) = starts.get(&key) {
                    cx.error_spanned_by(
                        start,
                        format!("`{key}` already has a start step, `{first}`"),
                    );
                } else {
                    starts.insert(key, m.ident());
                }
            }
            _ => {}
        }
    }
    for m in &saga.marked {
        let Some(ty) = m.message else { continue };
        let key = type_key(ty);
        match &m.role {
            Role::Init if !starts.contains_key(&key) => cx.error_spanned_by(
                m.ident(),
                format!(
                    "no `#[step(start)]` of `{key}`: this `#[init]` is never used; mark the \
                     step that starts the saga with `start`"
                ),
            ),
            Role::Step {
                start: Some(start), ..
            } if !inits.contains_key(&key) => cx.error_spanned_by(
                start,
                format!(
                    "a start step of `{key}` needs an `#[init] fn(message: &{key}) -> Self` \
                     building the new instance"
                ),
            ),
            _ => {}
        }
    }
    let has_start = saga
        .marked
        .iter()
        .any(|m| matches!(m.role, Role::Step { start: Some(_), .. }));
    if !has_start {
        cx.error_spanned_by(
            self_ty,
            "no step starts this saga: mark the step of the message that creates an instance \
             `#[step(start)]`, with an `#[init]` building its state",
        );
    }

    // Completion, read from the step bodies.
    let completes = saga
        .marked
        .iter()
        .filter(|m| !matches!(m.role, Role::Init))
        .any(|m| calls_complete(m.item.block.to_token_stream()));
    if !completes {
        cx.error_spanned_by(
            self_ty,
            "no step completes this saga: no step body calls `ctx.complete()`, so every \
             instance would stay open forever (the check reads the bodies' syntax)",
        );
    }

    // Stages: each `from` stage is named by some body.
    let mut named = Vec::new();
    for m in &saga.marked {
        idents(m.item.block.to_token_stream(), &mut named);
    }
    for m in &saga.marked {
        for from in &m.from {
            let variant = from.variant().to_string();
            if !named.contains(&variant) {
                cx.error_spanned_by(
                    &from.path,
                    format!(
                        "no step reaches stage `{variant}`: no `#[init]` or step body names \
                         it, so `{}` can never run (the check reads the bodies' syntax)",
                        m.ident()
                    ),
                );
            }
        }
    }

    // Two steps of one message type (or timeout) in one stage.
    let mut seen: BTreeMap<(String, String), &Ident> = BTreeMap::new();
    for m in &saga.marked {
        let kind = match (&m.role, m.message) {
            (Role::Step { .. }, Some(ty)) => type_key(ty),
            (Role::Timeout { name: Some(name) }, _) => format!("timeout \"{}\"", name.value()),
            _ => continue,
        };
        let fallback = matches!(
            m.role,
            Role::Step { start: None, .. } | Role::Timeout { .. }
        ) && m.from.is_empty();
        let mut stages: Vec<(String, TokenStream)> = m
            .from
            .iter()
            .map(|f| (f.key(), f.path.to_token_stream()))
            .collect();
        if fallback {
            stages.push(("*".to_owned(), m.ident().to_token_stream()));
        }
        for (stage, span) in stages {
            if let Some(first) = seen.get(&(kind.clone(), stage.clone())) {
                let which = if stage == "*" {
                    "with no `from` (any stage)".to_owned()
                } else {
                    format!("in stage `{stage}`")
                };
                cx.error_spanned_by(
                    span,
                    format!(
                        "two steps of `{kind}` {which}: `{first}` and `{}`; which one runs \
                         would be ambiguous",
                        m.ident()
                    ),
                );
            } else {
                seen.insert((kind.clone(), stage), m.ident());
            }
        }
    }
}
