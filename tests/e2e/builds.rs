//! Template builds from a spec (docs/templates.md): each step a cached layer, rebuilt from the first
//! changed step; copy from the build context, env, workdir, user, a start command with a ready
//! check; failed, cancelled and refused builds. The apt and pip steps install from a Debian
//! repository and a Python package index this test makes and serves in its own network namespaces
//! (tests/e2e/topology.rs): nothing leaves the machine.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
use moat_api::{Build, BuildEvent, BuildStatus, CreateSandboxRequest, ErrorCode, StepStatus};
use moat_client::Client;

use crate::harness::*;
use crate::topology::*;

/// Runs a build of `name` from `spec` (TOML) with `dir` as its build context; returns its events and
/// the build as the API records it once it ended.
async fn build(
    c: &Client,
    name: &str,
    spec: &str,
    dir: &Path,
    no_cache: bool,
) -> (Vec<BuildEvent>, Build) {
    let parsed: moat_api::TemplateSpec = toml::from_str(spec).expect("spec");
    let tar = moat_client::context_tar(dir, spec, &parsed).unwrap();
    let mut stream = c
        .build_template_context(name, tar, None, no_cache)
        .await
        .unwrap_or_else(|e| panic!("build {name}: {e}"));
    let mut events = Vec::new();
    while let Some(ev) = stream.next().await {
        events.push(ev.expect("build event"));
    }
    let id = match events.first() {
        Some(BuildEvent::Started(s)) => s.build.id.clone(),
        other => panic!("the first event of a build is not `started`: {other:?}"),
    };
    assert!(
        matches!(
            events.last(),
            Some(BuildEvent::Done { .. } | BuildEvent::Failed { .. })
        ),
        "build {name} did not end with done or failed: {events:#?}"
    );
    let b = c.get_build(&id).await.unwrap();
    assert_ne!(b.status, BuildStatus::Running, "{b:#?}");
    (events, b)
}

/// The statuses of a build's steps, by index.
fn statuses(b: &Build) -> Vec<StepStatus> {
    b.steps.iter().map(|s| s.status).collect()
}

fn log_of(events: &[BuildEvent], step: u32) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Log {
                line,
                step: Some(s),
            } if *s == step => Some(line.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_succeeded(events: &[BuildEvent], b: &Build) {
    assert_eq!(
        b.status,
        BuildStatus::Succeeded,
        "build failed: {:?}\n{events:#?}",
        b.error
    );
}

/// A value unique to this run, so the shared daemon's build cache (which outlives test runs) holds
/// nothing for the first build of a test.
fn nonce() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// A `.deb` made with dpkg-deb, in a flat apt repository (Packages, Release) at `repo`.
fn apt_repo(repo: &Path, work: &Path) {
    std::fs::create_dir_all(repo).unwrap();
    let pkg = work.join("pkg");
    std::fs::create_dir_all(pkg.join("DEBIAN")).unwrap();
    std::fs::create_dir_all(pkg.join("usr/share/moat-hello")).unwrap();
    std::fs::write(
        pkg.join("DEBIAN/control"),
        "Package: moat-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: moat tests <tests@moat.invalid>\n\
         Description: a package the template build test installs\n",
    )
    .unwrap();
    std::fs::write(
        pkg.join("usr/share/moat-hello/hello.txt"),
        "hello from apt\n",
    )
    .unwrap();
    let deb = repo.join("moat-hello_1.0_all.deb");
    let out = Command::new("dpkg-deb")
        .args(["--build", "--root-owner-group"])
        .arg(&pkg)
        .arg(&deb)
        .output()
        .unwrap();
    assert!(out.status.success(), "dpkg-deb: {:?}", out);
    let bytes = std::fs::read(&deb).unwrap();
    let control = std::fs::read_to_string(pkg.join("DEBIAN/control")).unwrap();
    let packages = format!(
        "{control}Filename: ./moat-hello_1.0_all.deb\nSize: {}\nSHA256: {}\n\n",
        bytes.len(),
        sha256_hex(&bytes)
    );
    std::fs::write(repo.join("Packages"), &packages).unwrap();
    std::fs::write(
        repo.join("Release"),
        format!(
            "Origin: moat-test\nLabel: moat-test\nDate: Thu, 01 Jan 2026 00:00:00 UTC\nSHA256:\n {} {} Packages\n",
            sha256_hex(packages.as_bytes()),
            packages.len()
        ),
    )
    .unwrap();
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// Wheels of `moat-hello` 1.0 (VALUE 42) and 1.1 (VALUE 43) and a PEP 503 simple index at `root`.
fn pypi(root: &Path) {
    let files = root.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let script = r#"
import base64, hashlib, sys, zipfile
out, version, value = sys.argv[1], sys.argv[2], sys.argv[3]
info = f"moat_hello-{version}.dist-info"
members = {
    "moat_hello/__init__.py": f"VALUE = {value}\n",
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: moat-hello\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: moat-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in members.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append(f"{info}/RECORD,,")
members[f"{info}/RECORD"] = "\n".join(record) + "\n"
with zipfile.ZipFile(out, "w") as z:
    for name, text in members.items():
        z.writestr(name, text)
"#;
    let mut links = String::new();
    for (version, value) in [("1.0", "42"), ("1.1", "43")] {
        let name = format!("moat_hello-{version}-py3-none-any.whl");
        let path = files.join(&name);
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&path)
            .args([version, value])
            .output()
            .unwrap();
        assert!(out.status.success(), "make wheel: {out:?}");
        let hash = sha256_hex(&std::fs::read(&path).unwrap());
        links.push_str(&format!(
            "<a href=\"../../files/{name}#sha256={hash}\">{name}</a><br>\n"
        ));
    }
    let index = root.join("simple/moat-hello");
    std::fs::create_dir_all(&index).unwrap();
    std::fs::write(
        index.join("index.html"),
        format!("<!DOCTYPE html><html><body>\n{links}</body></html>\n"),
    )
    .unwrap();
}

async fn sandbox_of(c: &Client, template: &str) -> moat_api::Sandbox {
    c.create_sandbox(&CreateSandboxRequest {
        template: Some(template.into()),
        timeout: Some(300),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("sandbox of {template}: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn apt_and_pip_steps_from_local_registries_are_cached_and_rebuilt_from_a_change() {
    let base = shared().data_dir.join("templates/base/rootfs");
    let tmp = tempfile::tempdir().unwrap();
    let (topo, _d, c, _deny) = networked_daemon(
        tmp.path(),
        "10.221.0.0/16",
        &[
            "--build-apt-source",
            "deb [trusted=yes] http://198.51.100.1:8080/apt ./",
            "--build-pip-index",
            "http://198.51.100.1:8080/pypi/simple",
        ],
    )
    .await;
    let www = tmp.path().join("www");
    apt_repo(&www.join("apt"), tmp.path());
    pypi(&www.join("pypi"));
    for url in [
        "http://198.51.100.1:8080/apt/Packages",
        "http://198.51.100.1:8080/pypi/simple/moat-hello/",
    ] {
        assert!(topo.curl_from_host(url).is_some(), "{url} is not served");
    }
    c.register_template(&moat_api::RegisterTemplateRequest {
        name: "base".into(),
        path: base.display().to_string(),
    })
    .await
    .expect("register base");
    let ctx = tmp.path().join("ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    let spec = |pip: &str, extra: &str| {
        format!(
            r#"from = "base"

[[steps]]
apt = ["moat-hello"]

[[steps]]
pip = ["{pip}"]

# run steps reach nothing unless [build] allow_out says so
[[steps]]
run = "if curl -s -m 3 -o /dev/null http://198.51.100.1:8080/; then echo reached; exit 1; fi; echo offline > /etc/run-net"
{extra}"#
        )
    };

    // 1. Every step runs.
    let (ev, b) = build(&c, "py", &spec("moat-hello==1.0", ""), &ctx, false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(statuses(&b), vec![StepStatus::Done; 4], "{:#?}", b.steps);
    assert!(
        log_of(&ev, 1).contains("moat-hello"),
        "apt's output is the step's log: {}",
        log_of(&ev, 1)
    );
    assert!(
        log_of(&ev, 1).contains("network: 198.51.100.1"),
        "the apt step reaches the mirror only: {}",
        log_of(&ev, 1)
    );
    let t1 = c.get_template("py").await.unwrap();
    assert_eq!(t1.source, moat_api::TemplateSource::Spec);
    assert_eq!(t1.layers.len(), 3, "{t1:#?}");
    let s = sandbox_of(&c, "py").await;
    let out = sh(
        &c,
        &s.id,
        "cat /usr/share/moat-hello/hello.txt; python3 -c 'import moat_hello; print(moat_hello.VALUE)'; cat /etc/run-net; ls /var/lib/apt/lists | grep -c moat || true",
    )
    .await;
    assert_eq!(
        out.stdout, "hello from apt\n42\noffline\n0\n",
        "{}",
        out.stderr
    );
    c.delete_sandbox(&s.id).await.unwrap();

    // 2. Unchanged: nothing runs again, the template's layers are the same.
    let (ev, b) = build(&c, "py", &spec("moat-hello==1.0", ""), &ctx, false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(statuses(&b)[1..], [StepStatus::Cached; 3], "{:#?}", b.steps);
    assert!(
        ev.iter()
            .all(|e| !matches!(e, BuildEvent::Step { index, cached: false, .. } if *index > 0)),
        "{ev:#?}"
    );
    assert_eq!(c.get_template("py").await.unwrap().layers, t1.layers);

    // 3. The pip step changed: apt stays cached, pip and what follows run again.
    let (ev, b) = build(&c, "py", &spec("moat-hello==1.1", ""), &ctx, false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(
        statuses(&b)[1..],
        [StepStatus::Cached, StepStatus::Done, StepStatus::Done],
        "{:#?}",
        b.steps
    );
    let t3 = c.get_template("py").await.unwrap();
    assert_eq!(t3.layers[0], t1.layers[0]);
    assert_ne!(t3.layers[1], t1.layers[1]);
    let s = sandbox_of(&c, "py").await;
    let out = sh(
        &c,
        &s.id,
        "python3 -c 'import moat_hello; print(moat_hello.VALUE)'",
    )
    .await;
    assert_eq!(out.stdout.trim(), "43", "{}", out.stderr);
    c.delete_sandbox(&s.id).await.unwrap();

    // 4. A run step reaches what [build] allow_out lists.
    let fetch = "\n[[steps]]\nrun = \"curl -sf -m 5 http://198.51.100.1:8080/index.html > /etc/fetched\"\n\n[build]\nallow_out = [\"198.51.100.1\"]\n";
    let (ev, b) = build(&c, "py", &spec("moat-hello==1.1", fetch), &ctx, false).await;
    assert_succeeded(&ev, &b);
    let s = sandbox_of(&c, "py").await;
    assert_eq!(sh(&c, &s.id, "cat /etc/fetched").await.stdout, "hello");
    c.delete_sandbox(&s.id).await.unwrap();

    // 5. A step that fails: the build says which and shows its output; the template stays as it was.
    let before = c.get_template("py").await.unwrap();
    let failing = "\n[[steps]]\nrun = \"echo going to fail; echo bad-thing >&2; exit 3\"\n";
    let (ev, b) = build(&c, "py", &spec("moat-hello==1.1", failing), &ctx, false).await;
    assert_eq!(b.status, BuildStatus::Failed);
    assert_eq!(b.failed_step, Some(4));
    let err = b.error.clone().unwrap_or_default();
    assert!(
        err.contains("step 4") && err.contains("exit code 3") && err.contains("bad-thing"),
        "{err}"
    );
    match ev.last() {
        Some(BuildEvent::Failed { message, step }) => {
            assert_eq!(*step, Some(4));
            assert!(message.contains("going to fail"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let after = c.get_template("py").await.unwrap();
    assert_eq!(after.layers, before.layers);
    assert_eq!(after.status, moat_api::TemplateStatus::Ready);
    // No build sandbox is left behind.
    let left = c.list_sandboxes(&Default::default()).await.unwrap();
    assert!(
        left.iter().all(|s| !s.metadata.contains_key("moat.build")),
        "{left:#?}"
    );
}

/// The files of a build context, with a file that changes between builds.
fn context(dir: &Path, notes: &str) {
    std::fs::create_dir_all(dir.join("app/bin")).unwrap();
    std::fs::write(
        dir.join("app/index.html"),
        "<p>served by the start command</p>\n",
    )
    .unwrap();
    std::fs::write(dir.join("app/bin/run"), "#!/bin/sh\necho ran\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        dir.join("app/bin/run"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let _ = std::fs::remove_file(dir.join("app/link"));
    std::os::unix::fs::symlink("index.html", dir.join("app/link")).unwrap();
    std::fs::write(dir.join("notes.txt"), notes).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn copy_env_workdir_user_and_start_command() {
    let c = shared_client();
    let tmp = tempfile::tempdir().unwrap();
    let ctx = tmp.path();
    context(ctx, "first notes\n");
    let run_id = nonce();
    let name = format!("web-{}", std::process::id());
    let spec = format!(
        r#"from = "base"

[[steps]]
env = {{ RUN_ID = "{run_id}", GREETING = "hello there" }}

[[steps]]
copy = {{ src = "app", dest = "/opt/app" }}

[[steps]]
copy = {{ src = "notes.txt", dest = "/etc/", owner = "user" }}

[[steps]]
workdir = "/opt/app"

[[steps]]
user = "user"

[[steps]]
run = "echo $RUN_ID > /home/user/run-id; id -un > /home/user/who; pwd > /home/user/cwd"

[start]
cmd = "python3 -m http.server 8000 --bind 127.0.0.1"
ready = {{ port = 8000 }}
"#
    );
    let (ev, b) = build(&c, &name, &spec, ctx, false).await;
    assert_succeeded(&ev, &b);
    use StepStatus::*;
    // base, env, copy, copy, workdir, user, run, start
    assert_eq!(
        statuses(&b),
        vec![Done, Done, Done, Done, Done, Done, Done, Done],
        "{:#?}",
        b.steps
    );
    let t = c.get_template(&name).await.unwrap();
    assert_eq!(t.config.workdir.as_deref(), Some("/opt/app"));
    assert_eq!(t.config.user.as_deref(), Some("user"));
    assert_eq!(
        t.config.env.get("GREETING").map(String::as_str),
        Some("hello there")
    );
    assert!(t.config.start.is_some());
    assert_eq!(t.from.as_deref(), Some("template base"));

    let s = sandbox_of(&c, &name).await;
    let out = sh(
        &c,
        &s.id,
        "pwd; id -un; echo \"$GREETING\"; cat /home/user/run-id /home/user/who /home/user/cwd; \
         test -x /opt/app/bin/run && /opt/app/bin/run; readlink /opt/app/link; \
         python3 -c 'import os, pwd; print(pwd.getpwuid(os.stat(\"/etc/notes.txt\").st_uid).pw_name)'; cat /etc/notes.txt",
    )
    .await;
    assert_eq!(
        out.stdout,
        format!("/opt/app\nuser\nhello there\n{run_id}\nuser\n/opt/app\nran\nindex.html\nuser\nfirst notes\n"),
        "{}",
        out.stderr
    );
    // The start command runs with tag `start` and serves; it is ready when the create returns.
    let procs = c.list_processes(&s.id).await.unwrap();
    let start = procs
        .iter()
        .find(|p| p.tag.as_deref() == Some("start"))
        .unwrap_or_else(|| panic!("no start process: {procs:#?}"));
    assert!(start.running && start.user == "user", "{start:#?}");
    let page = sh(
        &c,
        &s.id,
        "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/index.html\").read().decode())'",
    )
    .await;
    assert!(
        page.stdout.contains("served by the start command"),
        "{page:?}"
    );
    // A reset starts it again.
    c.reset_sandbox(&s.id, &Default::default()).await.unwrap();
    let procs = c.list_processes(&s.id).await.unwrap();
    assert!(
        procs
            .iter()
            .any(|p| p.tag.as_deref() == Some("start") && p.running),
        "{procs:#?}"
    );
    c.delete_sandbox(&s.id).await.unwrap();

    // Unchanged: every step that makes a layer comes from the cache.
    let (ev, b) = build(&c, &name, &spec, ctx, false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(
        statuses(&b),
        vec![Done, Done, Cached, Cached, Cached, Done, Cached, Done],
        "{:#?}",
        b.steps
    );
    assert_eq!(c.get_template(&name).await.unwrap().layers, t.layers);

    // A changed file in the context rebuilds its copy step and what follows.
    context(ctx, "second notes\n");
    let (ev, b) = build(&c, &name, &spec, ctx, false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(
        statuses(&b),
        vec![Done, Done, Cached, Done, Done, Done, Done, Done],
        "{:#?}",
        b.steps
    );
    let t2 = c.get_template(&name).await.unwrap();
    assert_eq!(t2.layers[0], t.layers[0]);
    assert_ne!(t2.layers[1], t.layers[1]);
    let s = sandbox_of(&c, &name).await;
    assert_eq!(
        sh(&c, &s.id, "cat /etc/notes.txt").await.stdout,
        "second notes\n"
    );
    c.delete_sandbox(&s.id).await.unwrap();

    // --no-cache runs everything again.
    let (ev, b) = build(&c, &name, &spec, ctx, true).await;
    assert_succeeded(&ev, &b);
    assert!(!statuses(&b).contains(&Cached), "{:#?}", b.steps);

    // A start command that never gets ready fails the build at the start check with its output;
    // a new template is left failed, never half-made.
    let bad = format!(
        "from = \"{name}\"\n[start]\ncmd = \"echo start-output-here; sleep 1; exit 7\"\nready = {{ port = 9 }}\ntimeout = 20\n"
    );
    let bad_name = format!("{name}-bad");
    let (_, b) = build(&c, &bad_name, &bad, ctx, false).await;
    assert_eq!(b.status, BuildStatus::Failed);
    assert_eq!(b.failed_step, Some(1));
    let err = b.error.unwrap_or_default();
    assert!(
        err.contains("start-output-here") && err.contains("exit code 7"),
        "{err}"
    );
    let t = c.get_template(&bad_name).await.unwrap();
    assert_eq!(t.status, moat_api::TemplateStatus::Failed);
    // A template started from another inherits its start command.
    let child = format!("{name}-child");
    let (ev, b) = build(
        &c,
        &child,
        &format!("from = \"{name}\"\n[[steps]]\nrun = \"touch /home/user/child\"\n"),
        ctx,
        false,
    )
    .await;
    assert_succeeded(&ev, &b);
    assert_eq!(
        c.get_template(&child).await.unwrap().config.start,
        t2.config.start
    );
    for n in [&child, &bad_name, &name] {
        c.delete_template(n).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn builds_can_be_cancelled_and_bad_specs_are_refused() {
    let c = shared_client();
    let tmp = tempfile::tempdir().unwrap();
    let name = format!("slow-{}", std::process::id());
    let spec = format!(
        "from = \"base\"\n[[steps]]\nenv = {{ N = \"{}\" }}\n[[steps]]\nrun = \"echo sleeping; sleep 600\"\n",
        nonce()
    );
    let parsed: moat_api::TemplateSpec = toml::from_str(&spec).unwrap();
    let tar = moat_client::context_tar(tmp.path(), &spec, &parsed).unwrap();
    let mut stream = c
        .build_template_context(&name, tar, None, false)
        .await
        .unwrap();
    let mut id = String::new();
    // Wait for the sleeping step's output, then cancel.
    while let Some(ev) = stream.next().await {
        match ev.unwrap() {
            BuildEvent::Started(s) => id = s.build.id.clone(),
            BuildEvent::Log { line, .. } if line == "sleeping" => break,
            _ => {}
        }
    }
    assert!(!id.is_empty());
    // A second build of the same template is refused while this one runs.
    let again = c
        .build_template_spec(&name, &parsed, false)
        .await
        .err()
        .expect("a second build of a template being built");
    assert_eq!(again.code(), Some(ErrorCode::Conflict), "{again}");
    c.cancel_build(&id).await.unwrap();
    let mut last = None;
    while let Some(ev) = stream.next().await {
        last = Some(ev.unwrap());
    }
    assert!(
        matches!(&last, Some(BuildEvent::Failed { message, step: Some(2) }) if message == "cancelled"),
        "{last:?}"
    );
    let b = c.get_build(&id).await.unwrap();
    assert_eq!(b.status, BuildStatus::Cancelled);
    // Its events stay readable after it ended, from the start.
    let mut replay = c.build_events(&id).await.unwrap();
    let first = replay.next().await.unwrap().unwrap();
    assert!(matches!(first, BuildEvent::Started(_)), "{first:?}");
    let sandboxes = c.list_sandboxes(&Default::default()).await.unwrap();
    assert!(
        sandboxes
            .iter()
            .all(|s| s.metadata.get("moat.build") != Some(&id)),
        "a cancelled build's sandbox is removed: {sandboxes:#?}"
    );
    assert_eq!(
        c.get_template(&name).await.unwrap().status,
        moat_api::TemplateStatus::Failed
    );
    c.delete_template(&name).await.unwrap();

    // Bad specs: 400 naming the field.
    let http = reqwest::Client::new();
    let d = shared();
    let post = |body: String, ct: &'static str| {
        http.post(format!(
            "{}/v1/templates/x-{}/build",
            d.url,
            std::process::id()
        ))
        .bearer_auth(d.api_key())
        .header("content-type", ct)
        .body(body)
        .send()
    };
    for (body, ct, status, field) in [
        (
            r#"{"spec": {"from": "base", "steps": [{"copy": {"src": "a", "dest": "/a"}}]}}"#,
            "application/json",
            400,
            "spec.steps[0].copy",
        ),
        (
            r#"{"spec": {"from": "base", "steps": [{"apt": []}]}}"#,
            "application/json",
            400,
            "spec.steps[0].apt",
        ),
        (
            r#"{"spec": {"from": "nope-not-here"}}"#,
            "application/json",
            400,
            "spec.from.template",
        ),
        (
            "from = \"base\"\n[[steps]]\nrn = \"x\"\n",
            "application/toml",
            400,
            "spec",
        ),
    ] {
        let r = post(body.to_string(), ct).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let e: moat_api::ErrorBody = r.json().await.unwrap();
        assert_eq!(e.error.field.as_deref(), Some(field), "{body}: {e:?}");
        assert_eq!(e.error.code, ErrorCode::InvalidArgument);
    }
    // A template that is not built from a spec cannot be rebuilt from one.
    let r = http
        .post(format!("{}/v1/templates/base/build", d.url))
        .bearer_auth(d.api_key())
        .header("content-type", "application/toml")
        .body("from = { debian = \"bookworm\" }\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let r = http
        .get(format!("{}/v1/builds/bld_nope", d.url))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_debian_release_base_and_the_cache_prune() {
    // Its own daemon: `system prune` empties the daemon's whole build cache, which other tests on the
    // shared daemon rely on. The Debian packages come from the host's mirror like the base template's
    // (debootstrap's cache of the shared daemon is copied so nothing is downloaded twice).
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let shared_cache = shared().data_dir.join("cache/debootstrap");
    std::fs::create_dir_all(data.join("cache")).unwrap();
    let out = Command::new("cp")
        .arg("-a")
        .arg(&shared_cache)
        .arg(data.join("cache/"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let d = Daemon::start_with(&data, &["--pool-size", "0"]);
    let c = d.client();
    let suite = std::fs::read_to_string("/etc/os-release")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME=").map(str::to_string))
        .unwrap_or_else(|| "bookworm".into());
    let spec = format!(
        "from = {{ debian = \"{suite}\", packages = [\"jq\"] }}\n[[steps]]\nrun = \"jq --version > /etc/jq-version\"\n"
    );
    let (ev, b) = build(&c, "deb", &spec, tmp.path(), false).await;
    assert_succeeded(&ev, &b);
    assert!(
        b.steps[0].layer.is_some(),
        "the release is a layer: {:#?}",
        b.steps
    );
    let t = c.get_template("deb").await.unwrap();
    assert_eq!(
        t.from.as_deref(),
        Some(format!("debian {suite} + jq").as_str())
    );
    let s = sandbox_of(&c, "deb").await;
    let out = sh(
        &c,
        &s.id,
        "cat /etc/jq-version; . /etc/os-release; echo $VERSION_CODENAME",
    )
    .await;
    assert!(out.stdout.starts_with("jq-"), "{out:?}");
    assert!(out.stdout.ends_with(&format!("{suite}\n")), "{out:?}");
    c.delete_sandbox(&s.id).await.unwrap();
    let df = c.disk_usage().await.unwrap();
    assert_eq!(df.build_cache.count, 2, "{df:#?}");
    // Cached: the release is not made again.
    let (ev, b) = build(&c, "deb", &spec, tmp.path(), false).await;
    assert_succeeded(&ev, &b);
    assert_eq!(statuses(&b), vec![StepStatus::Cached; 2], "{:#?}", b.steps);
    // Prune empties the cache; the template's layers stay (it uses them).
    let r = c.prune_build_cache().await.unwrap();
    assert_eq!(r.entries, 2);
    assert_eq!(r.layers, 0);
    assert_eq!(c.disk_usage().await.unwrap().build_cache.count, 0);
    let s = sandbox_of(&c, "deb").await;
    assert!(sh(&c, &s.id, "cat /etc/jq-version")
        .await
        .stdout
        .starts_with("jq-"));
    c.delete_sandbox(&s.id).await.unwrap();
    // Without the template nor the cache, its layers go.
    c.delete_template("deb").await.unwrap();
    let mut layers = 0;
    for _ in 0..50 {
        layers = c.disk_usage().await.unwrap().layers.count;
        if layers == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(layers, 0);
}
