//! Code interpreter: state across cells, errors, streaming, timeouts, contexts, rich results, bash.

use std::time::{Duration, Instant};

use base64::Engine;
use futures::StreamExt;
use moat_api::{CodeEvent, CodeLanguage, CodeResult, ErrorCode, RunCodeRequest};
use moat_client::Client;

use crate::harness::*;

/// Everything one cell produced.
#[derive(Debug, Default)]
struct Cell {
    stdout: String,
    stderr: String,
    results: Vec<CodeResult>,
    errors: Vec<moat_api::CodeError>,
    execution_count: u64,
}

impl Cell {
    fn main_text(&self) -> Option<&str> {
        self.results
            .iter()
            .find(|r| r.is_main_result)
            .and_then(|r| r.text.as_deref())
    }
}

async fn run(c: &Client, id: &str, req: RunCodeRequest) -> Cell {
    let mut events = c.run_code(id, &req).await.expect("run code");
    let mut cell = Cell::default();
    let mut ended = false;
    while let Some(ev) = events.next().await {
        assert!(!ended, "event after end");
        match ev.expect("code event") {
            CodeEvent::Stdout { data } => cell.stdout.push_str(&data),
            CodeEvent::Stderr { data } => cell.stderr.push_str(&data),
            CodeEvent::Result(r) => cell.results.push(r),
            CodeEvent::Error(e) => cell.errors.push(e),
            CodeEvent::End {
                execution_count, ..
            } => {
                cell.execution_count = execution_count;
                ended = true;
            }
        }
    }
    assert!(ended, "no end event");
    cell
}

fn py(code: &str) -> RunCodeRequest {
    RunCodeRequest {
        code: code.into(),
        ..Default::default()
    }
}

fn in_ctx(ctx: &str, code: &str) -> RunCodeRequest {
    RunCodeRequest {
        code: code.into(),
        context_id: Some(ctx.into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn python_state_errors_and_streaming() {
    let c = shared_client();
    let s = create(&c, "base").await;

    // State carries across calls in the default context.
    assert!(run(&c, &s.id, py("x = 1")).await.results.is_empty());
    run(&c, &s.id, py("x += 1")).await;
    let cell = run(&c, &s.id, py("x")).await;
    assert_eq!(cell.main_text(), Some("2"), "{cell:?}");
    assert_eq!(cell.execution_count, 3);

    // Imports and cwd persist.
    run(&c, &s.id, py("import os, json\nos.chdir('/tmp')")).await;
    let cell = run(&c, &s.id, py("print(os.getcwd()); json.dumps([1])")).await;
    assert_eq!(cell.stdout, "/tmp\n");
    assert_eq!(cell.main_text(), Some("'[1]'"));

    // Output of subprocesses is captured too, and never breaks the protocol.
    let cell = run(
        &c,
        &s.id,
        py("import subprocess\nsubprocess.run(['sh', '-c', 'echo sub; echo bad >&2'])\nos.write(1, b'{\"id\": 1}\\n')\nNone"),
    )
    .await;
    assert_eq!(cell.stdout, "sub\n{\"id\": 1}\n", "{cell:?}");
    assert_eq!(cell.stderr, "bad\n");

    // An exception: name, value and a traceback that points at the cell.
    let cell = run(&c, &s.id, py("def f():\n    return 1 / 0\nf()")).await;
    assert_eq!(cell.errors.len(), 1, "{cell:?}");
    let e = &cell.errors[0];
    assert_eq!(e.name, "ZeroDivisionError");
    assert_eq!(e.value, "division by zero");
    assert!(
        e.traceback.contains("Traceback") && e.traceback.contains("return 1 / 0"),
        "{}",
        e.traceback
    );
    assert!(!e.traceback.contains("kernel.py"), "{}", e.traceback);
    let cell = run(&c, &s.id, py("def broken(:")).await;
    assert_eq!(cell.errors[0].name, "SyntaxError");

    // Output streams while the cell runs: the first chunk arrives well before the end.
    let t0 = Instant::now();
    let mut events = c
        .run_code(
            &s.id,
            &py("import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')"),
        )
        .await
        .unwrap();
    let mut first_at = None;
    let mut end_at = None;
    let mut out = String::new();
    while let Some(ev) = events.next().await {
        match ev.unwrap() {
            CodeEvent::Stdout { data } => {
                if first_at.is_none() {
                    first_at = Some(t0.elapsed());
                }
                out.push_str(&data);
            }
            CodeEvent::End { .. } => end_at = Some(t0.elapsed()),
            _ => {}
        }
    }
    let (first_at, end_at) = (first_at.unwrap(), end_at.unwrap());
    assert_eq!(out, "first\nsecond\n");
    assert!(
        end_at >= Duration::from_secs(2) && end_at - first_at >= Duration::from_millis(1500),
        "first chunk at {first_at:?}, end at {end_at:?}"
    );

    // env applies to the cell only.
    let cell = run(
        &c,
        &s.id,
        RunCodeRequest {
            code: "os.environ.get('GREETING')".into(),
            env: env(&[("GREETING", "hi")]),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(cell.main_text(), Some("'hi'"));
    let cell = run(&c, &s.id, py("os.environ.get('GREETING')")).await;
    assert_eq!(cell.main_text(), None);

    // A class with rich representations.
    let cell = run(
        &c,
        &s.id,
        py("class T:\n    def _repr_html_(self): return '<b>t</b>'\n    def _repr_markdown_(self): return '**t**'\nT()"),
    )
    .await;
    let r = &cell.results[0];
    assert_eq!(r.html.as_deref(), Some("<b>t</b>"));
    assert_eq!(r.markdown.as_deref(), Some("**t**"));
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_interrupts_without_losing_state() {
    let c = shared_client();
    let s = create(&c, "base").await;
    run(&c, &s.id, py("keep = 41")).await;
    let t0 = Instant::now();
    let cell = run(
        &c,
        &s.id,
        RunCodeRequest {
            code: "while True: pass".into(),
            timeout: Some(2.0),
            ..Default::default()
        },
    )
    .await;
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(8), "took {took:?}");
    assert_eq!(cell.errors.len(), 1, "{cell:?}");
    assert_eq!(cell.errors[0].name, "TimeoutError");
    // Same kernel, same state.
    let cell = run(&c, &s.id, py("keep + 1")).await;
    assert_eq!(cell.main_text(), Some("42"), "{cell:?}");

    // A sleeping cell (in C code) is interrupted too.
    let cell = run(
        &c,
        &s.id,
        RunCodeRequest {
            code: "import time\ntime.sleep(60)".into(),
            timeout: Some(1.0),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(cell.errors[0].name, "TimeoutError");
    assert_eq!(run(&c, &s.id, py("keep")).await.main_text(), Some("41"));
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn contexts_create_list_restart_delete() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let a = c
        .create_code_context(&s.id, CodeLanguage::Python, Some("/tmp"))
        .await
        .unwrap();
    assert_eq!(a.cwd, "/tmp");
    assert_eq!(a.language, CodeLanguage::Python);
    let b = c
        .create_code_context(&s.id, CodeLanguage::Python, None)
        .await
        .unwrap();
    assert_ne!(a.id, b.id);

    // Contexts are separate.
    run(&c, &s.id, in_ctx(&a.id, "v = 'a'")).await;
    run(&c, &s.id, in_ctx(&b.id, "v = 'b'")).await;
    let cell = run(&c, &s.id, in_ctx(&a.id, "import os\n(v, os.getcwd())")).await;
    assert_eq!(cell.main_text(), Some("('a', '/tmp')"));
    assert_eq!(
        run(&c, &s.id, in_ctx(&b.id, "v")).await.main_text(),
        Some("'b'")
    );

    let ids: Vec<String> = c
        .list_code_contexts(&s.id)
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.id)
        .collect();
    assert!(ids.contains(&a.id) && ids.contains(&b.id), "{ids:?}");

    // Restart: same id, state gone.
    let r = c.restart_code_context(&s.id, &a.id).await.unwrap();
    assert_eq!(r.id, a.id);
    assert_eq!(r.cwd, "/tmp");
    let cell = run(&c, &s.id, in_ctx(&a.id, "v")).await;
    assert_eq!(cell.errors[0].name, "NameError", "{cell:?}");
    assert_eq!(cell.execution_count, 1);

    // Delete: gone from the list, and using it is a 404 naming the field.
    c.delete_code_context(&s.id, &b.id).await.unwrap();
    let ids: Vec<String> = c
        .list_code_contexts(&s.id)
        .await
        .unwrap()
        .into_iter()
        .map(|x| x.id)
        .collect();
    assert!(!ids.contains(&b.id), "{ids:?}");
    let err = c.run_code(&s.id, &in_ctx(&b.id, "1")).await.err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");
    assert!(err.to_string().contains("context_id"), "{err}");
    let err = c.delete_code_context(&s.id, &b.id).await.err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");

    // Bad input names the field.
    let err = c.run_code(&s.id, &py("  ")).await.err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::InvalidArgument));
    assert!(err.to_string().contains("code"), "{err}");
    let err = c
        .create_code_context(&s.id, CodeLanguage::Python, Some("/no/such/dir"))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("cwd"), "{err}");
    let err = c
        .run_code(
            &s.id,
            &RunCodeRequest {
                code: "1".into(),
                context_id: Some(a.id.clone()),
                language: Some(CodeLanguage::Bash),
                ..Default::default()
            },
        )
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("language"), "{err}");
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{}/code", shared().url, s.id))
        .bearer_auth(shared().api_key())
        .body(r#"{"code":"1","language":"ruby"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: moat_api::ErrorBody = resp.json().await.unwrap();
    assert_eq!(body.error.field.as_deref(), Some("language"), "{body:?}");

    // javascript without node in the template: a clear 400 naming `language`.
    let err = c
        .run_code(
            &s.id,
            &RunCodeRequest {
                code: "1 + 1".into(),
                language: Some(CodeLanguage::Javascript),
                ..Default::default()
            },
        )
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Some(ErrorCode::InvalidArgument), "{err}");
    assert!(
        err.to_string().contains("language") && err.to_string().contains("node"),
        "{err}"
    );
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn bash_context_keeps_cwd_and_variables() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let bash = |code: &str| RunCodeRequest {
        code: code.into(),
        language: Some(CodeLanguage::Bash),
        ..Default::default()
    };
    let cell = run(&c, &s.id, bash("cd /tmp && NAME=moat\nmkdir -p d")).await;
    assert!(cell.errors.is_empty(), "{cell:?}");
    let cell = run(&c, &s.id, bash("echo \"$NAME in $(pwd)\"; echo oops >&2")).await;
    assert_eq!(cell.stdout, "moat in /tmp\n");
    assert_eq!(cell.stderr, "oops\n");
    assert_eq!(cell.execution_count, 2);
    // Output without a trailing newline and a failing status.
    let cell = run(&c, &s.id, bash("printf partial; false")).await;
    assert_eq!(cell.stdout, "partial");
    assert_eq!(cell.errors.len(), 1, "{cell:?}");
    // A here-document and a `read` do not eat the kernel's own input.
    let cell = run(
        &c,
        &s.id,
        bash("cat <<X\nhello\nX\nread line; echo \"[$line]\""),
    )
    .await;
    assert_eq!(cell.stdout, "hello\n[]\n", "{cell:?}");
    // Timeout interrupts the cell; the shell and its variables survive.
    let cell = run(
        &c,
        &s.id,
        RunCodeRequest {
            timeout: Some(1.0),
            ..bash("sleep 30; echo never")
        },
    )
    .await;
    assert_eq!(cell.errors[0].name, "TimeoutError", "{cell:?}");
    assert!(!cell.stdout.contains("never"));
    let cell = run(&c, &s.id, bash("echo $NAME; pwd")).await;
    assert_eq!(cell.stdout, "moat\n/tmp\n");
    c.delete_sandbox(&s.id).await.unwrap();
}

/// Width and height from a PNG's IHDR chunk, after checking the signature.
fn png_size(b64: &str) -> (u32, u32) {
    let png = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&png[12..16], b"IHDR");
    let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
    (w, h)
}

#[tokio::test(flavor = "multi_thread")]
async fn matplotlib_and_pandas_rich_results() {
    let c = code_interpreter().client();
    let s = create(&c, "code-interpreter").await;
    let cell = run(
        &c,
        &s.id,
        py("import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 3), dpi=50)\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()\nprint('drawn')"),
    )
    .await;
    assert!(cell.errors.is_empty(), "{cell:?}");
    assert_eq!(cell.stdout, "drawn\n");
    let pngs: Vec<&CodeResult> = cell.results.iter().filter(|r| r.png.is_some()).collect();
    assert_eq!(pngs.len(), 1, "{:?}", cell.results);
    let (w, h) = png_size(pngs[0].png.as_ref().unwrap());
    assert!(w > 50 && h > 50 && w < 1000 && h < 1000, "{w}x{h}");
    assert!(!pngs[0].is_main_result);

    // Figures are closed after they are sent: the next cell has none.
    let cell = run(&c, &s.id, py("len(plt.get_fignums())")).await;
    assert_eq!(cell.main_text(), Some("0"));

    // svg on request, through matplotlib's own setting.
    let cell = run(
        &c,
        &s.id,
        py("plt.rcParams['savefig.format'] = 'svg'\nplt.plot([1, 2])\nNone"),
    )
    .await;
    let svg = cell
        .results
        .iter()
        .find_map(|r| r.svg.clone())
        .expect("svg");
    assert!(svg.contains("<svg"), "{svg:.200}");

    let cell = run(
        &c,
        &s.id,
        py("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf"),
    )
    .await;
    assert!(cell.errors.is_empty(), "{cell:?}");
    let r = cell.results.iter().find(|r| r.is_main_result).unwrap();
    assert!(r.html.as_deref().unwrap_or("").contains("<table"), "{r:?}");
    assert!(r.text.as_deref().unwrap_or("").contains('a'), "{r:?}");
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn javascript_context_keeps_state() {
    let c = code_interpreter().client();
    let s = create(&c, "code-interpreter").await;
    let js = |code: &str| RunCodeRequest {
        code: code.into(),
        language: Some(CodeLanguage::Javascript),
        ..Default::default()
    };
    let cell = run(&c, &s.id, js("let a = 40; console.log('hello from node')")).await;
    assert!(cell.errors.is_empty(), "{cell:?}");
    assert_eq!(cell.stdout, "hello from node\n");
    let cell = run(&c, &s.id, js("a + 2")).await;
    assert_eq!(cell.main_text(), Some("42"), "{cell:?}");
    let cell = run(&c, &s.id, js("nope.x")).await;
    assert_eq!(cell.errors.len(), 1, "{cell:?}");
    assert_eq!(cell.errors[0].name, "ReferenceError");
    // The state survived the error.
    let cell = run(&c, &s.id, js("a")).await;
    assert_eq!(cell.main_text(), Some("40"), "{cell:?}");
    c.delete_sandbox(&s.id).await.unwrap();
}
