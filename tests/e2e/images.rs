//! OCI images as templates: an image layout directory, a `docker save` archive (made by skopeo) and a
//! pull from a real registry (Debian's docker-registry on 127.0.0.1, with basic auth), each checked
//! inside a sandbox: whiteouts, opaque directories, a hard link to a lower layer, setuid bits, owners.

use futures::StreamExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use moat_api::{CreateSandboxRequest, PullTemplateRequest, RegisterTemplateRequest};
use moat_client::Client;
use sha2::{Digest, Sha256};

use crate::harness::*;

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn tar_of(dir: &Path) -> Vec<u8> {
    // GNU tar: numeric owners, sorted, so the layer is what the directory holds.
    let out = Command::new("tar")
        .args(["--numeric-owner", "--sort=name", "-C"])
        .arg(dir)
        .args(["-cf", "-", "."])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    out.stdout
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut child = Command::new("gzip")
        .args(["-n", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let data = data.to_vec();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        stdin.write_all(&data).unwrap();
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out.stdout
}

/// An OCI image layout with two layers: a busybox root filesystem (plain tar), then (gzip) a layer that
/// deletes /etc/group, replaces /opt's contents (opaque), hard-links /bin/busybox, adds a setuid file
/// and a file owned by uid 1000.
fn make_layout(dir: &Path, tag: &str) -> PathBuf {
    let l1_dir = dir.join("l1");
    std::fs::create_dir_all(&l1_dir).unwrap();
    let bb = busybox_rootfs(&l1_dir);
    std::fs::create_dir_all(bb.join("opt")).unwrap();
    std::fs::write(bb.join("opt/old"), "old").unwrap();
    let l1 = tar_of(&bb);

    let l2 = dir.join("l2");
    std::fs::create_dir_all(l2.join("opt")).unwrap();
    std::fs::create_dir_all(l2.join("etc")).unwrap();
    std::fs::create_dir_all(l2.join("bin")).unwrap();
    std::fs::create_dir_all(l2.join("home/u")).unwrap();
    std::fs::write(l2.join("opt/.wh..wh..opq"), "").unwrap();
    std::fs::write(l2.join("opt/new"), "new").unwrap();
    std::fs::write(l2.join("etc/.wh.group"), "").unwrap();
    std::fs::write(l2.join("bin/suid"), "x").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(l2.join("bin/suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::fs::write(l2.join("home/u/f"), "mine").unwrap();
    std::os::unix::fs::chown(l2.join("home/u/f"), Some(1000), Some(1000)).unwrap();
    // The hard link's target lives in the first layer: write the tar by hand.
    let l2_tar = {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all(".", &l2).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Link);
        h.set_size(0);
        h.set_mode(0o755);
        b.append_link(&mut h, "bin/hl", "bin/busybox").unwrap();
        b.into_inner().unwrap()
    };
    let l2_gz = gzip(&l2_tar);

    let layout = dir.join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| -> String {
        let d = sha(bytes);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), bytes).unwrap();
        d
    };
    let l1_d = put(&l1);
    let l2_d = put(&l2_gz);
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [sha(&l1), sha(&l2_tar)]},
    });
    let config = serde_json::to_vec(&config).unwrap();
    let config_d = put(&config);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_d, "size": config.len()},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": l1_d, "size": l1.len()},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": l2_d, "size": l2_gz.len()},
        ],
    });
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let manifest_d = put(&manifest);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_d, "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    });
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    layout
}

/// Checks, inside a sandbox of `template`, everything the image's layers say.
async fn check_image_template(c: &Client, template: &str) {
    let t = c.get_template(template).await.unwrap();
    assert_eq!(t.source, moat_api::TemplateSource::Image, "{t:?}");
    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some(template.into()),
            timeout: Some(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let out = sh(
        c,
        &sbx.id,
        "ls /opt; test -e /etc/group || echo no-group; cat /etc/passwd; \
         busybox stat -c '%A' /bin/suid; busybox stat -c '%u %g' /home/u/f; \
         busybox stat -c '%h' /bin/busybox; busybox cmp /bin/hl /bin/busybox && echo same",
    )
    .await;
    assert_eq!(
        out.stdout,
        "new\nno-group\nroot:x:0:0:root:/root:/bin/sh\n-rwsr-xr-x\n1000 1000\n2\nsame\n",
        "{out:?}"
    );
    c.delete_sandbox(&sbx.id).await.unwrap();
}

struct Registry {
    child: Child,
    port: u16,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Debian's docker-registry on 127.0.0.1 with htpasswd (bcrypt) auth for user `moat` / `s3cret`.
fn start_registry(dir: &Path) -> Registry {
    let port = free_port();
    let htpasswd = Command::new("htpasswd")
        .args(["-Bbn", "moat", "s3cret"])
        .output()
        .expect("htpasswd (apache2-utils)");
    assert!(htpasswd.status.success());
    std::fs::write(dir.join("htpasswd"), &htpasswd.stdout).unwrap();
    let config = format!(
        "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n\
         auth:\n  htpasswd:\n    realm: moat-test\n    path: {}\n",
        dir.join("storage").display(),
        dir.join("htpasswd").display()
    );
    std::fs::write(dir.join("config.yml"), config).unwrap();
    let log = std::fs::File::create(dir.join("registry.log")).unwrap();
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(dir.join("config.yml"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("docker-registry");
    let reg = Registry { child, port };
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return reg;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "registry did not listen: {}",
        std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
    );
}

fn skopeo(args: &[&str]) {
    let out = Command::new("skopeo")
        .arg("--insecure-policy")
        .args(args)
        .output()
        .expect("skopeo");
    assert!(
        out.status.success(),
        "skopeo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn oci_layout_docker_archive_and_registry_pull() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(&tmp.path().join("data"));
    let c = d.client();
    let layout = make_layout(tmp.path(), "v1");

    // 1. The OCI image layout directory, registered by path.
    c.register_template(&RegisterTemplateRequest {
        name: "from-layout".into(),
        path: layout.display().to_string(),
    })
    .await
    .unwrap();
    check_image_template(&c, "from-layout").await;

    // 2. A `docker save` archive of the same image.
    let archive = tmp.path().join("saved.tar");
    skopeo(&[
        "copy",
        &format!("oci:{}:v1", layout.display()),
        &format!("docker-archive:{}:test/img:v1", archive.display()),
    ]);
    c.register_template(&RegisterTemplateRequest {
        name: "from-docker-save".into(),
        path: archive.display().to_string(),
    })
    .await
    .unwrap();
    check_image_template(&c, "from-docker-save").await;

    // 3. A registry with basic auth, the image pushed by skopeo.
    let reg_dir = tmp.path().join("registry");
    std::fs::create_dir_all(&reg_dir).unwrap();
    let reg = start_registry(&reg_dir);
    let image = format!("127.0.0.1:{}/test/img:v1", reg.port);
    skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        "--dest-creds",
        "moat:s3cret",
        &format!("oci:{}:v1", layout.display()),
        &format!("docker://{image}"),
    ]);
    let pull = |username: Option<&str>, password: Option<&str>| PullTemplateRequest {
        image: image.clone(),
        username: username.map(str::to_string),
        password: password.map(str::to_string),
        insecure: true,
    };
    // Without credentials, and with wrong ones: refused with the reason.
    let e = c
        .pull_template("nocreds", &pull(None, None))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("username and password"), "{e}");
    let e = c
        .pull_template("badcreds", &pull(Some("moat"), Some("wrong")))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("refused the credentials"), "{e}");
    c.pull_template("from-registry", &pull(Some("moat"), Some("s3cret")))
        .await
        .unwrap();
    check_image_template(&c, "from-registry").await;
    // Bad references and half credentials are 400s naming the field.
    for (req, field) in [
        (
            PullTemplateRequest {
                image: "Not A Ref".into(),
                ..Default::default()
            },
            "image",
        ),
        (pull(Some("moat"), None), "password"),
    ] {
        match c.pull_template("x", &req).await {
            Err(moat_client::Error::Api { status, body }) => {
                assert_eq!(
                    (status, body.error.field.as_deref()),
                    (400, Some(field)),
                    "{body:?}"
                );
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    // 4. A template spec whose base is the registry image: pulled with the credentials, which the
    // build's record does not keep.
    let spec: moat_api::TemplateSpec = serde_json::from_value(serde_json::json!({
        "from": {"image": image, "username": "moat", "password": "s3cret", "insecure": true},
        "steps": [{"run": "echo built-on-image > /opt/built"}],
    }))
    .unwrap();
    let mut events = c
        .build_template_spec("on-image", &spec, false)
        .await
        .unwrap();
    let mut last = None;
    let mut id = String::new();
    while let Some(ev) = events.next().await {
        let ev = ev.unwrap();
        if let moat_api::BuildEvent::Started(s) = &ev {
            id = s.build.id.clone();
        }
        last = Some(ev);
    }
    assert!(
        matches!(last, Some(moat_api::BuildEvent::Done { .. })),
        "{last:?}"
    );
    let b = c.get_build(&id).await.unwrap();
    assert_eq!(b.spec.from.password.as_deref(), Some("(redacted)"));
    assert!(
        b.steps[0].layer.is_some(),
        "the image is the base layer: {b:#?}"
    );
    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("on-image".into()),
            timeout: Some(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let out = sh(&c, &sbx.id, "ls /opt; cat /opt/built").await;
    assert_eq!(out.stdout, "built\nnew\nbuilt-on-image\n", "{out:?}");
    c.delete_sandbox(&sbx.id).await.unwrap();
    // Wrong credentials fail the base step with the registry's answer.
    let mut bad = spec.clone();
    bad.from.password = Some("wrong".into());
    let mut events = c
        .build_template_spec("on-image-bad", &bad, true)
        .await
        .unwrap();
    let mut last = None;
    while let Some(ev) = events.next().await {
        last = Some(ev.unwrap());
    }
    match last {
        Some(moat_api::BuildEvent::Failed { message, step }) => {
            assert_eq!(step, Some(0));
            assert!(message.contains("refused the credentials"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    drop(reg);
}
