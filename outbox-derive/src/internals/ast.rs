//! The typed form of a `#[derive(DomainEvent)]` input: the container, its
//! event types (the struct itself, or each variant) and their fields, with
//! their parsed attributes and the syn nodes they came from (for spans).

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Data as SynData, DeriveInput, Fields, Generics, Ident, Member, Type};

use crate::internals::Ctxt;
use crate::internals::attr;

/// The type deriving `DomainEvent`.
pub struct Container<'a> {
    /// The type's name.
    pub ident: &'a Ident,
    /// Its generics, passed through to the impl.
    pub generics: &'a Generics,
    /// `#[event(...)]` on the type.
    pub attrs: attr::Container,
    /// The event types it carries.
    pub data: Data<'a>,
}

/// The event types a container carries.
pub enum Data<'a> {
    /// A struct: one event type.
    Struct(Event<'a>),
    /// An enum: one event type per variant.
    Enum(Vec<Event<'a>>),
}

/// One event type: a struct, or one variant of an enum.
pub struct Event<'a> {
    /// The struct's or the variant's name.
    pub ident: &'a Ident,
    /// Its event type and version; for a struct, those of the container.
    pub attrs: attr::Variant,
    /// Its fields.
    pub fields: Vec<Field<'a>>,
}

/// One field of an event type.
pub struct Field<'a> {
    /// How the field is named in expressions and patterns (`id` or `0`).
    pub member: Member,
    /// Its roles.
    pub attrs: attr::Field,
    /// Its type.
    pub ty: &'a Type,
}

impl<'a> Container<'a> {
    /// Reads `input`; `None` (with an error in `cx`) for a union.
    pub fn from_ast(cx: &Ctxt, input: &'a DeriveInput) -> Option<Self> {
        let attrs = attr::Container::from_ast(cx, &input.attrs);
        let data = match &input.data {
            SynData::Struct(data) => {
                let event_attrs = attr::Variant {
                    event_type: attrs.event_type.as_ref().map(|(_, lit)| lit.clone()),
                    version: attrs.version,
                };
                Data::Struct(Event::from_fields(
                    cx,
                    &input.ident,
                    event_attrs,
                    &data.fields,
                ))
            }
            SynData::Enum(data) => Data::Enum(
                data.variants
                    .iter()
                    .map(|variant| {
                        let event_attrs = attr::Variant::from_ast(cx, &variant.attrs);
                        Event::from_fields(cx, &variant.ident, event_attrs, &variant.fields)
                    })
                    .collect(),
            ),
            SynData::Union(data) => {
                cx.error_spanned_by(
                    data.union_token,
                    "a DomainEvent must be a struct or an enum, not a union",
                );
                return None;
            }
        };
        Some(Container {
            ident: &input.ident,
            generics: &input.generics,
            attrs,
            data,
        })
    }

    /// The event types, in declaration order.
    pub fn events(&self) -> &[Event<'a>] {
        match &self.data {
            Data::Struct(event) => std::slice::from_ref(event),
            Data::Enum(variants) => variants,
        }
    }

    /// Whether the container is an enum (each variant an event type).
    pub fn is_enum(&self) -> bool {
        matches!(self.data, Data::Enum(_))
    }

    /// The topic, `""` when missing (reported by the check).
    pub fn topic(&self) -> String {
        self.attrs
            .topic
            .as_ref()
            .map(|lit| lit.value())
            .unwrap_or_default()
    }

    /// The aggregate type: as declared, or else the topic.
    pub fn aggregate_type(&self) -> String {
        match &self.attrs.aggregate_type {
            Some(lit) => lit.value(),
            None => self.topic(),
        }
    }

    /// The version of events that do not declare one: the container's, or 1.
    pub fn default_version(&self) -> u32 {
        self.attrs.version.unwrap_or(1)
    }
}

impl<'a> Event<'a> {
    fn from_fields(cx: &Ctxt, ident: &'a Ident, attrs: attr::Variant, fields: &'a Fields) -> Self {
        let fields = fields
            .iter()
            .enumerate()
            .map(|(i, field)| Field {
                member: match &field.ident {
                    Some(ident) => Member::Named(ident.clone()),
                    None => Member::Unnamed(syn::Index {
                        index: i as u32,
                        span: field.ty.span(),
                    }),
                },
                attrs: attr::Field::from_ast(cx, &field.attrs),
                ty: &field.ty,
            })
            .collect();
        Event {
            ident,
            attrs,
            fields,
        }
    }

    /// The event type name: as declared, or else the struct's or variant's name.
    pub fn event_type(&self) -> String {
        match &self.attrs.event_type {
            Some(lit) => lit.value(),
            None => self.ident.unraw().to_string(),
        }
    }

    /// Where to point at the event type: its literal, or else the name.
    pub fn event_type_span(&self) -> Span {
        match &self.attrs.event_type {
            Some(lit) => lit.span(),
            None => self.ident.span(),
        }
    }

    /// The schema version: as declared, or else `default`.
    pub fn version(&self, default: u32) -> u32 {
        self.attrs.version.unwrap_or(default)
    }

    /// The field marked `#[event(aggregate_id)]` (the first, if several).
    pub fn aggregate_id(&self) -> Option<&Field<'a>> {
        self.fields.iter().find(|f| f.attrs.aggregate_id.is_some())
    }

    /// The field marked `#[event(partition_key)]` (the first, if several).
    pub fn partition_key(&self) -> Option<&Field<'a>> {
        self.fields.iter().find(|f| f.attrs.partition_key.is_some())
    }

    /// The field marked `#[event(event_id)]` (the first, if several).
    pub fn event_id(&self) -> Option<&Field<'a>> {
        self.fields.iter().find(|f| f.attrs.event_id.is_some())
    }
}

impl Field<'_> {
    /// How to name the field in a message: `order_id`, or `0` for a tuple field.
    pub fn name(&self) -> String {
        match &self.member {
            Member::Named(ident) => ident.unraw().to_string(),
            Member::Unnamed(index) => index.index.to_string(),
        }
    }

    /// Where errors about the field's type point: its name, or its type for
    /// a tuple field.
    pub fn span(&self) -> Span {
        match &self.member {
            Member::Named(ident) => ident.span(),
            Member::Unnamed(_) => self.ty.span(),
        }
    }
}
