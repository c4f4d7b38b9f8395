//! E2B's envd messages (`process.*`, `filesystem.*`), generated at build time from the `.proto` files
//! in `proto/` (E2B's published interface). Serialized with the protobuf JSON mapping (camelCase
//! names, enums by name, int64 as strings, bytes as base64, oneofs inline), as Connect's JSON codec
//! expects; unknown fields are ignored, as E2B's own codec does.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod process {
    include!(concat!(env!("OUT_DIR"), "/process.rs"));
    include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
}

pub mod filesystem {
    include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
    include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
}

pub use pbjson_types;

#[cfg(test)]
mod tests {
    use super::process::*;

    #[test]
    fn json_mapping_matches_what_the_sdk_sends() {
        let req: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"X":"y"},"cwd":"/tmp"},"stdin":false,"newField":1}"#,
        )
        .unwrap();
        let p = req.process.unwrap();
        assert_eq!(
            (p.cmd.as_str(), p.args.len(), p.cwd.as_deref()),
            ("/bin/bash", 3, Some("/tmp"))
        );
        assert_eq!(req.stdin, Some(false));
        let ev = StartResponse {
            event: Some(ProcessEvent {
                event: Some(process_event::Event::Data(process_event::DataEvent {
                    output: Some(process_event::data_event::Output::Stdout(b"hi\n".to_vec())),
                })),
            }),
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"data":{"stdout":"aGkK"}}}"#
        );
        let sig: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(sig.signal(), Signal::Sigkill);
    }
}
