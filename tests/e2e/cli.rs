//! The `moat` CLI against the live daemon: exit codes propagate, `--json` is machine-readable, `cp`
//! moves files and directories both ways.

use std::process::{Command, Output};

use crate::harness::*;

fn moat(args: &[&str]) -> Output {
    let d = shared();
    Command::new(moat_bin())
        .args(args)
        .env("MOAT_URL", &d.url)
        .env("MOAT_API_KEY", d.api_key())
        .output()
        .expect("run moat")
}

fn ok(args: &[&str]) -> String {
    let o = moat(args);
    assert!(
        o.status.success(),
        "moat {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn cli_end_to_end() {
    let created: serde_json::Value = serde_json::from_str(&ok(&[
        "--json",
        "create",
        "--template",
        "base",
        "--metadata",
        "via=cli",
    ]))
    .unwrap();
    let id = created["id"].as_str().unwrap().to_string();

    assert_eq!(
        ok(&["exec", &id, "--", "python3", "-c", "print(6*7)"]),
        "42\n"
    );
    let o = moat(&["exec", &id, "--", "sh", "-c", "echo to-err >&2; exit 5"]);
    assert_eq!(o.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&o.stderr), "to-err\n");
    let o = moat(&["exec", &id, "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(o.status.code(), Some(128 + 15));

    let listed: serde_json::Value =
        serde_json::from_str(&ok(&["--json", "ls", "--metadata", "via=cli"])).unwrap();
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, vec![id.as_str()]);
    let inspected: serde_json::Value = serde_json::from_str(&ok(&["inspect", &id])).unwrap();
    assert_eq!(inspected["metadata"]["via"], "cli");

    // cp: a file and a directory, host → sandbox → host.
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tree");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("a.txt"), "alpha").unwrap();
    std::fs::write(src.join("sub/b.txt"), "beta").unwrap();
    ok(&[
        "cp",
        src.join("a.txt").to_str().unwrap(),
        &format!("{id}:/tmp/a.txt"),
    ]);
    ok(&["cp", src.to_str().unwrap(), &format!("{id}:/srv/tree")]);
    assert_eq!(
        ok(&[
            "exec",
            &id,
            "--",
            "cat",
            "/tmp/a.txt",
            "/srv/tree/sub/b.txt"
        ]),
        "alphabeta"
    );
    let back = tmp.path().join("back");
    ok(&["cp", &format!("{id}:/srv/tree"), back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(back.join("sub/b.txt")).unwrap(),
        "beta"
    );
    ok(&[
        "cp",
        &format!("{id}:/tmp/a.txt"),
        tmp.path().join("a-back.txt").to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("a-back.txt")).unwrap(),
        "alpha"
    );

    ok(&["rm", &id]);
    let o = moat(&["inspect", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not found"));

    // run: create, exec, delete in one go, with the command's exit code.
    let label = format!("run={}", std::process::id());
    let o = moat(&[
        "run",
        "--template",
        "base",
        "--metadata",
        &label,
        "--",
        "sh",
        "-c",
        "hostname; exit 4",
    ]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("sbx-"));
    let left: serde_json::Value =
        serde_json::from_str(&ok(&["--json", "ls", "--metadata", &label])).unwrap();
    assert_eq!(
        left.as_array().unwrap().len(),
        0,
        "run left its sandbox behind"
    );
}

#[test]
fn cli_snapshot_fork_reset_pause() {
    let id = ok(&["create", "--template", "base", "--timeout", "600"])
        .trim()
        .to_string();
    ok(&["exec", &id, "--", "sh", "-c", "echo saved > /root/state"]);
    let name = format!("cli-{}", &id[4..14]);
    let snap = ok(&["snapshot", "create", &id, "--name", &name])
        .trim()
        .to_string();
    assert!(snap.starts_with("snap_"), "{snap}");
    assert!(ok(&["snapshot", "ls"]).contains(&name));
    let inspected: serde_json::Value =
        serde_json::from_str(&ok(&["snapshot", "inspect", &name])).unwrap();
    assert_eq!(inspected["id"], snap.as_str());

    let forks: Vec<String> = ok(&["fork", &name, "-n", "2", "--timeout", "600"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(forks.len(), 2);
    for f in &forks {
        assert_eq!(ok(&["exec", f, "--", "cat", "/root/state"]), "saved\n");
    }
    ok(&[
        "exec",
        &forks[0],
        "--",
        "sh",
        "-c",
        "echo changed > /root/state",
    ]);
    ok(&["reset", &forks[0]]);
    assert_eq!(
        ok(&["exec", &forks[0], "--", "cat", "/root/state"]),
        "saved\n"
    );

    assert!(ok(&["pause", &forks[1]]).contains("paused"));
    let o = moat(&["exec", &forks[1], "--", "true"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("paused"),
        "{o:?}"
    );
    assert!(ok(&["resume", &forks[1]]).contains("resumed"));
    assert_eq!(
        ok(&["exec", &forks[1], "--", "cat", "/root/state"]),
        "saved\n"
    );

    let df: serde_json::Value = serde_json::from_str(&ok(&["--json", "system", "df"])).unwrap();
    assert!(df["layers"]["count"].as_u64().unwrap() >= 1, "{df}");
    assert!(ok(&["system", "df"]).contains("layers"));

    if is_container() {
        // The container tier needs CRIU for memory snapshots: refused with the reason.
        let o = moat(&["snapshot", "create", &id, "--full"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("full-state snapshots"),
            "{o:?}"
        );
    } else {
        let full = ok(&["snapshot", "create", &id, "--full"]);
        let snap: serde_json::Value =
            serde_json::from_str(&ok(&["--json", "snapshot", "inspect", full.trim()])).unwrap();
        assert_eq!(snap["kind"], "full", "{snap}");
        ok(&["snapshot", "rm", full.trim()]);
    }

    ok(&["rm", &id, &forks[0], &forks[1]]);
    ok(&["snapshot", "rm", &name]);
}
