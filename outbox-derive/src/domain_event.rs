//! Expansion of `#[derive(DomainEvent)]`: the `impl ::outbox::DomainEvent`,
//! or a stub of it next to the errors when the input is invalid.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{DeriveInput, Ident};

use crate::internals::ast::{Container, Data, Event, Field};
use crate::internals::{Ctxt, check};

/// Expands `#[derive(DomainEvent)]` on `input`.
pub fn derive(input: &DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let Some(cont) = Container::from_ast(&cx, input) else {
        // A union: there is nothing to implement the trait for, not even a stub.
        return match cx.check() {
            Ok(()) => TokenStream::new(),
            Err(err) => err.into_compile_error(),
        };
    };
    check::check(&cx, &cont);
    match cx.check() {
        Ok(()) => expand(&cont),
        Err(err) => fallback(input, err),
    }
}

fn expand(cont: &Container) -> TokenStream {
    let ident = cont.ident;
    let (impl_generics, ty_generics, where_clause) = cont.generics.split_for_impl();
    // Spanned at the type's name: an unsatisfied supertrait (`Serialize`,
    // `DeserializeOwned`, `Send`...) is reported there.
    let impl_header = quote_spanned! {ident.span()=>
        impl #impl_generics ::outbox::DomainEvent for #ident #ty_generics #where_clause
    };

    let topic = cont.topic();
    let aggregate_type = cont.aggregate_type();
    let event_types = cont.events().iter().map(Event::event_type);
    let body = match &cont.data {
        Data::Struct(event) => struct_body(event, cont.default_version()),
        Data::Enum(variants) => enum_body(variants, cont.default_version()),
    };
    let (versions, version_items) = match &cont.data {
        Data::Struct(event) => struct_versions(cont, event),
        Data::Enum(variants) => (enum_versions(variants, cont.default_version()), None),
    };

    quote! {
        const _: () = {
            #[automatically_derived]
            #impl_header {
                const TOPIC: &'static str = #topic;
                const AGGREGATE_TYPE: &'static str = #aggregate_type;
                const EVENT_TYPES: &'static [&'static str] = &[#(#event_types),*];

                #body
                #versions
            }

            #version_items
        };
    }
}

/// A struct's versions: `from_versioned_payload` through its upcaster, if
/// any, and (after the `DomainEvent` impl) its `EventVersion` impl and the
/// compile-time checks of the upcaster it names.
fn struct_versions(cont: &Container, event: &Event) -> (TokenStream, Option<TokenStream>) {
    let ident = cont.ident;
    let (impl_generics, ty_generics, where_clause) = cont.generics.split_for_impl();
    let event_type = event.event_type();
    let version = event.version(cont.default_version());
    let name = ident.to_string();

    let (older, oldest, checks) = match &cont.attrs.upcast_from {
        None => (quote!(::core::option::Option::None), quote!(#version), None),
        Some((_, prev)) => {
            let prev_name = prev.to_token_stream().to_string().replace(' ', "");
            let gap = format!(
                "`{name}` is version {version} of `{event_type}`: `upcast_from({prev_name})` \
                 must name its version {}, the one just before (a chain of upcasters has no gaps)",
                version - 1
            );
            let other_type = format!(
                "`upcast_from({prev_name})` on `{name}`: `{prev_name}` must be a version of \
                 event type `{event_type}` (set its `event_type`)"
            );
            // Spanned at the named type: a type that is no event version, or
            // that `Self` has no `From` for, is reported there.
            let version_of =
                quote_spanned!(prev.span()=> <#prev as ::outbox::__private::EventVersion>);
            let from = quote_spanned!(prev.span()=> <Self as ::core::convert::From<#prev>>::from);
            let older = quote_spanned! {prev.span()=>
                ::core::option::Option::Some(|event_type, version, payload| {
                    <#prev as ::outbox::__private::DomainEvent>::from_versioned_payload(
                        event_type, version, payload,
                    )
                    .map(#from)
                })
            };
            let checks = quote! {
                const _: () = {
                    ::core::assert!(#version_of::VERSION + 1 == #version, #gap);
                    ::core::assert!(
                        ::outbox::__private::str_eq(#version_of::EVENT_TYPE, #event_type),
                        #other_type
                    );
                };
            };
            (older, quote!(#version_of::OLDEST_VERSION), Some(checks))
        }
    };

    let method = quote! {
        fn from_versioned_payload(
            event_type: &str,
            version: u32,
            payload: &[u8],
        ) -> ::outbox::Result<Self> {
            ::outbox::__private::decode_version::<Self>(event_type, version, payload, #older)
        }
    };
    let items = quote! {
        #[automatically_derived]
        impl #impl_generics ::outbox::__private::EventVersion for #ident #ty_generics #where_clause {
            const EVENT_TYPE: &'static str = #event_type;
            const VERSION: u32 = #version;
            const OLDEST_VERSION: u32 = #oldest;
        }

        #checks
    };
    (method, Some(items))
}

/// An enum's versions: each variant reads its declared version only.
fn enum_versions(variants: &[Event], default_version: u32) -> TokenStream {
    let versions = variants.iter().map(|e| e.version(default_version));
    quote! {
        fn from_versioned_payload(
            event_type: &str,
            version: u32,
            payload: &[u8],
        ) -> ::outbox::Result<Self> {
            ::outbox::__private::decode_variant_version::<Self>(
                event_type,
                version,
                payload,
                &[#(#versions),*],
            )
        }
    }
}

/// The methods for a struct: its fields are read through `self`.
fn struct_body(event: &Event, default_version: u32) -> TokenStream {
    let event_type = event.event_type();
    let version = event.version(default_version);
    let self_field = |field: &Field| {
        let member = &field.member;
        quote_spanned!(field.span()=> &self.#member)
    };

    // Checked: every event has an aggregate id.
    let aggregate_id = event
        .aggregate_id()
        .map(|field| key_string(field, self_field(field)));
    let partition_key = event.partition_key().map(|field| {
        let key = key_string(field, self_field(field));
        quote! {
            fn partition_key(&self) -> ::std::string::String {
                #key
            }
        }
    });
    let event_id = event.event_id().map(|field| {
        let id = event_id(field, self_field(field));
        quote! {
            fn event_id(&self) -> ::core::option::Option<::outbox::__private::Uuid> {
                #id
            }
        }
    });

    quote! {
        fn event_type(&self) -> &'static str {
            #event_type
        }

        fn event_version(&self) -> u32 {
            #version
        }

        fn aggregate_id(&self) -> ::std::string::String {
            #aggregate_id
        }

        #partition_key
        #event_id
    }
}

/// The methods for an enum: one match arm per variant, binding the field the
/// method needs by reference.
fn enum_body(variants: &[Event], default_version: u32) -> TokenStream {
    // The field a method needs, bound by reference; spanned at the field so
    // that errors about its type point there.
    let binding = |field: &Field| Ident::new("__outbox_field", field.span());
    // `Self::V { member: ref __outbox_field, .. }`, also valid for tuple variants.
    let bind = |event: &Event, field: &Field| {
        let variant = event.ident;
        let member = &field.member;
        let binding = binding(field);
        quote!(Self::#variant { #member: ref #binding, .. })
    };

    let event_type_arms = variants.iter().map(|event| {
        let variant = event.ident;
        let event_type = event.event_type();
        quote!(Self::#variant { .. } => #event_type,)
    });
    let version_arms = variants.iter().map(|event| {
        let variant = event.ident;
        let version = event.version(default_version);
        quote!(Self::#variant { .. } => #version,)
    });
    let aggregate_id_arms = variants.iter().filter_map(|event| {
        let field = event.aggregate_id()?;
        let pat = bind(event, field);
        let key = key_string(field, binding(field).into_token_stream());
        Some(quote!(#pat => #key,))
    });

    let partition_key = variants
        .iter()
        .any(|e| e.partition_key().is_some())
        .then(|| {
            let arms = variants.iter().filter_map(|event| {
                let field = event.partition_key().or_else(|| event.aggregate_id())?;
                let pat = bind(event, field);
                let key = key_string(field, binding(field).into_token_stream());
                Some(quote!(#pat => #key,))
            });
            quote! {
                fn partition_key(&self) -> ::std::string::String {
                    match *self {
                        #(#arms)*
                    }
                }
            }
        });

    let event_id = variants.iter().any(|e| e.event_id().is_some()).then(|| {
        let arms = variants.iter().map(|event| match event.event_id() {
            Some(field) => {
                let pat = bind(event, field);
                let id = event_id(field, binding(field).into_token_stream());
                quote!(#pat => #id,)
            }
            None => {
                let variant = event.ident;
                quote!(Self::#variant { .. } => ::core::option::Option::None,)
            }
        });
        quote! {
            fn event_id(&self) -> ::core::option::Option<::outbox::__private::Uuid> {
                match *self {
                    #(#arms)*
                }
            }
        }
    });

    quote! {
        fn event_type(&self) -> &'static str {
            match *self {
                #(#event_type_arms)*
            }
        }

        fn event_version(&self) -> u32 {
            match *self {
                #(#version_arms)*
            }
        }

        fn aggregate_id(&self) -> ::std::string::String {
            match *self {
                #(#aggregate_id_arms)*
            }
        }

        #partition_key
        #event_id
    }
}

/// The text of a key field (`place` is a reference to it), spanned at the
/// field so a type without `Display` is reported there.
fn key_string(field: &Field, place: TokenStream) -> TokenStream {
    quote_spanned!(field.span()=> ::outbox::__private::key_string(#place))
}

/// The event id read from a `Uuid` field (`place` is a reference to it),
/// spanned at the field so a field of another type is reported there.
fn event_id(field: &Field, place: TokenStream) -> TokenStream {
    quote_spanned! {field.span()=>
        {
            let id: &::outbox::__private::Uuid = #place;
            ::core::option::Option::Some(*id)
        }
    }
}

/// The errors, and a stub impl so that code using the type as a
/// `DomainEvent` does not add errors of its own.
fn fallback(input: &DeriveInput, err: syn::Error) -> TokenStream {
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let impl_header = quote_spanned! {ident.span()=>
        impl #impl_generics ::outbox::DomainEvent for #ident #ty_generics #where_clause
    };
    let err = err.into_compile_error();

    quote! {
        #err

        const _: () = {
            #[automatically_derived]
            #impl_header {
                const TOPIC: &'static str = "";
                const AGGREGATE_TYPE: &'static str = "";
                const EVENT_TYPES: &'static [&'static str] = &[];

                fn event_type(&self) -> &'static str {
                    ::core::unreachable!()
                }

                fn event_version(&self) -> u32 {
                    ::core::unreachable!()
                }

                fn aggregate_id(&self) -> ::std::string::String {
                    ::core::unreachable!()
                }
            }
        };
    }
}
