//! The OpenAPI document as `/openapi.json` serves it: utoipa's derive, then every error answer an
//! operation can give declared, and every constraint the server enforces stated — with this daemon's
//! own bounds (`--max-timeout`, the host's cores, memory, open files and disk) — so that a client, or a
//! fuzzer, that reads the document is held to exactly what the server checks (docs/api.md).

use serde_json::{json, Map, Value};
use utoipa::OpenApi;

use crate::sandboxes::{Bounds, MAX_FORKS};

/// Template and snapshot names (`moat_api::validate_template_name`).
const NAME: &str = "^[a-z0-9][a-z0-9._-]{0,62}$";
/// Process tags and pids (`moat_api::ProcessSelector`).
const PROCESS: &str = "^[A-Za-z0-9._-]{1,64}$";
/// Code context ids (`moat_api::validate_context_id`).
const CONTEXT: &str = "^[A-Za-z0-9_-]{1,48}$";
/// A string without NUL bytes (paths, arguments, environment values).
const NO_NUL: &str = "^[^\\x00]*$";
/// An environment variable name: not empty, no `=`, no NUL.
const ENV_NAME: &str = "^[^=\\x00]+$";

/// The document served at `/openapi.json` for a daemon with these bounds.
pub(super) fn document(b: &Bounds) -> Value {
    let mut doc = serde_json::to_value(super::ApiDoc::openapi()).unwrap_or_default();
    declare_errors(&mut doc);
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
    {
        for (schema, field, c) in field_constraints(b) {
            let target = match field {
                Some(f) => schemas
                    .get_mut(schema)
                    .and_then(|s| s.get_mut("properties"))
                    .and_then(|p| p.get_mut(f)),
                None => schemas.get_mut(schema),
            };
            if let Some(t) = target {
                merge(t, c);
            }
        }
    }
    // Bodies that may be empty: an empty file, no bytes for stdin.
    for (path, method) in [
        ("/v1/sandboxes/{id}/files", "put"),
        ("/v1/sandboxes/{id}/processes/{process}/stdin", "post"),
    ] {
        if let Some(body) = doc
            .get_mut("paths")
            .and_then(|p| p.get_mut(path))
            .and_then(|i| i.get_mut(method))
            .and_then(|o| o.get_mut("requestBody"))
            .and_then(Value::as_object_mut)
        {
            body.insert("required".into(), Value::Bool(false));
        }
    }
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, item) in paths.iter_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for op in item.values_mut() {
                let Some(params) = op.get_mut("parameters").and_then(Value::as_array_mut) else {
                    continue;
                };
                for p in params {
                    let name = p.get("name").and_then(Value::as_str).unwrap_or_default();
                    let place = p.get("in").and_then(Value::as_str).unwrap_or_default();
                    if let Some(c) = parameter_constraint(path, place, name) {
                        if let Some(s) = p.get_mut("schema") {
                            merge(s, c);
                        }
                    }
                }
            }
        }
    }
    doc
}

/// The operations that take new space on the host's disk, refused with 507 while it is low.
const MAKES_SOMETHING: [&str; 6] = [
    "/v1/sandboxes",
    "/v1/sandboxes/{id}/snapshots",
    "/v1/snapshots/{id}/fork",
    "/v1/templates",
    "/v1/templates/{name}/build",
    "/v1/templates/{name}/pull",
];

/// Adds the error answers utoipa's derive does not list: every keyed operation may answer 400 (a
/// value the server refuses), 401 (no or a wrong key), 500 and 503 (a host that is full or lacks a
/// facility); one with a path parameter 404 (no such object) and 409 (its state refuses the
/// operation), as does every change; one with a body 413; and what a sandbox's agent answers (403
/// for the sandbox's own permissions, 504 when it does not answer in time). Each is an `ErrorBody`.
fn declare_errors(doc: &mut Value) {
    let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for (method, op) in item.iter_mut() {
            let public = op
                .get("security")
                .and_then(Value::as_array)
                .is_some_and(|s| s.iter().all(|r| r.as_object().is_some_and(Map::is_empty)));
            if public {
                continue; // /healthz: no key, no errors of its own
            }
            let has_param = path.contains('{');
            let mut codes = vec![
                ("400", "A value the server refuses; `field` names it"),
                ("401", "The API key is missing or wrong"),
                (
                    "500",
                    "A failure of the host (the message says what failed)",
                ),
                (
                    "503",
                    "The host is full, or lacks what the request needs (an isolation tier)",
                ),
            ];
            if has_param {
                codes.push(("404", "No such object"));
            }
            if has_param || method != "get" {
                codes.push(("409", "The object's state does not allow this"));
            }
            if op.get("requestBody").is_some() {
                codes.push((
                    "413",
                    "The body is larger than the limit (or the sandbox's disk)",
                ));
            }
            if method == "post" && MAKES_SOMETHING.contains(&path.as_str()) {
                codes.push((
                    "507",
                    "The host's disk is down to its reserve: nothing new is made",
                ));
            }
            if path.starts_with("/v1/sandboxes/{id}/") {
                codes.push(("403", "The sandbox's own permissions refuse the operation"));
                codes.push(("504", "The sandbox did not answer in time"));
            }
            let Some(responses) = op
                .as_object_mut()
                .map(|o| o.entry("responses").or_insert_with(|| json!({})))
                .and_then(Value::as_object_mut)
            else {
                continue;
            };
            for (code, description) in codes {
                responses.entry(code).or_insert_with(|| {
                    json!({
                        "description": description,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
                    })
                });
            }
        }
    }
}

/// What the server checks of each request field, as JSON Schema: (schema, property or `None` for
/// the whole schema, constraint).
fn field_constraints(b: &Bounds) -> Vec<(&'static str, Option<&'static str>, Value)> {
    let timeout = json!({"minimum": 1, "maximum": b.max_timeout});
    let metadata = json!({
        "maxProperties": 64,
        "propertyNames": {"minLength": 1, "maxLength": 128, "pattern": "^[^=]*$"},
        "additionalProperties": {"maxLength": 1024},
    });
    let env = json!({
        "maxProperties": 1000,
        "propertyNames": {"maxLength": 4096, "pattern": ENV_NAME},
        "additionalProperties": {"maxLength": 128 * 1024, "pattern": NO_NUL},
    });
    let name = json!({"pattern": NAME});
    let path = json!({"minLength": 1, "pattern": NO_NUL});
    let zero_or = |min: u64, max: u64| json!({"minimum": 0, "maximum": max, "anyOf": [{"maximum": 0}, {"minimum": min}]});
    let c = "CreateSandboxRequest";
    vec![
        (c, Some("timeout"), timeout.clone()),
        (c, Some("template"), name.clone()),
        (c, Some("cpu"), json!({"minimum": 0.01, "maximum": b.cpus})),
        (
            c,
            Some("memory_mb"),
            json!({"minimum": 16, "maximum": b.memory_mb}),
        ),
        (
            c,
            Some("pids"),
            json!({"minimum": 16, "maximum": 4_194_304}),
        ),
        (
            c,
            Some("nofile"),
            json!({"minimum": 16, "maximum": b.nofile}),
        ),
        (c, Some("disk_mb"), zero_or(16, b.disk_mb)),
        (c, Some("disk_inodes"), zero_or(1024, u64::from(u32::MAX))),
        (
            c,
            Some("tmp_mb"),
            json!({"minimum": 0, "maximum": b.memory_mb}),
        ),
        (
            c,
            Some("output_bytes"),
            json!({"minimum": 64 << 10, "maximum": 256u64 << 20}),
        ),
        (
            c,
            Some("command_timeout"),
            json!({"minimum": 0, "maximum": b.max_timeout}),
        ),
        (
            c,
            Some("idle_timeout"),
            json!({"minimum": 0, "maximum": b.max_timeout}),
        ),
        (c, Some("env"), env.clone()),
        (c, Some("metadata"), metadata.clone()),
        ("SetTimeoutRequest", Some("timeout"), timeout.clone()),
        ("ResumeRequest", Some("timeout"), timeout.clone()),
        ("ForkRequest", Some("timeout"), timeout),
        (
            "ForkRequest",
            Some("count"),
            json!({"minimum": 1, "maximum": MAX_FORKS}),
        ),
        ("ForkRequest", Some("metadata"), metadata.clone()),
        ("ForkRequest", Some("env"), env.clone()),
        (
            "CreateSnapshotRequest",
            Some("name"),
            json!({"pattern": NAME, "not": {"type": "string", "pattern": "^snap_"}}),
        ),
        ("CreateSnapshotRequest", Some("metadata"), metadata),
        ("RegisterTemplateRequest", Some("name"), name),
        (
            "RegisterTemplateRequest",
            Some("path"),
            json!({"pattern": "^/[^\\x00]*$"}),
        ),
        ("RunCodeRequest", Some("code"), json!({"pattern": "\\S"})),
        (
            "RunCodeRequest",
            Some("timeout"),
            json!({"exclusiveMinimum": 0, "maximum": 86_400}),
        ),
        (
            "RunCodeRequest",
            Some("context_id"),
            json!({"pattern": CONTEXT}),
        ),
        (
            "RunCodeRequest",
            Some("env"),
            json!({"propertyNames": {"pattern": ENV_NAME}}),
        ),
        ("MkdirRequest", Some("path"), path.clone()),
        ("RenameRequest", Some("from"), path.clone()),
        ("RenameRequest", Some("to"), path),
        (
            "StartProcessRequest",
            Some("tag"),
            json!({"maxLength": 64, "pattern": "^[A-Za-z0-9._-]*[A-Za-z._-][A-Za-z0-9._-]*$"}),
        ),
        (
            "StartProcessRequest",
            Some("timeout"),
            json!({"minimum": 0}),
        ),
        (
            "StartProcessRequest",
            Some("cmd"),
            json!({"minItems": 1, "items": {"pattern": NO_NUL}}),
        ),
        (
            "StartProcessRequest",
            Some("command"),
            json!({"pattern": NO_NUL}),
        ),
        (
            "StartProcessRequest",
            Some("env"),
            json!({"propertyNames": {"pattern": ENV_NAME}, "additionalProperties": {"pattern": NO_NUL}}),
        ),
        (
            "PtySize",
            Some("cols"),
            json!({"minimum": 1, "maximum": u16::MAX}),
        ),
        (
            "PtySize",
            Some("rows"),
            json!({"minimum": 1, "maximum": u16::MAX}),
        ),
        (
            "NetworkPolicy",
            Some("egress_mbps"),
            json!({"minimum": 1, "maximum": 100_000}),
        ),
        (
            "NetworkPolicy",
            Some("connections_per_second"),
            json!({"minimum": 1, "maximum": 100_000}),
        ),
        (
            "NetworkPolicy",
            Some("allow_out"),
            json!({"maxItems": 1000}),
        ),
        ("NetworkPolicy", Some("deny_out"), json!({"maxItems": 1000})),
    ]
}

/// What the server checks of a path or query parameter.
fn parameter_constraint(path: &str, place: &str, name: &str) -> Option<Value> {
    match (place, name) {
        ("path", "name") => Some(json!({"pattern": NAME})),
        ("path", "context") => Some(json!({"pattern": CONTEXT})),
        ("path", "process") => Some(json!({"pattern": PROCESS})),
        ("query", "path") => Some(json!({"minLength": 1, "pattern": NO_NUL})),
        ("query", "depth") => Some(json!({"minimum": 1, "maximum": 32})),
        ("query", "mode") => Some(json!({"pattern": "^(0o)*\\+?0*[0-7]{1,4}$"})),
        ("query", "since" | "until") => Some(json!({
            "anyOf": [{"pattern": "^-?[0-9]{1,18}$"}, {"format": "date-time"}],
        })),
        ("query", "state") if path == "/v1/sandboxes" => {
            Some(json!({"enum": ["starting", "running", "paused", "stopping"]}))
        }
        ("query", "metadata") if path == "/v1/sandboxes" => {
            Some(json!({"items": {"pattern": "^[^=]*=.*$"}}))
        }
        _ => None,
    }
}

/// `c`'s keys set on `target` (an object schema); an object value (`propertyNames`, `items`, ...)
/// is merged into the one already there, key by key.
fn merge(target: &mut Value, c: Value) {
    let (Some(t), Value::Object(c)) = (target.as_object_mut(), c) else {
        return;
    };
    for (k, v) in c {
        match (t.get_mut(&k), v) {
            (Some(Value::Object(old)), Value::Object(new)) => {
                for (k2, v2) in new {
                    old.insert(k2, v2);
                }
            }
            (_, v) => {
                t.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> Bounds {
        Bounds {
            max_timeout: 7200,
            cpus: 2.0,
            memory_mb: 4096,
            nofile: 4096,
            disk_mb: 10_000,
        }
    }

    fn operations(doc: &Value) -> Vec<(String, String, Value)> {
        let mut out = Vec::new();
        for (path, item) in doc["paths"].as_object().into_iter().flatten() {
            for (method, op) in item.as_object().into_iter().flatten() {
                out.push((path.clone(), method.clone(), op.clone()));
            }
        }
        out
    }

    #[test]
    fn path_parameters_are_the_paths_and_the_rest_are_queries_or_named_headers() {
        let doc = document(&bounds());
        for (path, method, op) in operations(&doc) {
            for p in op["parameters"].as_array().into_iter().flatten() {
                let name = p["name"].as_str().unwrap_or_default();
                let in_path = path.contains(&format!("{{{name}}}"));
                let place = p["in"].as_str().unwrap_or_default();
                // Headers are declared only where the API reads one (an idempotent create).
                let header = name == crate::sandboxes::IDEMPOTENCY_KEY;
                assert_eq!(
                    place,
                    match (in_path, header) {
                        (true, _) => "path",
                        (false, true) => "header",
                        (false, false) => "query",
                    },
                    "{method} {path}: parameter {name}"
                );
            }
            // And every `{x}` of the path is declared.
            for seg in path.split('/').filter(|s| s.starts_with('{')) {
                let name = seg.trim_matches(|c| c == '{' || c == '}');
                assert!(
                    op["parameters"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|p| p["name"] == name && p["in"] == "path"),
                    "{method} {path}: {name} undeclared"
                );
            }
        }
    }

    #[test]
    fn every_keyed_operation_declares_its_errors() {
        let doc = document(&bounds());
        let ops = operations(&doc);
        assert!(ops.len() > 50, "{}", ops.len());
        for (path, method, op) in ops {
            let r = &op["responses"];
            if path == "/healthz" {
                assert!(r.get("401").is_none());
                continue;
            }
            for code in ["400", "401", "500", "503"] {
                assert_eq!(
                    r[code]["content"]["application/json"]["schema"]["$ref"],
                    "#/components/schemas/ErrorBody",
                    "{method} {path}: {code}"
                );
            }
            if path.contains('{') {
                assert!(r.get("404").is_some(), "{method} {path}: 404");
            }
            if path.starts_with("/v1/sandboxes/{id}/") {
                assert!(r.get("504").is_some(), "{method} {path}: 504");
            }
        }
        // What utoipa's derive declared stays.
        assert!(doc["paths"]["/v1/sandboxes"]["post"]["responses"]["201"].is_object());
        // Every path that makes something exists and may answer 507; a read never does.
        for path in MAKES_SOMETHING {
            assert!(
                doc["paths"][path]["post"]["responses"]["507"].is_object(),
                "{path}"
            );
        }
        assert!(doc["paths"]["/v1/sandboxes"]["get"]["responses"]
            .get("507")
            .is_none());
    }

    #[test]
    fn every_constraint_names_a_field_that_exists() {
        let raw = serde_json::to_value(super::super::ApiDoc::openapi()).unwrap_or_default();
        let schemas = &raw["components"]["schemas"];
        for (schema, field, _) in field_constraints(&bounds()) {
            let s = &schemas[schema];
            assert!(s.is_object(), "no schema {schema}");
            if let Some(f) = field {
                assert!(s["properties"][f].is_object(), "no field {schema}.{f}");
            }
        }
    }

    #[test]
    fn constraints_carry_the_daemons_bounds() {
        let doc = document(&bounds());
        let s = &doc["components"]["schemas"];
        let t = &s["SetTimeoutRequest"]["properties"]["timeout"];
        assert_eq!(t["minimum"], 1);
        assert_eq!(t["maximum"], 7200);
        assert_eq!(
            s["CreateSandboxRequest"]["properties"]["memory_mb"]["maximum"],
            4096
        );
        assert_eq!(
            s["CreateSandboxRequest"]["properties"]["metadata"]["maxProperties"],
            64
        );
        assert_eq!(
            s["ForkRequest"]["properties"]["count"]["maximum"],
            MAX_FORKS
        );
        let list = &doc["paths"]["/v1/sandboxes"]["get"]["parameters"];
        let state = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == "state")
            .map(|p| p["schema"]["enum"].clone());
        assert_eq!(
            state,
            Some(json!(["starting", "running", "paused", "stopping"]))
        );
    }

    #[test]
    fn merging_keeps_what_was_there() {
        let mut t = json!({"type": "integer", "additionalProperties": {"type": "string"}});
        merge(
            &mut t,
            json!({"minimum": 1, "additionalProperties": {"maxLength": 3}}),
        );
        assert_eq!(
            t,
            json!({"type": "integer", "minimum": 1, "additionalProperties": {"type": "string", "maxLength": 3}})
        );
    }
}
