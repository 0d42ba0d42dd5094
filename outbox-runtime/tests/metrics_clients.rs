//! The metrics endpoint against clients that misbehave: they connect and
//! send nothing, stop in the middle of a request, or send a request and
//! never read the answer (larger than their socket buffers). Scrapes by
//! other clients are answered meanwhile. Its own test binary: the recorder
//! is process-wide.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Series registered, so that an answer (~1 MB) does not fit the socket
/// buffers of a client that does not read.
const SERIES: usize = 20_000;

async fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_are_answered_while_other_clients_stall() {
    let server = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    for n in 0..SERIES {
        metrics::gauge!("outbox_test_series", "n" => n.to_string()).set(n as f64);
    }
    let last = format!("outbox_test_series{{n=\"{}\"}} {}", SERIES - 1, SERIES - 1);

    // Clients that connect and send nothing.
    let mut silent = Vec::new();
    for _ in 0..50 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // One that stops in the middle of its request line.
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"GET /metr").await.unwrap();
    // Ones that ask and never read the answer, with small receive buffers.
    let mut stalled = Vec::new();
    for _ in 0..5 {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut stream = socket.connect(addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        stalled.push(stream);
    }
    // A slow reader: a few bytes now and then.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let slow_reader = tokio::spawn(async move {
        let mut buf = [0_u8; 16];
        let mut read = 0;
        while read < 64 * 1024 {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        read
    });

    // Meanwhile every scrape by another client is answered in full.
    for i in 0..10 {
        let body = tokio::time::timeout(Duration::from_secs(20), scrape(addr))
            .await
            .unwrap_or_else(|_| panic!("scrape {i} not answered while other clients stall"));
        assert!(body.starts_with("HTTP/1.1 200"), "{}", &body[..200]);
        assert!(body.contains(&last), "scrape {i} incomplete");
    }

    drop((silent, half, stalled));
    slow_reader.abort();
}
