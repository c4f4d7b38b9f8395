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

#[test]
fn template_build_from_a_spec_file() {
    let dir = tempfile::tempdir().unwrap();
    let name = format!("cli-spec-{}", std::process::id());
    std::fs::write(dir.path().join("greeting.txt"), "hi from the context\n").unwrap();
    std::fs::write(
        dir.path().join("moat.toml"),
        format!(
            "from = \"base\"\n\n[[steps]]\nenv = {{ RUN = \"{}\" }}\n\n[[steps]]\ncopy = {{ src = \"greeting.txt\", dest = \"/etc/greeting\" }}\n\n[[steps]]\nrun = \"echo step-output; cat /etc/greeting\"\n",
            std::process::id()
        ),
    )
    .unwrap();
    let spec = dir.path().join("moat.toml");
    let spec = spec.to_str().unwrap();
    let out = ok(&["template", "build", &name, "-f", spec]);
    assert!(out.contains("[3/3] run echo step-output"), "{out}");
    assert!(
        out.contains("    step-output\n    hi from the context"),
        "{out}"
    );
    assert!(out.contains(&format!("template {name} ready")), "{out}");
    // Again: every step that makes a layer is cached, and --quiet leaves the output out.
    let out = ok(&["template", "build", &name, "-f", spec, "-q"]);
    assert!(
        out.contains("[2/3] copy greeting.txt /etc/greeting  CACHED"),
        "{out}"
    );
    assert!(
        out.contains("[3/3] run echo step-output; cat /etc/greeting  CACHED"),
        "{out}"
    );
    assert!(!out.contains("    step-output"), "{out}");
    let builds: serde_json::Value =
        serde_json::from_str(&ok(&["--json", "template", "builds", &name])).unwrap();
    let builds = builds.as_array().unwrap();
    assert_eq!(builds.len(), 2, "{builds:?}");
    let id = builds[1]["id"].as_str().unwrap().to_string();
    let shown = ok(&["template", "inspect", &id]);
    assert!(
        shown.contains("succeeded") && shown.contains("copy greeting.txt"),
        "{shown}"
    );
    let logs = ok(&["template", "logs", &id]);
    assert!(logs.contains("    step-output"), "{logs}");
    // A failing step: exit code 1, the step and its output on stderr.
    std::fs::write(
        dir.path().join("bad.toml"),
        "from = \"base\"\n[[steps]]\nrun = \"echo broke-here >&2; exit 4\"\n",
    )
    .unwrap();
    let o = moat(&[
        "template",
        "build",
        &format!("{name}-bad"),
        "-f",
        dir.path().join("bad.toml").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("step 1 (run echo broke-here")
            && err.contains("exit code 4")
            && err.contains("broke-here"),
        "{err}"
    );
    // A spec error is reported before anything is sent.
    std::fs::write(
        dir.path().join("typo.toml"),
        "from = \"base\"\n[[steps]]\nrnu = \"x\"\n",
    )
    .unwrap();
    let o = moat(&[
        "template",
        "build",
        "x",
        "-f",
        dir.path().join("typo.toml").to_str().unwrap(),
    ]);
    assert_ne!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stderr).contains("rnu"), "{o:?}");
    ok(&["template", "rm", &name]);
    ok(&["template", "rm", &format!("{name}-bad")]);
}
