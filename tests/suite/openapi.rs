//! The OpenAPI document: `GET /openapi.json` serves an OpenAPI 3.1 description, generated from the
//! code, of every route the router has and every status each can answer; and schemathesis,
//! fuzzing a live replica from that document, finds no server error and no response (status,
//! content type, body or header) that breaks it.

use crate::support::app::spawn_app;
use crate::support::fleet::{Fleet, audit};
use crate::support::{TOKEN, TestEnv};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const POST_STATUSES: &[&str] = &["200", "400", "401", "404", "409", "413", "415", "422", "503"];
const GET_STATUSES: &[&str] = &["200", "400", "401", "404", "503"];

/// Every route the router serves, and every status it can answer there (a 500 is a bug, and a 429
/// comes from nginx, not the replica).
const ROUTES: &[(&str, &str, &[&str])] = &[
    ("post", "/wallets", &["201", "400", "401", "409", "413", "415", "422", "503"]),
    ("get", "/wallets/{id}", GET_STATUSES),
    ("post", "/wallets/{id}/deposit", POST_STATUSES),
    ("post", "/wallets/{id}/pay", POST_STATUSES),
    ("get", "/wallets/{id}/transactions", GET_STATUSES),
    ("get", "/wallets/{id}/entries", GET_STATUSES),
    ("get", "/wallets/{id}/balance", GET_STATUSES),
    ("get", "/wallets/{id}/statement", GET_STATUSES),
    ("post", "/wallets/{id}/refunds", POST_STATUSES),
    ("post", "/transfers", POST_STATUSES),
    ("get", "/transfers/{id}", GET_STATUSES),
    ("post", "/transfers/{id}/refund", POST_STATUSES),
    ("post", "/movements", &["201", "400", "401", "404", "409", "413", "415", "422", "503"]),
    ("get", "/movements/{id}", GET_STATUSES),
    ("post", "/movements/{id}/capture", POST_STATUSES),
    ("post", "/movements/{id}/void", &["200", "400", "401", "404", "409", "422", "503"]),
    ("post", "/movements/{id}/refund", &["201", "400", "401", "404", "409", "413", "415", "422", "503"]),
    ("post", "/wallets/{id}/holds", &["201", "400", "401", "404", "409", "413", "415", "422", "503"]),
    ("get", "/holds/{id}", GET_STATUSES),
    ("post", "/wallets/{id}/monitors", &["201", "400", "401", "404", "409", "413", "415", "422", "503"]),
    ("delete", "/wallets/{id}/monitors/{side}/{amount}", &["200", "400", "401", "404", "409", "422", "503"]),
    ("put", "/wallets/{id}/limits", POST_STATUSES),
    ("get", "/wallets/{id}/limits", GET_STATUSES),
    ("post", "/holds/{id}/capture", POST_STATUSES),
    ("post", "/holds/{id}/void", &["200", "400", "401", "404", "409", "422", "503"]),
    ("post", "/batches", &["200", "400", "401", "413", "415", "503"]),
    ("get", "/events", GET_STATUSES),
    ("post", "/webhook-endpoints", &["201", "400", "401", "404", "413", "415", "503"]),
    ("get", "/webhook-endpoints", &["200", "401", "503"]),
    ("get", "/webhook-endpoints/{id}", GET_STATUSES),
    ("put", "/webhook-endpoints/{id}", &["200", "400", "401", "404", "413", "415", "503"]),
    ("delete", "/webhook-endpoints/{id}", &["204", "400", "401", "404", "503"]),
    ("post", "/webhook-endpoints/{id}/rotate-secret", &["200", "400", "401", "404", "503"]),
    ("post", "/webhook-endpoints/{id}/replay", &["200", "400", "401", "404", "413", "415", "503"]),
    ("get", "/webhook-endpoints/{id}/attempts", GET_STATUSES),
    ("get", "/healthz", &["200"]),
    ("get", "/readyz", &["200", "503"]),
    ("get", "/metrics", &["200"]),
    ("get", "/openapi.json", &["200"]),
];

fn operation<'a>(doc: &'a Value, method: &str, path: &str) -> &'a Value {
    let operation = &doc["paths"][path][method];
    assert!(operation.is_object(), "{method} {path} is not documented");
    operation
}

fn parameter<'a>(operation: &'a Value, name: &str) -> &'a Value {
    operation["parameters"]
        .as_array()
        .and_then(|params| params.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no parameter {name} in {operation}"))
}

fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    let schema = &doc["components"]["schemas"][name];
    assert!(schema.is_object(), "no schema {name}");
    schema
}

#[tokio::test]
async fn the_document_describes_every_route_and_status() {
    let env = TestEnv::new();
    let app = spawn_app(&env).await;

    // Served without a token, as JSON, OpenAPI 3.1.
    let response = reqwest::get(app.url("/openapi.json")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let doc: Value = response.json().await.unwrap();
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1.")), "{}", doc["openapi"]);
    assert_eq!(doc["info"]["title"], "walletlock");

    // Exactly the router's routes, each with exactly the statuses it can answer.
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| item.as_object().unwrap().keys().map(move |m| (m.clone(), path.clone())))
        .collect();
    let expected: BTreeSet<(String, String)> =
        ROUTES.iter().map(|(m, p, _)| (m.to_string(), p.to_string())).collect();
    assert_eq!(documented, expected);
    for (method, path, statuses) in ROUTES {
        let responses = operation(&doc, method, path)["responses"].as_object().unwrap();
        let documented: Vec<&str> = responses.keys().map(String::as_str).collect();
        assert_eq!(documented, *statuses, "{method} {path}");
        for (status, response) in responses {
            for header in ["X-Request-Id", "X-Served-By"] {
                assert_eq!(
                    response["headers"][header]["required"], true,
                    "{method} {path} {status} {header}"
                );
            }
            // Every answer has a body but a deletion's.
            let Some(content) = response["content"].as_object() else {
                assert_eq!((*method, status.as_str()), ("delete", "204"), "{path}");
                continue;
            };
            if status.starts_with(['4', '5'])
                && ["/wallets", "/transfers", "/movements"].iter().any(|prefix| path.starts_with(prefix))
            {
                assert_eq!(
                    content["application/problem+json"]["schema"]["$ref"], "#/components/schemas/Problem",
                    "{method} {path} {status}"
                );
            }
        }
    }

    // The router agrees: every documented operation is routed, and every other method on a
    // documented path is a 405.
    let client = app.client.clone();
    for path in expected.iter().map(|(_, p)| p).collect::<BTreeSet<_>>() {
        let url = app.url(&path.replace("{id}", "no-such-wallet"));
        for method in ["get", "post", "put", "patch", "delete"] {
            let response = client
                .request(method.to_uppercase().parse().unwrap(), &url)
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if expected.contains(&(method.to_owned(), path.clone())) {
                assert!(
                    status != 405 && body["code"] != "not_found",
                    "{method} {path} is not routed: {status}"
                );
            } else {
                assert_eq!((status, &body["code"]), (405, &json!("method_not_allowed")), "{method} {path}");
            }
        }
    }

    // A bearer token on the /wallets, /transfers, /movements, /holds, /batches and /events
    // operations only.
    assert_eq!(doc["components"]["securitySchemes"]["bearer"], json!({ "type": "http", "scheme": "bearer" }));
    for (method, path, _) in ROUTES {
        let security = &operation(&doc, method, path)["security"];
        if ["/wallets", "/transfers", "/movements", "/holds", "/batches", "/events", "/webhook-endpoints"]
            .iter()
            .any(|api| path.starts_with(api))
        {
            assert_eq!(*security, json!([{ "bearer": [] }]), "{method} {path}");
            let unauthorized = &operation(&doc, method, path)["responses"]["401"];
            assert_eq!(unauthorized["headers"]["WWW-Authenticate"]["required"], true, "{method} {path}");
            let unavailable = &operation(&doc, method, path)["responses"]["503"];
            assert_eq!(unavailable["headers"]["Retry-After"]["required"], true, "{method} {path}");
        } else {
            assert!(security.is_null(), "{method} {path} needs no token");
        }
    }

    // Parameters and their rules.
    for (method, path, _) in ROUTES.iter().filter(|(_, p, _)| p.contains("{id}")) {
        let id = parameter(operation(&doc, method, path), "id");
        assert_eq!(id["in"], "path");
        if ["/transfers", "/movements", "/holds", "/webhook-endpoints"]
            .iter()
            .any(|prefix| path.starts_with(prefix))
        {
            assert_eq!(id["schema"]["format"], "uuid", "{method} {path}");
        } else {
            assert_eq!(id["schema"]["pattern"], "^[A-Za-z0-9_-]{1,64}$", "{method} {path}");
        }
    }
    for path in [
        "/wallets",
        "/wallets/{id}/deposit",
        "/wallets/{id}/pay",
        "/wallets/{id}/refunds",
        "/transfers",
        "/transfers/{id}/refund",
    ] {
        let post = operation(&doc, "post", path);
        let key = parameter(post, "Idempotency-Key");
        assert_eq!((&key["in"], &key["required"]), (&json!("header"), &json!(false)), "{path}");
        assert_eq!((&key["schema"]["minLength"], &key["schema"]["maxLength"]), (&json!(1), &json!(255)));
        let replayed = &post["responses"][if path == "/wallets" { "201" } else { "200" }]["headers"];
        assert!(replayed["Idempotent-Replayed"].is_object(), "{path}");
    }
    let page = operation(&doc, "get", "/wallets/{id}/transactions");
    let limit = &parameter(page, "limit")["schema"];
    assert_eq!((&limit["minimum"], &limit["maximum"]), (&json!(1), &json!(500)));
    assert_eq!(parameter(page, "before")["schema"]["type"], "string");

    // Bodies: unknown fields refused, amounts bounded.
    for name in ["OpenWallet", "Deposit", "Pay", "NewTransfer", "TransferRefund", "PaymentRefund"] {
        assert_eq!(schema(&doc, name)["additionalProperties"], false, "{name}");
    }
    for name in ["Deposit", "Pay", "NewTransfer", "TransferRefund", "PaymentRefund"] {
        let amount = &schema(&doc, name)["properties"]["amount"];
        assert_eq!((&amount["minimum"], &amount["maximum"]), (&json!(1), &json!(1_000_000_000_000_i64)));
    }
    assert_eq!(schema(&doc, "Pay")["properties"]["reference"]["maxLength"], 256);
    let batch = schema(&doc, "NewBatch");
    assert_eq!(batch["additionalProperties"], false);
    let items = &batch["properties"]["items"];
    assert_eq!((&items["minItems"], &items["maxItems"]), (&json!(1), &json!(1000)));
    assert_eq!(schema(&doc, "BatchItem")["oneOf"].as_array().map(Vec::len), Some(8), "one schema an op");

    // Responses: the entry, the page, the problem.
    let entry = schema(&doc, "Entry");
    let required: BTreeSet<&str> =
        entry["required"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
    let fields = ["id", "wallet_id", "kind", "amount", "balance", "version", "fence", "created_at"];
    assert_eq!(required, fields.into_iter().collect());
    assert_eq!(entry["properties"]["id"]["format"], "uuid");
    assert_eq!(entry["properties"]["created_at"]["format"], "date-time");
    assert_eq!(entry["properties"]["reference"]["type"], "string", "omitted when none, never null");
    assert_eq!(
        schema(&doc, "EntryKind")["enum"],
        json!(["open", "deposit", "pay", "transfer_out", "transfer_in", "refund"])
    );
    let transfer = schema(&doc, "Transfer");
    let required: BTreeSet<&str> =
        transfer["required"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
    let fields = ["id", "from", "to", "amount", "reference", "from_entry", "to_entry", "created_at"];
    assert_eq!(required, fields.into_iter().collect());
    assert_eq!(schema(&doc, "Page")["required"], json!(["transactions", "next_cursor"]));
    assert_eq!(schema(&doc, "Page")["properties"]["next_cursor"]["type"], json!(["string", "null"]));
    assert_eq!(schema(&doc, "Problem")["required"], json!(["type", "title", "status", "detail", "code"]));
}

/// The schemathesis CLI: `WALLETLOCK_SCHEMATHESIS` (deploy/test installs it), else from PATH.
fn schemathesis() -> String {
    std::env::var("WALLETLOCK_SCHEMATHESIS").unwrap_or_else(|_| "schemathesis".into())
}

/// The whole run's bound; schemathesis takes about 100 s here beside the rest of the suite.
const SCHEMATHESIS_LIMIT: Duration = Duration::from_secs(170);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_response_off_the_schema() {
    let env = TestEnv::new();
    let fleet = Fleet::start(&env, 1, &[]).await;
    let replica = fleet.replicas[0].url("");
    // The document's examples name `alice`: she exists, with money to pay from.
    for (id, balance) in [("alice", 1_000_000_000_000_i64), ("bob", 0)] {
        let created = fleet
            .client
            .post(format!("{replica}/wallets"))
            .json(&json!({ "id": id, "balance": balance }))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
    }

    let dir = tempfile::TempDir::new().unwrap();
    let output = dir.path().join("schemathesis.log");
    let log = std::fs::File::create(&output).unwrap();
    let started = Instant::now();
    let mut child = Command::new(schemathesis())
        .args(["run", &format!("{replica}/openapi.json")])
        .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_schema_conformance,response_headers_conformance",
        ])
        // Above GET /events' longest wait (30 s), which it may try.
        .args(["--max-examples", "50", "--seed", "20261130", "--request-timeout", "40"])
        .args(["--generation-database", "none", "--output-sanitize", "false", "--no-color"])
        // Not the webhook endpoints: an endpoint the fuzzer registers at a public URL would have
        // the replica call out of this machine. tests/suite/webhooks.rs covers them.
        .args(["--exclude-path-regex", "^/webhook-endpoints"])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|err| {
            panic!(
                "{}: {err} (deploy/test installs schemathesis; or set WALLETLOCK_SCHEMATHESIS)",
                schemathesis()
            )
        });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > SCHEMATHESIS_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let printed = std::fs::read_to_string(&output).unwrap_or_default();
    let Some(status) = status else {
        panic!("schemathesis ran past {SCHEMATHESIS_LIMIT:?}:\n{printed}");
    };
    assert!(status.success(), "schemathesis found problems ({status}):\n{printed}");
    assert!(printed.contains("passed"), "schemathesis ran no test:\n{printed}");

    // And whatever it paid and deposited, the books balance.
    let (ok, report) = audit(&fleet.database_url);
    assert!(ok, "{report}");
}
