//! `telemetry::init` configured by the `OTEL_*` environment only: the test
//! runs itself again as a child process with the variables set (the
//! environment is the process's), and a collector of its own — a plain
//! HTTP listener — receives what the child exports. Also: a protocol or a
//! compression this build lacks, or an endpoint that is not a URL, stops the
//! child with a message naming it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::Duration;

/// Set in the child: run the exporting side and exit.
const CHILD: &str = "OUTBOX_TEST_OTLP_CHILD";

/// One HTTP request the collector received.
struct Request {
    line: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A collector on a free port: answers every request `200` and hands it over.
fn collector() -> (String, mpsc::Receiver<Request>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let mut headers = Vec::new();
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = header.trim_end().split_once(':') {
                    headers.push((name.trim().to_owned(), value.trim().to_owned()));
                }
            }
            let length = headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.parse::<usize>().ok())
                .unwrap_or(0);
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let _ = tx.send(Request {
                line: line.trim_end().to_owned(),
                headers,
                body,
            });
        }
    });
    (endpoint, rx)
}

/// Runs this test again as a child with `env`; returns its output.
fn run_child(test: &str, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env_remove("RUST_LOG");
    for name in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_SAMPLER",
    ] {
        command.env_remove(name);
    }
    command.envs(env.iter().copied());
    command.output().expect("the child runs")
}

/// The child's side: what an application's `main` does.
fn export_one_span() {
    match outbox_runtime::telemetry::init("fallback-name") {
        Ok(Some(guard)) => {
            tracing::info_span!("exported_by_the_child", answer = 42).in_scope(|| {
                tracing::info!("inside the span");
            });
            // Dropping the guard flushes the span to the collector.
            drop(guard);
        }
        Ok(None) => {
            eprintln!("telemetry not configured");
            std::process::exit(3);
        }
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(2);
        }
    }
}

#[test]
fn spans_reach_the_collector_the_environment_names() {
    if std::env::var_os(CHILD).is_some() {
        export_one_span();
        return;
    }
    let (endpoint, requests) = collector();
    let output = run_child(
        "spans_reach_the_collector_the_environment_names",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SERVICE_NAME", "billing-under-test"),
        ],
    );
    assert!(
        output.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let request = requests
        .recv_timeout(Duration::from_secs(30))
        .expect("the collector received the export");
    assert_eq!(request.line, "POST /v1/traces HTTP/1.1");
    assert_eq!(
        request.header("content-type"),
        Some("application/x-protobuf")
    );
    let body = String::from_utf8_lossy(&request.body);
    assert!(body.contains("exported_by_the_child"), "the span's name");
    assert!(body.contains("billing-under-test"), "OTEL_SERVICE_NAME");
    assert!(!body.contains("fallback-name"), "the environment wins");
}

#[test]
fn without_an_endpoint_nothing_is_exported() {
    if std::env::var_os(CHILD).is_some() {
        export_one_span();
        return;
    }
    let output = run_child("without_an_endpoint_nothing_is_exported", &[]);
    assert_eq!(output.status.code(), Some(3), "init returns no guard");
    let (endpoint, _) = collector();
    let output = run_child(
        "without_an_endpoint_nothing_is_exported",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SDK_DISABLED", "true"),
        ],
    );
    assert_eq!(output.status.code(), Some(3), "OTEL_SDK_DISABLED=true");
}

#[test]
fn an_unsupported_protocol_is_refused_with_its_name() {
    if std::env::var_os(CHILD).is_some() {
        export_one_span();
        return;
    }
    let (endpoint, _) = collector();
    let output = run_child(
        "an_unsupported_protocol_is_refused_with_its_name",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported"),
        "{stderr}"
    );
}

#[test]
fn a_bad_endpoint_or_a_compression_not_built_in_is_refused() {
    if std::env::var_os(CHILD).is_some() {
        export_one_span();
        return;
    }
    let test = "a_bad_endpoint_or_a_compression_not_built_in_is_refused";
    let output = run_child(
        test,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://bad host:4318")],
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_ENDPOINT=http://bad host:4318 is not an http"),
        "{stderr}"
    );

    let (endpoint, _) = collector();
    let output = run_child(
        test,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
        ],
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("gzip"), "{stderr}");
}
