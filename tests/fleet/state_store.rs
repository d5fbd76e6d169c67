//! The hub's state store as an operator meets it: one hub per state dir, refused with the
//! holder's name, free again the moment the holder dies.

use crate::support::{HubProc, run_to_exit};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hub_on_a_held_state_dir_exits_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = HubProc::start(dir.path(), None, &[], &[], "first.log");
    let state = first.state.display().to_string();
    let holder = format!("pid {}", first.proc.pid());
    let second = |command: &str, log: &str| {
        let args: Vec<String> = [command, "--listen", "127.0.0.1:0", "--state-dir", &state]
            .map(String::from)
            .to_vec();
        run_to_exit(&args, &dir.path().join(log))
    };
    for (command, log) in [("hub", "second.log"), ("serve", "serve.log")] {
        let (status, stderr) = second(command, log);
        assert_eq!(status.code(), Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains(&format!("the state dir {state} is held by another hub")),
            "{command}: {stderr}"
        );
        assert!(stderr.contains(&holder), "{command}: {stderr}");
    }
    // Refused before it touched anything: the first hub's tokens are as they were.
    let read = |name: &str| std::fs::read_to_string(first.state.join(name)).unwrap();
    assert_eq!(read("admin.token").trim(), first.admin);
    assert_eq!(read("fleet.token").trim(), first.fleet);
    let (code, _) = first.get("/health").await;
    assert_eq!(code, 200, "the holder serves on");

    // However the holder ends, the dir is free at once: no stale lock to clear.
    first.proc.kill();
    let next = HubProc::start(dir.path(), None, &[], &[], "next.log");
    assert_eq!(
        next.admin, first.admin,
        "the same state dir, the same tokens"
    );
    let (code, _) = next.get("/health").await;
    assert_eq!(code, 200);
}
