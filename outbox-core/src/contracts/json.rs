//! JSON helpers of the contracts: a canonical key order for files that diff
//! well, and moving a schema's `$ref`s when it is embedded in another
//! document.

use serde_json::{Map, Value};

/// `value` with every object's keys in sorted order, whatever the map type
/// `serde_json` was built with.
pub(crate) fn canonical(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonical(v)))
                    .collect::<Map<String, Value>>(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(canonical).collect()),
        other => other,
    }
}

/// Pretty JSON text of `value` in canonical order, ending with a newline.
pub(crate) fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(&canonical(value.clone()))
        .unwrap_or_else(|_| String::from("null"));
    text.push('\n');
    text
}

/// Rewrites the document-local references of `schema` (`#/...`) so that they
/// resolve once the schema sits at the JSON pointer `at` of another document;
/// drops `$schema`, which only a document's root may carry.
pub(crate) fn embed(mut schema: Value, at: &str) -> Value {
    fn walk(value: &mut Value, at: &str) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(reference)) = map.get_mut("$ref")
                    && let Some(rest) = reference.strip_prefix('#')
                {
                    *reference = format!("#{at}{rest}");
                }
                for (key, child) in map.iter_mut() {
                    // `const`, `enum`, `default` and `examples` hold data,
                    // not schemas.
                    if !matches!(key.as_str(), "const" | "enum" | "default" | "examples") {
                        walk(child, at);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, at)),
            _ => {}
        }
    }
    if let Value::Object(map) = &mut schema {
        map.remove("$schema");
    }
    walk(&mut schema, at);
    schema
}

/// Escapes a JSON pointer segment (`~` and `/`).
pub(crate) fn pointer_segment(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn embed_moves_local_refs_and_leaves_data_alone() {
        let schema = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "properties": {
                "a": {"$ref": "#/$defs/A"},
                "b": {"const": {"$ref": "#/not-a-ref"}}
            },
            "$defs": {"A": {"items": {"$ref": "#/$defs/A"}}}
        });
        let embedded = embed(schema, "/$defs/x.v1");
        assert_eq!(embedded.get("$schema"), None);
        assert_eq!(embedded["properties"]["a"]["$ref"], "#/$defs/x.v1/$defs/A");
        assert_eq!(
            embedded["$defs"]["A"]["items"]["$ref"],
            "#/$defs/x.v1/$defs/A"
        );
        assert_eq!(embedded["properties"]["b"]["const"]["$ref"], "#/not-a-ref");
    }

    #[test]
    fn pretty_sorts_keys() {
        let text = pretty(&json!({"b": 1, "a": {"d": 1, "c": 2}}));
        assert!(text.find("\"a\"").unwrap() < text.find("\"b\"").unwrap());
        assert!(text.find("\"c\"").unwrap() < text.find("\"d\"").unwrap());
        assert!(text.ends_with("}\n"));
    }
}
