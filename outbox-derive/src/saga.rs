//! Expansion of `#[saga]` on an `impl` block of a saga's state.
//!
//! The block is emitted as written, its `#[init]`, `#[step]` and
//! `#[timeout]` markers removed. Beside it, in a `const _` block: for each
//! step, a hidden associated function boxing the step's future into a
//! `StepFn`, and the `Saga` impl whose `steps` registers each message type
//! once, with every step of that type (and the timeouts' steps together).
//!
//! When the input has errors, the block is emitted without its markers next
//! to them, with a stub `Saga` impl, so that the steps' `SagaContext<Self>`
//! and code registering the saga do not add errors of their own.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Ident, ImplItem, Item, ItemImpl, ReturnType, Type};

use crate::internals::Ctxt;
use crate::internals::saga::{self as ir, OtherStage, Role, Saga, StageRef};

/// Expands `#[saga(args)]` on `input`.
pub fn expand(args: TokenStream, input: TokenStream) -> TokenStream {
    let cx = Ctxt::new();
    let item = match syn::parse2::<Item>(input.clone()) {
        Ok(Item::Impl(item)) => Some(item),
        Ok(_) => {
            cx.error_at(
                Span::call_site(),
                "`#[saga]` goes on an `impl` block of the saga's state: \
                 `#[saga(...)] impl Order { .. }`",
            );
            None
        }
        Err(err) => {
            cx.syn_error(err);
            None
        }
    };
    let Some(item) = item else {
        ir::Args::from_args(&cx, args);
        let errors = cx.check().err().map(syn::Error::into_compile_error);
        return quote! {
            #input
            #errors
        };
    };
    let saga = Saga::from_ast(&cx, args, &item);
    ir::check(&cx, &saga);
    let stripped = strip_markers(&item);
    match cx.check() {
        Ok(()) => {
            let generated = expand_saga(&saga);
            quote! {
                #stripped
                #generated
            }
        }
        Err(err) => {
            let errors = err.into_compile_error();
            let stub = stub(&saga);
            quote! {
                #stripped
                #stub
                #errors
            }
        }
    }
}

/// The block without the markers (unknown attributes to the compiler).
fn strip_markers(item: &ItemImpl) -> ItemImpl {
    let mut item = item.clone();
    for impl_item in &mut item.items {
        if let ImplItem::Fn(f) = impl_item {
            f.attrs.retain(|a| !ir::is_marker(a));
        }
    }
    item
}

/// The saga's name: `name = "..."`, or else the type's name.
fn saga_name(saga: &Saga) -> String {
    match &saga.args.name {
        Some(lit) => lit.value(),
        None => match saga.self_ty() {
            Type::Path(p) => p
                .path
                .segments
                .last()
                .map(|s| s.ident.to_string())
                .unwrap_or_default(),
            other => ir::type_key(other),
        },
    }
}

/// A stub `Saga` impl, when the input has errors (its stage `()` when
/// `stage` is missing or invalid).
fn stub(saga: &Saga) -> Option<TokenStream> {
    let stage = match &saga.args.stage {
        Some(stage) => quote!(#stage),
        None => quote!(()),
    };
    if !saga.item.generics.params.is_empty() || saga.item.trait_.is_some() {
        return None;
    }
    let self_ty = saga.self_ty();
    let name = saga_name(saga);
    Some(quote! {
        #[automatically_derived]
        impl ::outbox::__private::Saga for #self_ty {
            const NAME: &'static str = #name;
            const TIMEOUT_TOPIC: &'static str = "";
            type Stage = #stage;
            fn stage(&self) -> &#stage {
                ::core::unreachable!("the `#[saga]` input has errors")
            }
            fn set_stage(&mut self, _: #stage) {}
            fn steps<__R: ::outbox::__private::SagaRegistrar<Self>>(_: &mut __R) {}
        }
    })
}

fn wrapper_ident(step: &Ident) -> Ident {
    format_ident!("__outbox_saga_step_{}", step)
}

/// The expression of a stage named in `from`.
fn stage_expr(stage_ty: &Type, stage: &StageRef) -> TokenStream {
    let path = &stage.path;
    if path.segments.len() > 1 || path.leading_colon.is_some() {
        return quote!(#path);
    }
    let variant = stage.variant();
    let plain = matches!(stage_ty, Type::Path(p) if p.qself.is_none()
        && p.path.segments.iter().all(|s| s.arguments.is_none()));
    if plain {
        quote_spanned!(variant.span()=> #stage_ty::#variant)
    } else {
        quote_spanned!(variant.span()=> <#stage_ty>::#variant)
    }
}

fn expand_saga(saga: &Saga) -> TokenStream {
    let self_ty = saga.self_ty();
    let Some(stage_ty) = &saga.args.stage else {
        unreachable!("checked");
    };
    let Some(timeouts) = &saga.args.timeouts else {
        unreachable!("checked");
    };
    let name = saga_name(saga);
    let stage_field = saga
        .args
        .stage_field
        .clone()
        .unwrap_or_else(|| Ident::new("stage", stage_ty.span()));
    let other_stage = match saga.args.other_stage {
        Some(OtherStage::DeadLetter) => quote!(::outbox::__private::OtherStage::DeadLetter),
        Some(OtherStage::Ignore) | None => quote!(::outbox::__private::OtherStage::Ignore),
    };

    // One hidden function per step, boxing its future.
    let wrappers = saga.marked.iter().filter_map(|m| {
        let message = match m.role {
            Role::Init => return None,
            Role::Step { .. } => {
                let ty = m.message?;
                quote!(#ty)
            }
            Role::Timeout { .. } => quote!(::outbox::__private::SagaTimeout<Self>),
        };
        let step = m.ident();
        let wrapper = wrapper_ident(step);
        let output_span = match &m.item.sig.output {
            ReturnType::Type(_, ty) => ty.span(),
            ReturnType::Default => step.span(),
        };
        let result = quote_spanned! {output_span=>
            ::outbox::__private::StepOutput::<
                <Self as ::outbox::__private::Saga>::Stage
            >::into_step_result(__output)
        };
        let boxed = quote_spanned! {step.span()=>
            ::std::boxed::Box::pin(async move {
                let __output = Self::#step(__ctx, __message).await;
                #result
            })
        };
        Some(quote! {
            #[doc(hidden)]
            fn #wrapper<'__a>(
                __ctx: &'__a mut ::outbox::__private::SagaContext<Self>,
                __message: #message,
            ) -> ::outbox::__private::StepFuture<'__a, Self> {
                #boxed
            }
        })
    });
    let wrappers: Vec<TokenStream> = wrappers.collect();

    let some = |stage: Option<&StageRef>| match stage {
        Some(stage) => {
            let expr = stage_expr(stage_ty, stage);
            quote!(::core::option::Option::Some(#expr))
        }
        None => quote!(::core::option::Option::None),
    };

    let groups = saga.groups().into_iter().map(|g| {
        let ty = g.ty;
        let Some(field) = &g.correlate else {
            unreachable!("checked");
        };
        let key_string = quote_spanned!(field.span()=> ::outbox::__private::key_string);
        let start = match (g.init, g.start) {
            (Some(init), Some(start)) => {
                let wrapper = wrapper_ident(start);
                quote!(.start(Self::#init, Self::#wrapper))
            }
            _ => quote!(),
        };
        let handles = g.handles.iter().map(|(stage, step)| {
            let stage = some(*stage);
            let wrapper = wrapper_ident(step);
            quote!(.handle(#stage, Self::#wrapper))
        });
        quote! {
            __registrar.add(
                ::outbox::__private::MessageSteps::<Self, #ty>::new(
                    |__message: &#ty| #key_string(&__message.#field)
                )
                #start
                #(#handles)*
            );
        }
    });
    let groups: Vec<TokenStream> = groups.collect();

    let timeout_steps = saga.timeout_steps();
    let timeouts_add = (!timeout_steps.is_empty()).then(|| {
        let ons = timeout_steps.iter().map(|(timeout, stage, step)| {
            let stage = some(*stage);
            let wrapper = wrapper_ident(step);
            quote!(.on(#timeout, #stage, Self::#wrapper))
        });
        quote! {
            __registrar.add(
                ::outbox::__private::MessageSteps::<
                    Self,
                    ::outbox::__private::SagaTimeout<Self>,
                >::timeouts()
                #(#ons)*
            );
        }
    });

    quote! {
        const _: () = {
            impl #self_ty {
                #(#wrappers)*
            }

            #[automatically_derived]
            impl ::outbox::__private::Saga for #self_ty {
                const NAME: &'static str = #name;
                const TIMEOUT_TOPIC: &'static str = #timeouts;
                type Stage = #stage_ty;

                fn stage(&self) -> &#stage_ty {
                    &self.#stage_field
                }

                fn set_stage(&mut self, stage: #stage_ty) {
                    self.#stage_field = stage;
                }

                fn other_stage() -> ::outbox::__private::OtherStage {
                    #other_stage
                }

                fn steps<__R: ::outbox::__private::SagaRegistrar<Self>>(__registrar: &mut __R) {
                    #(#groups)*
                    #timeouts_add
                }
            }
        };
    }
}
