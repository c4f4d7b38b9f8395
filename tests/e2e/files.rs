//! The filesystem API against a real sandbox: streaming round trip, listing, tar, watch.

use std::time::Duration;

use futures::StreamExt;
use moat_api::{FileType, FsEventKind, MkdirRequest};
use moat_client::WriteOptions;
use sha2::{Digest, Sha256};

use crate::harness::*;
use crate::isolation::read_all;

/// Deterministic pseudo-random bytes, generated as they are sent.
fn body_stream(total: usize) -> (reqwest::Body, std::sync::Arc<std::sync::Mutex<Sha256>>) {
    let hasher = std::sync::Arc::new(std::sync::Mutex::new(Sha256::new()));
    let h = hasher.clone();
    let chunk = 1 << 20;
    let mut state = 0x9e3779b97f4a7c15u64;
    let stream = futures::stream::iter((0..total.div_ceil(chunk)).map(move |i| {
        let n = chunk.min(total - i * chunk);
        let mut buf = Vec::with_capacity(n);
        while buf.len() < n {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            buf.extend_from_slice(&state.to_le_bytes());
        }
        buf.truncate(n);
        h.lock().unwrap().update(&buf);
        Ok::<_, std::io::Error>(bytes::Bytes::from(buf))
    }));
    (reqwest::Body::wrap_stream(stream), hasher)
}

#[tokio::test(flavor = "multi_thread")]
async fn hundred_megabyte_round_trip_keeps_sha256_and_daemon_memory() {
    let d = shared();
    let c = d.client();
    let s = create(&c, "base").await;
    let before = d.rss_kib();
    let total = 100 << 20;
    let (body, hasher) = body_stream(total);
    let info = c
        .write_file(&s.id, "/home/user/big.bin", body, &WriteOptions::default())
        .await
        .unwrap();
    assert_eq!(info.size, total as u64);
    let sent = hex::encode(hasher.lock().unwrap().clone().finalize());
    let mid = d.rss_kib();
    let inside = sh(&c, &s.id, "sha256sum /home/user/big.bin | cut -d' ' -f1").await;
    assert_eq!(inside.stdout.trim(), sent);
    let mut st = c.read_file(&s.id, "/home/user/big.bin").await.unwrap();
    let mut h = Sha256::new();
    let mut n = 0;
    let mut peak = mid;
    while let Some(b) = st.next().await {
        let b = b.unwrap();
        n += b.len();
        h.update(&b);
        if n % (8 << 20) < b.len() {
            peak = peak.max(d.rss_kib());
        }
    }
    assert_eq!(n, total);
    assert_eq!(hex::encode(h.finalize()), sent);
    let grew = peak.max(mid).saturating_sub(before);
    assert!(
        grew < 48 * 1024,
        "daemon RSS grew by {grew} KiB moving 200 MB"
    );
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn file_operations() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let id = &s.id;
    let r = c
        .mkdir(
            id,
            &MkdirRequest {
                path: "/work/a/b".into(),
                user: None,
            },
        )
        .await
        .unwrap();
    assert!(r.created);
    assert!(
        !c.mkdir(
            id,
            &MkdirRequest {
                path: "/work/a/b".into(),
                user: None
            }
        )
        .await
        .unwrap()
        .created
    );
    c.write_file(
        id,
        "/work/a/b/f.txt",
        "hello",
        &WriteOptions {
            mode: Some("0600".into()),
            user: Some("user".into()),
        },
    )
    .await
    .unwrap();
    let st = c.stat(id, "/work/a/b/f.txt").await.unwrap();
    assert_eq!(
        (st.size, st.mode, st.uid, st.file_type),
        (5, 0o600, 1000, FileType::File)
    );
    assert!(c.exists(id, "/work/a/b/f.txt").await.unwrap());
    assert!(!c.exists(id, "/work/nope").await.unwrap());
    let listing = c.list_dir(id, "/work", Some(3)).await.unwrap();
    let paths: Vec<_> = listing.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["/work/a", "/work/a/b", "/work/a/b/f.txt"]);
    let one = c.list_dir(id, "/work", Some(1)).await.unwrap();
    assert_eq!(one.len(), 1);
    let moved = c
        .rename(id, "/work/a/b/f.txt", "/work/g.txt")
        .await
        .unwrap();
    assert_eq!(moved.path, "/work/g.txt");
    assert_eq!(read_all(&c, id, "/work/g.txt").await, b"hello");
    // Kernel files report sizes that are not their content's (0 in /proc, 4096 in /sys): they are
    // read to their end, as `cat` would.
    let version = read_all(&c, id, "/proc/version").await;
    assert!(version.starts_with(b"Linux version"), "{version:?}");
    let cat = sh(&c, id, "cat /proc/version").await.stdout;
    assert_eq!(String::from_utf8_lossy(&version), cat);
    // Atomic replace: the new content, the old mode.
    c.write_file(id, "/work/g.txt", "bye", &WriteOptions::default())
        .await
        .unwrap();
    assert_eq!(read_all(&c, id, "/work/g.txt").await, b"bye");
    let e = c
        .remove(id, "/work/a", false)
        .await
        .expect_err("non-empty dir without recursive");
    assert_eq!(e.code(), Some(moat_api::ErrorCode::Conflict));
    c.remove(id, "/work/a", true).await.unwrap();
    assert!(!c.exists(id, "/work/a").await.unwrap());
    let e = c.stat(id, "/work/a").await.err().unwrap();
    assert!(e.is_not_found());

    // Directory round trip as tar.
    sh(
        &c,
        id,
        "mkdir -p /src/d && echo one > /src/d/1 && ln -s 1 /src/d/link && chmod 751 /src/d",
    )
    .await;
    let mut tar = c.download_tar(id, "/src").await.unwrap();
    let mut bytes = Vec::new();
    while let Some(b) = tar.next().await {
        bytes.extend_from_slice(&b.unwrap());
    }
    c.upload_tar(id, "/dst", reqwest::Body::from(bytes))
        .await
        .unwrap();
    let out = sh(
        &c,
        id,
        "cat /dst/d/1; readlink /dst/d/link; find /dst/d -maxdepth 0 -printf '%m\\n'",
    )
    .await;
    assert_eq!(out.stdout, "one\n1\n751\n");

    // Watch sees a file created after it started.
    let mut w = c.watch(id, "/work", true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    sh(&c, id, "mkdir -p /work/sub && echo x > /work/sub/new.txt").await;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, w.next()).await {
        let ev = ev.unwrap();
        let done = ev.path == "/work/sub/new.txt" && ev.kind == FsEventKind::Create;
        seen.push(ev);
        if done {
            break;
        }
    }
    assert!(
        seen.iter()
            .any(|e| e.path == "/work/sub/new.txt" && e.kind == FsEventKind::Create),
        "{seen:?}"
    );
    c.delete_sandbox(id).await.unwrap();
}
